"""The routes routers, autoscalers and benchmark clients call besides OpenAI's, in vLLM's and SGLang's shapes.

Tokenizing and rendering prompts (vllm-router's cache_aware and kv_aware call /render, or
/tokenize, before every request), what this server serves (/v1/models, /get_server_info,
/get_model_info: the routers' discovery), its load (power_of_two), emptying its cache
(/flush_cache, /reset_prefix_cache) and a health check that generates a token. As in vLLM, the
API key guards the /v1 routes only (render, /v1/models); the others stay open like /health,
because routers call them without one. Prompts are tokenized with a copy of the model's tokenizer
on a thread of its own (tokenizing.py), so that a router's call never waits for an engine step.
Nothing here touches the Engine but through AsyncEngine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import __version__
from ..engine.sampler import SamplingParams
from .api_errors import answer, error_response
from .async_engine import AsyncEngine
from .protocol import (
    ERRORS,
    LOAD_FORMATS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from .serving import (
    apply_chat_template,
    chat_messages,
    check_model,
    prepare_chat,
    prepare_completion,
    text_tokens,
)
from .tokenizing import Tokenizing

HEALTH_GENERATE_TIMEOUT_S = 30.0
HEALTH_PROMPT = [0]  # one token id every vocabulary has: no full block, so nothing is cached or published


@dataclass(frozen=True)
class Served:
    """What this server serves, as /v1/models and the routers' discovery routes describe it."""

    name: str  # what clients put in "model"
    max_model_len: int
    model_path: str  # the hub id or directory it was loaded from
    root: str | None  # the directory holding its tokenizer files (vLLM's `root`); None: it has none
    max_num_seqs: int
    # vLLM's CacheConfig as vllm:cache_config_info labels it: block_size, num_gpu_blocks (L1),
    # num_cpu_blocks (L2), enable_prefix_caching, cache_dtype
    cache_config: dict
    tensor_parallel_size: int = 1
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # new at every start: a router that sees it change knows the cache behind it started empty
    instance_id: str = dataclasses.field(default_factory=lambda: f"tierkv-{uuid.uuid4().hex[:12]}")

    @property
    def block_size(self) -> int:
        return self.cache_config["block_size"]

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "tierkv",
                "root": self.root, "parent": None, "max_model_len": self.max_model_len}

    def model_info(self) -> dict:
        """SGLang's /get_model_info, with vllm-router's model_id."""
        return {"model_id": self.name, "model_path": self.model_path, "tokenizer_path": self.root,
                "served_model_name": self.name, "is_generation": True, "model_type": None, "architectures": None,
                "preferred_sampling_params": None, "weight_version": None,
                "has_image_understanding": False, "has_audio_understanding": False}

    def server_info(self) -> dict:
        """SGLang's /get_server_info fields that its router reads, and vllm-router's (model_id,
        instance_id, kv_block_size: the block size its kv_aware policy hashes prompts by)."""
        return {**self.model_info(), "instance_id": self.instance_id, "kv_block_size": self.block_size,
                "effective_attention_block_size": self.block_size, "page_size": self.block_size,
                "max_model_len": self.max_model_len, "context_length": self.max_model_len,
                "max_running_requests": self.max_num_seqs, "tp_size": self.tensor_parallel_size, "dp_size": 1,
                "disaggregation_mode": "null", "version": f"tierkv-{__version__}"}


def _sampling_params(params: SamplingParams) -> dict:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def add_worker_routes(app: FastAPI, engine: AsyncEngine, served: Served, *, tokenizing: Tokenizing,
                      accept: Callable, load_format: str = "vllm") -> None:
    """`tokenizing`: the server's tokenizer thread, the generation routes' too. `accept(body)`: what
    the generation routes do with a request's unknown fields (count them, refuse the ones that
    change results): render and /tokenize do the same. `load_format`: the shape /get_load answers
    in when the caller names none (`?format=`)."""
    names = [served.name]

    # -------------------------------------------------------------- what is served

    @app.api_route("/v1/models", methods=["GET", "HEAD"], response_model=ModelList, responses=ERRORS)
    async def models():
        return {"object": "list", "data": [served.card()]}

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"], response_model=ModelCard, responses=ERRORS)
    async def model_card(model: str):
        try:
            check_model(model, names)
        except APIError as err:
            return error_response(err)
        return served.card()

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return served.model_info()

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        return served.server_info()

    # -------------------------------------------------------------- tokens

    async def _tokenize(body: TokenizeRequest) -> Response:
        accept(body)
        check_model(body.model, names)
        if body.messages is not None:  # or else a prompt (TokenizeRequest checked that)
            messages, generation = chat_messages(body.messages), body.add_generation_prompt

            def encode(tok):
                return apply_chat_template(tok, messages, served.max_model_len, generation)
        else:
            prompt, special = body.prompt, body.add_special_tokens is not False

            def encode(tok):
                if tok is None:
                    raise APIError(400, "this model has no tokenizer", param="prompt")
                return text_tokens(tok, prompt, served.max_model_len, add_special_tokens=special)

        def run(tok) -> bytes:
            ids = encode(tok)
            strs = tok.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
            # The body is written here too, off the event loop, and with json rather than FastAPI's
            # encoder: ~0.02 s for 300K ids, where the encoder takes ~2 us an id on the event loop.
            return json.dumps({"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids,
                               "token_strs": strs}, ensure_ascii=False, separators=(",", ":")).encode()

        return Response(await tokenizing.run(run), media_type="application/json")

    @app.post("/tokenize", responses=ERRORS)
    async def tokenize(body: TokenizeRequest):
        """vLLM's shape: {count, max_model_len, tokens, token_strs}, for a prompt or chat messages."""
        return await answer(_tokenize(body))

    async def _detokenize(body: DetokenizeRequest) -> dict:
        accept(body)
        check_model(body.model, names)

        def run(tok):
            if tok is None:
                raise APIError(400, "this model has no tokenizer", param="tokens")
            if any(t >= tok.vocab_size for t in body.tokens):
                raise APIError(400, f"token ids must be below the vocabulary size, {tok.vocab_size}", param="tokens")
            return tok.decode(body.tokens, skip_special_tokens=False)

        return {"prompt": await tokenizing.run(run)}

    @app.post("/detokenize", responses=ERRORS)
    async def detokenize(body: DetokenizeRequest):
        return await answer(_detokenize(body))

    async def _render(body, prepare, chat: bool) -> dict:
        accept(body)
        encode = prepare(body, names, served.max_model_len)
        ids, params = await tokenizing.run(encode, tokenizes=encode.tokenizes)
        if params.max_tokens is None:  # what the engine grants: the rest of the context
            params = dataclasses.replace(params, max_tokens=served.max_model_len - len(ids))
        stream_options = body.stream_options.model_dump() if body.stream and body.stream_options else None
        return {"request_id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "token_ids": ids,
                "features": None, "sampling_params": _sampling_params(params), "model": body.model,
                "stream": body.stream, "stream_options": stream_options, "cache_salt": body.cache_salt,
                "priority": body.priority, "kv_transfer_params": None}

    @app.post("/v1/completions/render", responses=ERRORS)
    async def render_completion(body: CompletionRequest):
        """vLLM's render: the request as the engine would take it, [{token_ids, sampling_params,
        ...}], checked as /v1/completions checks it, without generating."""
        out = await answer(_render(body, prepare_completion, chat=False))
        return [out] if isinstance(out, dict) else out

    @app.post("/v1/chat/completions/render", responses=ERRORS)
    async def render_chat(body: ChatCompletionRequest):
        """vLLM's render of a chat request: {token_ids, sampling_params, ...}, the chat template applied."""
        return await answer(_render(body, prepare_chat, chat=True))

    # -------------------------------------------------------------- load, cache, health

    @app.get("/get_load")
    async def get_load(request: Request):
        """vllm-router's power_of_two reads {"load": requests in the engine}; sglang-router's reads
        [{dp_rank, num_reqs, num_waiting_reqs, num_tokens}] and weighs num_tokens. Neither says
        which it wants, so --load-format picks (vllm by default) and `?format=` overrides it."""
        fmt = request.query_params.get("format", load_format)
        if fmt not in LOAD_FORMATS:
            return error_response(APIError(400, f"format must be one of {', '.join(LOAD_FORMATS)}", param="format"))
        if fmt == "vllm":
            return {"load": engine.num_running + engine.num_waiting}

        async def sglang():
            load = await engine.load()
            return [{"dp_rank": 0, "num_reqs": load["running"] + load["waiting"], "num_waiting_reqs": load["waiting"],
                     "num_tokens": load["tokens"]}]

        return await answer(sglang())

    async def _flush() -> dict:
        if not await engine.clear_cache():
            raise APIError(409, "the cache was not emptied: running requests hold cached blocks; retry once they "
                           "have finished", type="invalid_request_error", code="cache_in_use")
        return {"flushed": True}

    @app.post("/flush_cache", responses=ERRORS)
    async def flush_cache():
        """SGLang's name (both routers send it to every worker): empties L1 and L2, and publishes
        AllBlocksCleared; the L3 store, shared with other replicas, keeps its blocks."""
        return await answer(_flush())

    @app.post("/reset_prefix_cache", responses=ERRORS)
    async def reset_prefix_cache():
        """vLLM's name for /flush_cache (`aiperf --reset-kv-cache` calls it)."""
        return await answer(_flush())

    async def _health_generate() -> dict:
        rid = f"health-{uuid.uuid4().hex}"
        stream = await engine.submit(HEALTH_PROMPT, SamplingParams(max_tokens=1, temperature=0), request_id=rid)

        async def finished():
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.request_finished:
                    return

        try:
            await asyncio.wait_for(finished(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            engine.abort(rid)
            raise APIError(503, f"the engine generated no token within {HEALTH_GENERATE_TIMEOUT_S:g} s",
                           type="server_error", code="engine_stalled") from None
        return {}

    @app.get("/health_generate", responses=ERRORS)
    async def health_generate():
        """SGLang's deep health check: 200 once one token went through the engine, else 503."""
        return await answer(_health_generate())
