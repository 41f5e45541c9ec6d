"""What one client can make tierkv-serve hold: body size, JSON shape, read and send time, connections.

Two parts. `BodyLimits` is ASGI middleware: it refuses a Content-Length over the cap before
reading a byte, reads any other body only up to the cap, and checks the JSON's nesting and
Unicode before the routes parse it. `protocol()` is uvicorn's h11 protocol with what ASGI cannot
see: deadlines for a request's headers and body, a deadline for a send buffer that stays full, a
cap on open connections and on requests per keep-alive connection. Every refusal is OpenAI's error
JSON naming the limit and the flag that changes it. Nothing here logs or echoes a request's content.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.flow_control import CLOSE_HEADER
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import APIError

MIB = 1024 * 1024
MIN_REQUEST_BYTES = 1 * MIB
BYTES_PER_TOKEN = 64  # JSON of one token: ~4 chars of text, up to 6 bytes per \uXXXX escape, or an id and a comma
MAX_JSON_DEPTH = 32  # the deepest valid request is 4 levels ({"messages": [{"content": [{...}]}]})
MAX_HEADER_BYTES = 16 * 1024  # h11's own limit on a request line plus headers
PARSED = "tierkv.json"  # the scope key under which BodyLimits leaves the JSON body it parsed


def default_max_request_bytes(max_model_len: int) -> int:
    """A body that can carry a full-context prompt, however it is spelled, and not much more."""
    return max(MIN_REQUEST_BYTES, BYTES_PER_TOKEN * max_model_len)


@dataclass(frozen=True)
class Limits:
    """The server's options of the same names (cli.SERVER_OPTIONS holds their defaults)."""

    max_request_bytes: int
    header_timeout: float  # first byte of a request (or the connection's opening) to its last header
    body_timeout: float  # last header to last body byte
    send_timeout: float  # how long the send buffer may stay full before the response is dropped
    send_buffer_bytes: int  # queued for one client, in the kernel and again in the server's own buffer
    keep_alive_timeout: float  # idle time between requests on one connection (uvicorn's own timer)
    max_connections: int
    max_keep_alive_requests: int


def error_bytes(err: APIError) -> bytes:
    """A whole HTTP/1.1 response carrying `err` that closes the connection, for places with no ASGI
    app to answer (a deadline, the connection cap)."""
    body = json.dumps(err.body()).encode()
    reason = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}.get(err.status, b"Error")
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (err.status, reason, len(body)))
    return head + body


# ---------------------------------------------------------------------------- bodies


def _too_large(limit: int, size: int | None) -> APIError:
    got = f"is {size} bytes" if size is not None else "(sent without a length) grew past that"
    return APIError(413, f"this server accepts request bodies of at most {limit} bytes and this one {got}; "
                    "--max-request-bytes raises the limit", code="request_too_large")


NOT_JSON = object()  # what parse_json returns for a body that is not JSON at all
_SCALARS = {int, float, bool, type(None)}


def parse_json(body: bytes) -> tuple[object, APIError | None]:
    """The body parsed, and the error for one the routes must not take (too deep, not UTF-8, a lone
    surrogate, a huge number); NOT_JSON when it is not JSON at all (the routes answer that with their own
    message)."""
    try:
        data = json.loads(body)
    except RecursionError:
        return NOT_JSON, _too_deep(None)
    except json.JSONDecodeError:
        return NOT_JSON, None
    except UnicodeDecodeError:  # a ValueError too: caught before the one below
        return NOT_JSON, APIError(400, "the request body is not valid UTF-8: send JSON encoded as UTF-8",
                                  code="invalid_unicode")
    except ValueError:  # Python's cap on the digits of an int (4300): say so instead of a parse error
        return NOT_JSON, APIError(400, "a number in the request body has too many digits; no field takes more "
                                  "than 20", code="invalid_json")
    # depth counts objects and arrays: {"a": [1]} is 2 levels
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                return data, _too_deep(depth)
            items = [*value, *value.values()] if isinstance(value, dict) else value
            if isinstance(value, list) and {*map(type, value)} <= _SCALARS:
                continue  # a token-id prompt: one pass in C rather than a Python step per id
            stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list, str)))
        elif isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:  # JSON can spell "\ud800", which no tokenizer or hash can take
                return data, APIError(400, "a string in the request holds a lone UTF-16 surrogate (like \\ud800); "
                                      "send valid Unicode (a surrogate pair, or the character itself)",
                                      code="invalid_unicode")
    return data, None


def _too_deep(depth: int | None) -> APIError:
    got = f"nested {depth} levels deep" if depth is not None else "nested too deeply to parse"
    return APIError(400, f"the request body is {got}; the limit is {MAX_JSON_DEPTH} levels",
                    code="json_too_deep")


class BodyLimits:
    """ASGI middleware: read each body up to `max_bytes` (413 past it, before reading when the
    Content-Length says so), check the JSON of POSTs, then hand the routes the body."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and int(length) > self.max_bytes:  # h11 has checked that it is a number
            return await _answer(_too_large(self.max_bytes, int(length)), send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # the client left (or a deadline cut it off): nobody to answer
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:  # a chunked body with no length: stop reading at the cap
                return await _answer(_too_large(self.max_bytes, None), send)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        chunks.clear()
        if body and scope["method"] == "POST":  # every POST route takes JSON
            data, err = parse_json(body)
            if err is not None:
                return await _answer(err, send)
            if data is not NOT_JSON:
                scope[PARSED] = data  # the routes take it from here rather than parse the body again
        sent = False

        async def replay():
            # the body once, then the real receive: the routes still learn when the client goes away
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _answer(err: APIError, send) -> None:
    """Send `err` and close the connection: an unread body must not be parsed as the next request."""
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), CLOSE_HEADER]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ---------------------------------------------------------------------------- connections


class _Hardened(H11Protocol):
    """One connection. At most one read deadline runs at a time: for the headers while a request
    is awaited (from the connection's opening, or from the first byte after a response), then for
    the body. The send deadline runs while the transport's write buffer is over its high mark."""

    limits: Limits
    on_close: Callable[[str], None]  # counts connections closed by a limit, by reason

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._parsed = None  # the last cycle whose headers were in
        self._awaiting = True  # no request in progress: the next byte starts the header deadline
        self._requests = 0

    def connection_made(self, transport) -> None:
        full = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if full:
            self._refuse("max_connections", APIError(
                503, f"the server has {self.limits.max_connections} open connections, its limit "
                "(--max-connections); retry later", type="server_error", code="too_many_connections"))
            return
        # A bounded buffer, not the kernel's autotuned megabytes: a client that stops reading holds
        # little memory, and its buffer fills soon enough for the send deadline to start
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
        transport.set_write_buffer_limits(high=self.limits.send_buffer_bytes)
        self._arm_read(self.limits.header_timeout, self._header_expired)

    def connection_lost(self, exc) -> None:
        self._cancel_read()
        self._cancel_send()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting and self._read_timer is None:
            self._arm_read(self.limits.header_timeout, self._header_expired)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None or self.transport.is_closing():
            return
        if cycle is not self._parsed:  # a new request's headers are in
            self._parsed, self._awaiting = cycle, False
            self._requests += 1
            self._cancel_read()
            if self._requests >= self.limits.max_keep_alive_requests:
                # uvicorn answers "connection: close" (and then closes) when the request asked for it
                self.headers.append(CLOSE_HEADER)
            if cycle.more_body:
                self._arm_read(self.limits.body_timeout, self._body_expired)
        elif not cycle.more_body:
            self._cancel_read()  # the body is complete

    def on_response_complete(self) -> None:
        self._awaiting = True
        self._cancel_read()
        self._cancel_send()
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        # h11 could not parse the request (malformed, or headers over its size limit)
        self.transport.write(error_bytes(APIError(
            400, f"invalid HTTP request (malformed, or a request line and headers over {MAX_HEADER_BYTES} "
            "bytes)", code="invalid_http")))
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout, self._send_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_send()

    # --- deadlines

    def _arm_read(self, seconds: float, callback: Callable[[], None]) -> None:
        self._cancel_read()
        self._read_timer = self.loop.call_later(seconds, callback)

    def _cancel_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _cancel_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _header_expired(self) -> None:
        self._read_timer = None
        if self.conn.trailing_data[0]:  # part of a request came: tell the client why it is cut off
            self._refuse("header_timeout", APIError(
                408, f"the request headers did not arrive within {self.limits.header_timeout:g} s "
                "(--header-timeout)", code="request_timeout"))
        else:  # an idle connection: nothing to answer
            self.on_close("idle_timeout")
            self.transport.close()

    def _body_expired(self) -> None:
        self._read_timer = None
        cycle = self.cycle
        # the app waiting on receive() gets http.disconnect, and whatever it sends is dropped
        cycle.disconnected = True
        cycle.message_event.set()
        if cycle.response_started:
            self.on_close("body_timeout")
            self.transport.close()
        else:
            self._refuse("body_timeout", APIError(
                408, f"the request body did not arrive within {self.limits.body_timeout:g} s of its headers "
                "(--body-timeout)", code="request_timeout"))

    def _send_expired(self) -> None:
        # the client stopped reading: drop the response; connection_lost tells the app, whose
        # stream then aborts the request and frees its KV blocks
        self._send_timer = None
        self.on_close("send_timeout")
        self.transport.abort()

    def _refuse(self, reason: str, err: APIError) -> None:
        self.on_close(reason)
        self._cancel_read()
        self.transport.write(error_bytes(err))
        self.transport.close()


def protocol(limits: Limits, on_close: Callable[[str], None] = lambda reason: None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits`; pass it as uvicorn.Config(http=...)."""
    return type("TierKVHTTP", (_Hardened,), {"limits": limits, "on_close": staticmethod(on_close)})
