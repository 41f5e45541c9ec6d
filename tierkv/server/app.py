"""The FastAPI app of tierkv-serve: OpenAI routes, health, metrics, cache stats.

Every error leaves as OpenAI's error JSON with a 4xx status (a 5xx only for a fault of the
server itself, with a generic message): no stack trace, request body or secret ever reaches a
client or a log line. Generation runs on the AsyncEngine thread; a client that goes away
mid-request has its request aborted. This file never touches the Engine directly.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import warnings
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api_errors import api_error, error_response
from .async_engine import AsyncEngine, ShuttingDown
from .limits import PARSED, BodyLimits, default_max_request_bytes
from .metrics import ServerMetrics
from .profiling import add_profile_routes
from .request_log import RequestIdHeader, request_done, request_ids
from .protocol import (
    ERRORS,
    REFUSED,
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    publish_openapi,
    streamed,
    usage,
)
from .serving import (
    FINISH,
    chat_logprobs,
    completion_logprobs,
    extra_fields,
    prepare_chat,
    prepare_completion,
    sse,
)
from .tokenizing import Tokenizing
from .worker_routes import Served, add_worker_routes

log = logging.getLogger(__name__)

# how pydantic names the member of a union in an error's location: str, list[int], constrained-str
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|constrained-\w+|[\w-]+\[.*\])$")


class _ParsedRequest(Request):
    async def json(self):
        return self.scope[PARSED] if PARSED in self.scope else await super().json()


class _ParsedRoute(APIRoute):
    """FastAPI's route, taking the JSON body that BodyLimits parsed (to check it) instead of parsing
    it again: a 12K-token prompt is ~90 KB of JSON."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_ParsedRequest(request.scope, request.receive))

        return route


def _operation_id(route: APIRoute) -> str:
    """FastAPI's operation id less its method: _openapi adds each operation's own."""
    return re.sub(r"\W", "_", f"{route.name}{route.path_format}")


def _openapi(app: FastAPI, strict_request_fields: bool) -> Callable[[], dict]:
    """app.openapi: FastAPI's schema with an operation id of its own for each method (FastAPI gives
    the GET and HEAD of one route the same), and what protocol.publish_openapi adds."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")  # made unique below
                schema = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                                     description=app.description, routes=app.routes)
            for item in schema["paths"].values():
                for method, op in item.items():
                    op["operationId"] = f"{op['operationId']}_{method}"
            publish_openapi(schema["components"]["schemas"], strict_request_fields)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


class _Guard:
    """ASGI middleware: API key on /v1 (before the body is parsed, so a bad key always gets 401),
    503 while draining, and request counts by route and status."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in self.state.routes else "other"  # bounded label set

        async def counted(msg):
            if msg["type"] == "http.response.start":
                self.state.metrics.requests.labels(route, str(msg["status"])).inc()
            await send(msg)

        err = None
        if path.startswith("/v1") and self.state.api_key is not None:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode("latin-1"), self.state.api_key.encode()):
                err = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                               type="invalid_request_error", code="invalid_api_key")
        if err is None and path.startswith(("/v1/completions", "/v1/chat")):
            refused = self.state.engine.refusal()
            err = api_error(refused) if refused is not None else None
        if err is not None:
            return await error_response(err)(scope, receive, counted)
        await self.app(scope, receive, counted)


def create_app(engine: AsyncEngine, served: Served, *, api_key: str | None = None, grace_s: float = 30.0,
               flush_timeout_s: float = 60.0, max_request_bytes: int | None = None, kv_events=None,
               strict_request_fields: bool = False, load_format: str = "vllm", profile_dir: Path | None = None) -> FastAPI:
    """`served`: the model and how it is named. `max_request_bytes`: the largest request body read
    (default: derived from its context length). `kv_events`: the KVEventPublisher (kv_events.py)
    when KV-cache events are published. `strict_request_fields`: refuse unknown request fields
    instead of ignoring and counting them. `load_format`: GET /get_load's shape (worker_routes.py).
    `profile_dir`: serve /start_profile and /stop_profile, writing traces there (profiling.py)."""
    metrics = ServerMetrics(engine, served.name, served.cache_config, kv_events)
    names, max_model_len = [served.name], served.max_model_len
    # prompts are tokenized and chat templates applied here, never on the engine thread
    tokenizing = Tokenizing(served.root, refusal=engine.refusal)

    def accept(body) -> None:
        """Count the request's unknown fields; refuse the ones that would change the result."""
        metrics.count_unknown_fields(extra_fields(body, strict_request_fields))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.started:
            engine.start()
        yield
        await engine.shutdown(grace_s, flush_timeout_s)

    app = FastAPI(title="tierkv-serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server over tierkv's tiered KV cache",
                  generate_unique_id_function=_operation_id)
    app.openapi = _openapi(app, strict_request_fields)
    app.router.route_class = _ParsedRoute
    state = app.state
    state.engine, state.metrics, state.api_key = engine, metrics, api_key

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        # a value that fits no member of a union fails once per member: a broken limit ("at most 4
        # items") says more than a mismatch against another member ("should be a valid string", "unable
        # to parse string as an integer")
        first = next((e for e in errors if not e.get("type", "").endswith(("_type", "_parsing"))),
                     errors[0] if errors else {})
        if first.get("type") == "json_invalid":
            return error_response(APIError(400, "the request body is not valid JSON", code="invalid_json"))
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_MEMBER.match(str(p))]
        if first.get("type") == REFUSED:  # a rule of protocol.py's validators: its message says it all
            param = (first.get("ctx") or {}).get("param") or (loc[0] if loc else None)
            return error_response(APIError(400, first["msg"], param=param))
        if not loc:  # the body itself is wrong: not an object, or not sent as JSON
            return error_response(APIError(400, "the request body must be a JSON object (with Content-Type: "
                                   "application/json)", code="invalid_json"))
        where = ".".join(loc) or "body"
        msg = first.get("msg", "invalid request")
        return error_response(APIError(400, f"{where}: {msg}", param=loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # its headers too: a 405 names the methods the route takes (Allow)
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        log.error("unhandled %s on %s", type(exc).__name__, request.url.path)
        return error_response(APIError(500, "internal server error", type="server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if engine.failed is not None:
            return JSONResponse({"status": "failed", "reason": engine.failed}, status_code=503)
        if engine.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        # A degraded L3 store (hung, down, failing its writes) is named, yet the answer stays 200:
        # every request is still served, its blocks recomputed. Read from the stats snapshot, so a
        # hung store never holds /health up.
        degraded = [{"tier": "l3", "store": st["store"], "problems": st["degraded"]}
                    for st in (engine.stats or {}).get("l3_stores", []) if not st["healthy"]]
        if degraded:
            return {"status": "degraded", "degraded": degraded}
        return {"status": "ok"}

    @app.api_route("/metrics", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_event_sources")
    async def kv_event_sources(request: Request):
        """vLLM's discovery of the KV-event publishers: one per data-parallel rank, none when off."""
        return [] if kv_events is None else kv_events.sources(request.url.hostname)

    @app.get("/v1/cache/stats", responses=ERRORS)
    async def cache_stats():
        try:
            return await engine.call(lambda e: e.cache_stats())
        except ShuttingDown as err:
            return error_response(api_error(err))

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**ERRORS, **streamed(CompletionChunk)})
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(body, request, prepare_completion, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**ERRORS, **streamed(ChatCompletionChunk)})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(body, request, prepare_chat, chat=True)

    async def _generate(body, request: Request, prepare, chat: bool):
        arrival = time.monotonic()  # latencies count the tokenizing and the wait for the engine thread
        try:
            public, rid = request_ids(request.scope, chat)  # the response's id (X-Request-Id), the engine's
            accept(body)
            encode = prepare(body, names, max_model_len)
            prompt_ids, params = await tokenizing.run(encode, tokenizes=encode.tokenizes)
            stream = await engine.submit(prompt_ids, params, request_id=rid, cache_salt=body.cache_salt,
                                         priority=body.priority, arrival=arrival)
        except Exception as err:  # noqa: BLE001 (every failure becomes an error response)
            return error_response(api_error(err))
        if body.stream:
            opts = body.stream_options
            include_usage = bool(opts and opts.include_usage)
            continuous = include_usage and opts.continuous_usage_stats
            gen = _stream_chat if chat else _stream_completion
            return StreamingResponse(gen(stream, public, body.model, include_usage, continuous),
                                     media_type="text/event-stream")
        return await _complete(stream, public, request, body.model, chat)

    def _first_token(stream, out) -> float:
        """The request has its first token: count its prompt (as the cache counted its lookup)."""
        metrics.first_token(prompt_tokens=stream.prompt_tokens, cached_tokens=out.cached_tokens)
        return time.monotonic()

    def _finish(stream, public: str, out, first_at: float | None, completion_tokens: int) -> None:
        now = time.monotonic()
        reason = FINISH.get(out.finish_reason, out.finish_reason)
        metrics.observe(ttft=None if first_at is None else first_at - stream.arrival, e2e=now - stream.arrival,
                        completion_tokens=completion_tokens, finished_reason=reason)
        _log_end(stream, public, reason, out, first_at, completion_tokens)

    def _log_end(stream, public: str, finish: str, out, first_at: float | None, generated: int) -> None:
        """The request's one log line. `out`: its latest output (None before any)."""
        request_done(public, finish, prompt_tokens=stream.prompt_tokens,
                     cached_tokens=out.cached_tokens if out is not None else 0,
                     cached_by_tier=out.cached_by_tier if out is not None else None, generated_tokens=generated,
                     ttft_s=None if first_at is None else first_at - stream.arrival,
                     total_s=time.monotonic() - stream.arrival)

    def _log_cut(stream, public: str, finish: str, latest: dict, first_at: float | None) -> None:
        """The log line of a request cut short; `latest`: each choice's latest output."""
        outs = list(latest.values())
        _log_end(stream, public, finish, outs[0] if outs else None, first_at, sum(len(o.token_ids) for o in outs))

    async def _complete(stream, public: str, request: Request, model: str, chat: bool):
        latest: dict = {}  # each choice's latest output (the log line of a request cut short)
        first_at = None

        async def collect():
            """The final output of each choice, in index order (n of them), once all have finished."""
            nonlocal first_at
            finals = {}
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    return item
                latest[item.index] = item
                if first_at is None and item.token_ids:
                    first_at = _first_token(stream, item)
                if item.finished:
                    finals[item.index] = item
                if item.request_finished:
                    return [finals[i] for i in sorted(finals)]

        async def client_gone():
            # a blocking receive() returns http.disconnect as soon as the socket closes
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():  # the client went away (or we were cancelled): stop and free its blocks
                work.cancel()
                engine.abort(stream.request_id)
                metrics.aborted.inc()
                _log_cut(stream, public, "abort", latest, first_at)
        if not work.done():
            return Response(status_code=499)  # nobody reads it
        outs = work.result()
        if isinstance(outs, Exception):
            _log_cut(stream, public, "error", latest, first_at)
            return error_response(api_error(outs))
        # n choices share the prompt: it counts once, their completions add up
        completion_tokens = sum(len(out.token_ids) for out in outs)
        _finish(stream, public, outs[0], first_at, completion_tokens)
        common = {"id": public, "created": int(time.time()), "model": model,
                  "usage": usage(stream.prompt_tokens, completion_tokens, outs[0].cached_tokens)}
        if chat:
            return {**common, "object": "chat.completion", "choices": [{
                "index": out.index, "message": {"role": "assistant", "content": out.text},
                "logprobs": chat_logprobs(out.logprobs) if out.logprobs is not None else None,
                "finish_reason": FINISH.get(out.finish_reason, out.finish_reason)} for out in outs]}
        return {**common, "object": "text_completion", "choices": [{
            "index": out.index, "text": out.text,
            "logprobs": completion_logprobs(out.logprobs) if out.logprobs is not None else None,
            "finish_reason": FINISH.get(out.finish_reason, out.finish_reason)} for out in outs]}

    async def _events(stream, public: str, chunk, include_usage: bool, continuous: bool):
        """SSE for one request: `chunk(index, text, logprobs, finish_reason)` shapes each event (one
        choice's, with n > 1 choices). `include_usage`: a last chunk with the usage; `continuous`:
        every chunk with its choice's usage so far too (vLLM's continuous_usage_stats)."""
        done, first_at = False, None
        seen_lp: dict[int, int] = {}  # per choice: log-probabilities sent so far
        completion_tokens: dict[int, int] = {}  # per finished choice
        latest: dict = {}  # each choice's latest output (the log line of a request cut short)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    done = True
                    _log_cut(stream, public, "error", latest, first_at)
                    yield sse(api_error(item).body())
                    break
                latest[item.index] = item
                if first_at is None and item.token_ids:
                    first_at = _first_token(stream, item)
                lp = None
                if item.logprobs is not None:
                    lp, seen_lp[item.index] = item.logprobs[seen_lp.get(item.index, 0):], len(item.logprobs)
                # A chunk for every sampled token, its text empty or not (no tokenizer, or the first
                # bytes of a character that later tokens complete), so that clients time each token
                # from its chunk. vLLM does the same: its completion stream skips an output only while
                # no token has been sampled at all (chunked prefill), and its chat stream sends
                # delta.content "" for a token without text.
                if item.new_token_ids or item.finished:
                    reason = FINISH.get(item.finish_reason, item.finish_reason) if item.finished else None
                    event = chunk(item.index, item.new_text, lp, reason)
                    if continuous:
                        event["usage"] = usage(stream.prompt_tokens, len(item.token_ids), item.cached_tokens)
                    yield sse(event)
                if item.finished:
                    completion_tokens[item.index] = len(item.token_ids)
                if item.request_finished:
                    done = True
                    total = sum(completion_tokens.values())  # the prompt counts once for all n choices
                    _finish(stream, public, item, first_at, total)
                    if include_usage:
                        yield sse({**chunk(0, "", None, None), "choices": [], "usage": usage(
                            stream.prompt_tokens, total, item.cached_tokens)})
                    break
            yield sse("[DONE]")
        finally:
            # the client went away (cancelled or closed): stop generating and free its blocks
            if not done:
                engine.abort(stream.request_id)
                metrics.aborted.inc()
                _log_cut(stream, public, "abort", latest, first_at)

    def _stream_completion(stream, public: str, model: str, include_usage: bool, continuous: bool):
        created_at = int(time.time())
        offsets: dict[int, int] = {}  # per choice: characters of token text sent so far (text_offset)

        def chunk(index, text, lp, reason):
            logprobs = None
            if lp:
                logprobs = completion_logprobs(lp, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
            return {"id": public, "object": "text_completion", "created": created_at, "model": model,
                    "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}]}

        return _events(stream, public, chunk, include_usage, continuous)

    def _stream_chat(stream, public: str, model: str, include_usage: bool, continuous: bool):
        created_at = int(time.time())
        started: set[int] = set()  # choices whose first delta (the one with the role) went out

        def chunk(index, text, lp, reason):
            delta = {"content": text}
            if index not in started:
                delta["role"] = "assistant"
                started.add(index)
            return {"id": public, "object": "chat.completion.chunk", "created": created_at,
                    "model": model, "choices": [{"index": index, "delta": delta, "finish_reason": reason,
                                                 "logprobs": chat_logprobs(lp) if lp else None}]}

        return _events(stream, public, chunk, include_usage, continuous)

    add_worker_routes(app, engine, served, tokenizing=tokenizing, accept=accept, load_format=load_format)
    if profile_dir is not None:
        add_profile_routes(app, engine, profile_dir)
    state.routes = {r.path for r in app.routes}
    state.max_request_bytes = max_request_bytes or default_max_request_bytes(max_model_len)
    app.add_middleware(BodyLimits, max_bytes=state.max_request_bytes)
    app.add_middleware(_Guard, state=state)  # runs before BodyLimits: no body is read before the key is checked
    app.add_middleware(RequestIdHeader)  # added last, runs first: every response carries X-Request-Id, refusals too
    return app
