"""Engine: the step loop that ties the cache, scheduler, runner and sampler together.

`add_request` validates and queues; `step` schedules, runs one forward pass, applies the
sampled tokens (detokenizing, checking stops) and reports what changed. Used by `LLM` (which
loops until done) and by the server (which steps on a background thread). Synchronous and
single-threaded; nothing here knows about HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from ..cache import TieredKVCache
from ..config import CacheConfig, redact_url
from ..errors import ConfigError
from .loader import LoadedModel, load_model
from .request import Request, RequestOutput
from .runner import ModelRunner
from .sampler import MAX_LOGPROBS, SamplingParams, find_stop_string, make_generator, stop_reason
from .scheduler import Scheduler
from .tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

CPU_L1_BYTES = 2**30  # default L1 on CPU
GPU_L1_FRACTION = 0.8  # of the GPU memory free after loading the weights
ACTIVATION_RESERVE = 4 * 2**30  # left free on a GPU for activations and the allocator
# Load-or-recompute needs the cost of recomputing a token before the first prefill measures it:
# on a GPU, 2 FLOPs per weight at a dense bf16 rate a real prefill reaches (H100/H200 class).
GPU_PREFILL_FLOPS = 4e14
PREFILL_SAMPLE_TOKENS = 256  # prompts computing at least this many tokens measure the prefill cost


class Engine:
    def __init__(
        self,
        model: str | None = None,
        *,
        l1: int | str | None = None,
        l2: int | str | None = None,
        l3: list[str] | tuple[str, ...] = (),
        eviction: str = "lru",
        write_policy: str = "write_through",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        cache_dir: str | None = None,
        loaded: LoadedModel | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self.lm = loaded if loaded is not None else load_model(model, device=device, dtype=dtype, cache_dir=cache_dir)
        self.tokenizer = self.lm.tokenizer
        dev = self.lm.device
        if l1 is None:
            l1 = CPU_L1_BYTES
            if dev.type == "cuda":
                free, _ = torch.cuda.mem_get_info(dev)
                l1 = max(int((free - ACTIVATION_RESERVE) * GPU_L1_FRACTION), 0)
        config = CacheConfig(l1=l1, l2=l2 or 0, l3=list(l3), eviction=eviction, write_policy=write_policy)
        layout = self.lm.kv_layout(block_size)
        self.cache = TieredKVCache(layout, config, device=dev, model=self.lm.fingerprint)
        self.max_model_len = max_model_len or self.lm.config.max_position_embeddings
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 8192 if dev.type == "cuda" else 1024
        self.scheduler = Scheduler(
            self.cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
        )
        if dev.type == "cuda":
            params = sum(p.numel() for p in self.lm.model.parameters())
            self.scheduler.recompute_seconds_per_token = 2 * params / GPU_PREFILL_FLOPS
        # enforce_eager: no CUDA graphs for decode steps (debugging, or to save their capture time)
        self.runner = ModelRunner(self.lm, self.cache, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                  enforce_eager=enforce_eager)
        self.requests: dict[str, Request] = {}
        log.info("engine: %s; L1 %d blocks, L2 %d blocks, L3 %s", self.lm.model_dir.name, self.cache.l1.num_blocks,
                 self.cache.l2.num_blocks if self.cache.l2 else 0, [redact_url(u) for u in l3] or "none")

    # ------------------------------------------------------------------ requests

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams | None = None, *,
        cache_salt: str | None = None, priority: int = 0, request_id: str | None = None,
    ) -> Request:
        """Validate and queue a request; raises ConfigError (saying what to change) before any work."""
        params = params if params is not None else SamplingParams()
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ConfigError("the prompt is empty: give at least one token")
        vocab = self.lm.config.vocab_size
        # one vectorised check (a 100K-token prompt costs ~1 ms, not ~10 ms of Python)
        try:
            ids = np.asarray(prompt_ids)
        except (ValueError, TypeError):  # nested or ragged lists
            ids = np.asarray([])
        if ids.dtype.kind not in "iu" or ids.ndim != 1 or ids.min() < 0 or ids.max() >= vocab:
            raise ConfigError(f"prompt token ids must be ints in [0, {vocab})")
        prompt_ids = ids.tolist()  # plain ints (numpy integers are not JSON-serialisable)
        if len(prompt_ids) >= self.max_model_len:
            raise ConfigError(
                f"the prompt has {len(prompt_ids)} tokens; this model takes at most {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len}, one position is left for the output): shorten the prompt"
            )
        room = self.max_model_len - len(prompt_ids)
        if params.max_tokens is None or params.max_tokens > room:
            if params.max_tokens is not None and params.max_tokens > room and params.max_tokens > 0:
                log.debug("max_tokens %d capped at %d by max_model_len", params.max_tokens, room)
            params = dataclasses.replace(params, max_tokens=room)  # validated again on construction
        needed = self.cache.blocks_needed(len(prompt_ids) + 1)
        if needed * self.cache.block_size > self.cache.max_tokens():
            l1_blocks, l2_blocks = self.cache.l1.num_blocks, self.cache.l2.num_blocks if self.cache.l2 else 0
            raise ConfigError(
                f"the prompt needs {needed} KV blocks but L1 holds {l1_blocks} and L2 {l2_blocks}: "
                "raise l1 or l2 (sequences larger than L1 stream their older blocks from L2), or shorten the prompt"
            )
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be at most {MAX_LOGPROBS}")
        req = Request(prompt_ids, params, salt=cache_salt, priority=priority)
        if request_id is not None:
            req.request_id = request_id
        if req.request_id in self.requests:
            raise ConfigError(f"request id {req.request_id!r} is already in use")
        req.generator = make_generator(params, self.lm.device)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request and give back everything it holds (unknown or finished ids are ignored)."""
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that got a token or finished."""
        step = self.scheduler.schedule()
        outputs = [self._ended(req) for req in self.scheduler.given_up]
        self.scheduler.given_up.clear()
        if not len(step):
            if self.scheduler.waiting and not self.scheduler.running:
                time.sleep(0.001)  # waiting only for L3 prefetches to land
            return outputs
        sampled, out = self.runner.run(step)
        for req, n in zip(step.requests, step.num_new):
            self.scheduler.computed(req, n)
        if out is None:
            return outputs
        token_ids = out.token_ids.tolist()  # the one host sync of the step
        now = time.monotonic()
        for i, (req, tok) in enumerate(zip(sampled, token_ids)):
            if req.first_token_time is None:
                req.first_token_time = now
                self._measure_prefill(req)
            req.output_ids.append(tok)
            if out.logprobs is not None and req.params.logprobs is not None:
                k = req.params.logprobs
                req.logprobs.append({
                    "token_id": tok, "logprob": float(out.logprobs[i]),
                    "top": list(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist())) if k else [],
                })
            new_text = req.detokenizer.add(tok) if req.detokenizer is not None else ""
            reason = stop_reason(req.params, tok, len(req.output_ids), self._eos())
            if req.params.stop and req.detokenizer is not None and new_text:
                cut = find_stop_string(req.text + new_text, len(new_text), req.params)
                if cut is not None:
                    new_text = (req.text + new_text)[len(req.text) : cut] if cut > len(req.text) else ""
                    reason = "stop"
            req.text += new_text
            if reason is not None:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
            outputs.append(self.output(req, [tok], new_text))
        return outputs

    def _measure_prefill(self, req: Request) -> None:
        """Fold a finished prefill (admission to first token) into the recompute cost per token
        that load-or-recompute weighs; long prompts only, where that cost is what it decides on."""
        tokens = len(req.prompt_ids) - (req.cached_tokens or 0)
        if tokens < PREFILL_SAMPLE_TOKENS or req.admitted is None or self.lm.device.type != "cuda":
            return  # CPU runs (tests, tiny models) always load what the cache holds
        per_token = (req.first_token_time - req.admitted) / tokens
        old = self.scheduler.recompute_seconds_per_token
        self.scheduler.recompute_seconds_per_token = per_token if old is None else old + 0.2 * (per_token - old)

    def _ended(self, req: Request) -> RequestOutput:
        log.warning("request %s stopped at %d tokens: L1 cannot hold more of it", req.request_id, req.num_tokens)
        self.requests.pop(req.request_id, None)
        return self.output(req)

    def _eos(self) -> list[int]:
        return self.tokenizer.eos_token_ids if self.tokenizer is not None else []

    @staticmethod
    def output(req: Request, new_ids: list[int] | None = None, new_text: str = "") -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_ids, token_ids=list(req.output_ids),
            text=req.text, cached_tokens=req.cached_tokens or 0, finish_reason=req.finish_reason,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            new_token_ids=new_ids or [], new_text=new_text,
        )

    def close(self) -> None:
        self.cache.close()


