"""Which request is which, for operators: the request id, and one log line per generation request.

A client's or router's `X-Request-Id` header names the request, as in vLLM: a completion's `id`
is `cmpl-<id>` (chat: `chatcmpl-<id>`), and every response carries the id back in its own
`X-Request-Id` header (one the server made, when none was sent). An id longer than
MAX_REQUEST_ID_CHARS, or with a character outside printable ASCII (spaces and control characters
included), is refused on the generation routes: it would reach the log and the response. Each
generation request that reached the engine ends with one INFO line (`request_done`): its id, its
prompt, cached (by tier) and generated token counts, TTFT and total time. Nothing here ever logs a
prompt, an answer, or a header other than the request id.
"""

from __future__ import annotations

import logging
import re
import uuid

from .protocol import APIError

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256
HEADER = b"x-request-id"
_SCOPE_KEY = "tierkv.request_id"  # (id, what is wrong with the header or None, whether it is the client's)
_PRINTABLE = re.compile(r"[!-~]+")  # printable ASCII, no space


def _problem(given: str) -> str | None:
    if len(given) > MAX_REQUEST_ID_CHARS:
        return f"has {len(given)} characters; at most {MAX_REQUEST_ID_CHARS} are taken"
    if not _PRINTABLE.fullmatch(given):
        return "must be printable ASCII, without spaces or control characters"
    return None


class RequestIdHeader:
    """ASGI middleware: the request's id from its X-Request-Id header (a fresh one when there is
    none, or when it is unusable), kept in the scope for the routes and sent back in the
    response's X-Request-Id header."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == HEADER), "")
        problem = _problem(given) if given else None  # an empty header is no id
        ours = not given or problem is not None
        rid = uuid.uuid4().hex if ours else given
        scope[_SCOPE_KEY] = (rid, problem, not ours)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, rid.encode("ascii"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_ids(scope, chat: bool) -> tuple[str, str]:
    """(the response's id, the engine's) for a generation request; APIError 400 when its
    X-Request-Id cannot be used. The engine's id adds a suffix to a client's id, so that two
    requests sent with the same id both run (vLLM's engine does the same)."""
    rid, problem, clients = scope[_SCOPE_KEY]
    if problem is not None:
        raise APIError(400, f"the X-Request-Id header {problem}: send another id, or none (the server then "
                       "makes one)", param="X-Request-Id", code="invalid_request_id")
    public = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
    return public, f"{public}-{uuid.uuid4().hex[:8]}" if clients else public


def request_done(request_id: str, finish: str, *, prompt_tokens: int, cached_tokens: int,
                 cached_by_tier: dict[str, int] | None, generated_tokens: int, ttft_s: float | None,
                 total_s: float) -> None:
    """The one line per request, logfmt-style so that log tools parse it. `finish`: stop, length,
    abort (the client left), error (the engine failed it or the server shut down)."""
    tiers = cached_by_tier or {}
    log.info("request id=%s finish=%s prompt_tokens=%d cached_tokens=%d cached_l1=%d cached_l2=%d cached_l3=%d "
             "generated_tokens=%d ttft_s=%s total_s=%.3f", request_id, finish, prompt_tokens, cached_tokens,
             tiers.get("l1", 0), tiers.get("l2", 0), tiers.get("l3", 0), generated_tokens,
             "-" if ttft_s is None else f"{ttft_s:.3f}", total_s)
