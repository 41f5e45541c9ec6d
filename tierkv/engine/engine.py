"""Engine: the step loop that ties the cache, scheduler, runner and sampler together.

`add_request` validates and queues; `step` reads schedule -> run -> postprocess. Schedule picks
the work, run launches it on the device, postprocess takes sampled tokens back (detokenizing,
logprobs, stop checks). With async scheduling (the default) postprocess handles the previous
step, after this one is launched: the host schedules and prepares step N+1 while the GPU runs
step N, and tokens return without a sync on the hot path; for a streaming caller, a step the
device has finished already (on a CPU: every step) is taken back at once, so that each token
leaves in the step that sampled it. Used by `LLM` (which loops until done) and by the server (which steps on a
background thread). Single-threaded; nothing here knows about HTTP.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from ..config import redact_url
from ..errors import ConfigError
from ..groups import caches_of, l1_split, make_cache
from ..kernels.compile_watch import CompileWatch
from ..layout import stored_layout
from .config import L2_DEFAULT_RULE, EngineConfig
from .loader import LoadedModel, check_parallel_model, load_model, resolve_device_dtype
from .request import Request, RequestOutput
from .runner import LaunchedStep, ModelRunner
from .sampler import (
    MAX_LOGPROBS,
    SamplingParams,
    choice_seed,
    find_stop_string,
    make_generator,
    stop_reason,
)
from .scheduler import Scheduler
from .stats import EngineStats
from .step_log import StepLog
from .tokenizer import IncrementalDetokenizer
from .workers import Workers, own_l1_blocks

log = logging.getLogger(__name__)

# Load-or-recompute needs the cost of recomputing a token before the first prefill step measures it:
# on a GPU, 2 FLOPs per weight at a dense bf16 rate a real prefill reaches (H100/H200 class).
GPU_PREFILL_FLOPS = 4e14
# Steps computing at least this many tokens (or a whole step budget, if smaller) measure the
# recompute cost: a step this large reads the weights once for thousands of tokens, so its time per
# token is what recomputing a long run costs. Smaller steps (a hit's question beside decodes)
# charge each token a share of the weights: sampling from 256 tokens up, long_doc at 8K measured
# 67-81 us a token under load against 31 us unloaded (c3163bc), and read L3 runs worth recomputing.
PREFILL_SAMPLE_TOKENS = 2048


class Engine:
    def __init__(
        self, model: str | None = None, *, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
        **options,
    ) -> None:
        """`Engine(model, **options)` or `Engine(config=EngineConfig(...))`; the options are
        EngineConfig's. `loaded`: a model already loaded (tests), used instead of `model`."""
        if config is None:
            config = EngineConfig.from_options(model, **options)
        elif model is not None or options:
            raise ConfigError("give either config= or a model and options, not both")
        # the device is known now (torch finds the GPU when none is named): the checks whose answer
        # depends on it fail here, in a second, rather than after the weights have loaded
        device = loaded.device if loaded is not None else resolve_device_dtype(config.device, None)[0]
        config.check_tiers(device.type)
        size = config.tensor_parallel_size
        if size > 1 and loaded is not None:
            raise ConfigError("loaded= takes a whole model: use it with tensor_parallel_size=1")
        # Tensor parallel: this process is rank 0; the others start now and build their part
        # while this one builds its own (workers.py).
        self.workers: Workers | None = None
        if size > 1:
            check_parallel_model(config.model, config.cache_dir, size)
            self.workers = Workers(config, size)
        try:
            self._build(config, loaded)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        tp = self.workers.tp if self.workers is not None else None
        self.lm = loaded if loaded is not None else load_model(config.model, device=config.device, dtype=config.dtype,
                                                               cache_dir=config.cache_dir, tp=tp)
        self.tokenizer = self.lm.tokenizer
        dev = self.lm.device
        explicit_len = config.max_model_len is not None
        l2_default = config.l2 is None
        layout = self.lm.kv_layout(config.block_size)
        # the default L2 is sized in blocks of the format L2 holds (fp8 blocks are about half as big)
        l2_block = stored_layout(layout, config.kv_offload_dtype).bytes_per_block
        self.config = config = config.for_device(dev, self.lm.config.max_position_embeddings, l2_block)
        if self.workers is not None:
            config = self._agree_sizes(config, layout, l2_default)
        # made after the weights: with l1 None the cache sizes L1 from the memory they left. A model
        # of full-attention and sliding-window layers gets a cache per group of layers (groups.py),
        # split as rank 0 decides under tensor parallelism
        blocks = l1_split(layout, config.cache_config(), device=dev, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=config.max_num_batched_tokens)
        exchanges = None
        if self.workers is not None:
            self.workers.share_l1_split(blocks)
            if config.l3:  # rank 0 stores whole-model blocks of each cache, the ranks lend their heads
                whole = self.lm.kv_layout(config.block_size, all_heads=True)
                wholes = [whole] if blocks is None else [whole.of_group(g) for g in whole.groups]
                exchanges = [self.workers.l3_exchange(stored_layout(w, config.kv_offload_dtype), i)
                             for i, w in enumerate(wholes)]
        self.cache = make_cache(layout, config.cache_config(), device=dev, model=self.lm.fingerprint, blocks=blocks,
                                exchanges=exchanges)
        if self.workers is not None:
            self.workers.agree_l2_blocks(self.cache)
        self.config = config = self._fit_context(config, explicit=explicit_len)
        self.max_model_len = config.max_model_len
        self.scheduler = Scheduler(
            self.cache, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.stats = EngineStats(self.max_model_len)  # per step and per request, for /metrics
        self.step_log = StepLog.from_env()  # a line per step and request, where TIERKV_STEP_LOG asks
        if dev.type == "cuda":
            params = sum(p.numel() for p in self.lm.model.parameters())
            self.scheduler.recompute_seconds_per_token = 2 * params / GPU_PREFILL_FLOPS
        self.runner = ModelRunner(self.lm, self.cache, config,
                                  send_plan=self.workers.send if self.workers is not None else None)
        if self.workers is not None:
            self.workers.ready()
            for cache in caches_of(self.cache):  # from now on every L1/L2 move is repeated by the other ranks
                cache.tiers.moves = []
        # every kernel variant a step may pick is compiled by now (the runner's and the tiers'
        # warm-ups): a later compile stalls steps, so it is logged and counted
        self.compiles = CompileWatch()
        if dev.type == "cuda":
            self.compiles.arm()
        self.requests: dict[str, Request] = {}
        self.in_flight: LaunchedStep | None = None  # launched, its tokens not yet taken back
        self.num_computed_tokens = 0  # tokens the model has run, prompts and decodes together
        self.l2_note = ""  # what the startup lines say of an L2 the user did not size
        # set while a profiler records (server/profiling.py): each launch is then a named range in
        # the trace, saying which requests ran and which waited for their loads
        self.label_steps = False
        if l2_default:
            self.l2_note = (f" (the default share: {L2_DEFAULT_RULE})" if self.cache.l2
                            else " (off: the default on CPU)" if dev.type != "cuda" else " (off: host memory unknown)")
        log.info("engine: %s; L1 %d blocks, L2 %d blocks%s, L3 %s", self.lm.model_dir.name, self.cache.l1.num_blocks,
                 self.cache.l2.num_blocks if self.cache.l2 else 0, self.l2_note,
                 [redact_url(u) for u in config.l3] or "none")

    def _agree_sizes(self, config: EngineConfig, layout, l2_default: bool) -> EngineConfig:
        """Tensor parallel: L1 and L2 sizes that every rank uses. Ranks hold the same slots, so L1
        takes the block count the fullest GPU allows; the default L2 share of host memory is
        divided among the ranks (each pins its own L2)."""
        l2 = config.cache_config().l2
        l1_blocks, l2, _, _ = self.workers.agree_sizes(
            own_l1_blocks(config, layout, self.lm.device), l2 // self.workers.size if l2_default else l2,
            config.max_model_len, config.max_num_batched_tokens)
        return dataclasses.replace(config, l1=l1_blocks * layout.bytes_per_block, l2=l2)

    def _fit_context(self, config: EngineConfig, explicit: bool) -> EngineConfig:
        """`config` with a max_model_len that the tiers can always hold: one sequence of that many
        tokens must fit in L1, or streamed in half of L1 plus L2. A default that does not fit is
        lowered, with a warning naming both sizes; one the user asked for is refused."""
        holds = self.cache.max_tokens()  # tokens: whole blocks
        if config.max_model_len <= holds:
            return config
        l1, l2 = self.cache.l1.num_blocks, self.cache.l2.num_blocks if self.cache.l2 else 0
        if explicit:
            self.cache.close()
            raise ConfigError(
                f"max_model_len {config.max_model_len} needs {self.cache.blocks_needed(config.max_model_len)} KV "
                f"blocks per sequence, but L1 holds {l1} and L2 {l2} ({holds} tokens in all): lower max_model_len "
                f"to {holds} or less, or raise l1 or l2"
            )
        log.warning("max_model_len lowered from the model's %d to %d tokens: that is what L1 (%d blocks) and "
                    "L2 (%d blocks) can hold for one sequence; raise l1 or l2 for more",
                    config.max_model_len, holds, l1, l2)
        return dataclasses.replace(config, max_model_len=holds)

    # ------------------------------------------------------------------ requests

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams | None = None, *,
        cache_salt: str | None = None, priority: int = 0, request_id: str | None = None,
    ) -> Request:
        """Validate and queue a request; raises ConfigError (saying what to change) before any work.

        With params.n > 1 the request is n choices under one request id (see request.py); the
        returned Request is choice 0, and `choices` lists them all."""
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
            # max_model_len never exceeds what the tiers hold for one sequence (see _fit_context)
            by_tiers = self.max_model_len >= self.cache.max_tokens()
            tiers = " or raise l1 or l2 (it is what they hold for one sequence)" if by_tiers else ""
            raise ConfigError(
                f"the prompt has {len(prompt_ids)} tokens; this model takes at most {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len}, one position is left for the output): shorten the prompt{tiers}"
            )
        room = self.max_model_len - len(prompt_ids)
        if params.max_tokens is None or params.max_tokens > room:
            if params.max_tokens is not None and params.max_tokens > room and params.max_tokens > 0:
                log.debug("max_tokens %d capped at %d by max_model_len", params.max_tokens, room)
            params = dataclasses.replace(params, max_tokens=room)  # validated again on construction
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be at most {MAX_LOGPROBS}")
        req = Request(prompt_ids, params, salt=cache_salt, priority=priority)
        if request_id is not None:
            req.request_id = request_id
        if req.request_id in self.requests:
            raise ConfigError(f"request id {req.request_id!r} is already in use")
        if params.n > 1:
            req.group = [req] + [
                Request(prompt_ids, dataclasses.replace(params, seed=choice_seed(params.seed, i)), salt=cache_salt,
                        priority=priority, request_id=req.request_id, arrival=req.arrival, index=i)
                for i in range(1, params.n)
            ]
            req.forks = req.group[1:]  # they start from choice 0's prompt blocks (Scheduler._fork)
        for choice in req.choices:
            choice.group = req.group
            choice.generator = make_generator(choice.params, self.lm.device)
            if self.tokenizer is not None:
                choice.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        if self.step_log is not None:
            self.step_log.added(req)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request and give back everything it holds (unknown or finished ids are ignored)."""
        req = self.requests.pop(request_id, None)
        for choice in req.choices if req is not None else ():
            if not choice.finished:
                self.scheduler.finish(choice, "abort")

    def has_unfinished(self) -> bool:
        """Whether a request still waits, runs or has a token on its way back."""
        if self.scheduler.has_work():
            return True
        return self.in_flight is not None and not all(r.finished for r in self.in_flight.requests)

    # ------------------------------------------------------------------ the loop

    def step(self, emit: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Schedule -> run -> postprocess; returns an output for every request that got a token or
        finished. With async scheduling, the tokens returned are those of the previous step.

        `emit`: a streaming caller (the server). Each batch of outputs goes to it as soon as it
        exists, and a step whose tokens are on the host already (on a CPU, where launching
        computes: every step) is taken back before the next one is launched, so that each token
        leaves in the step that sampled it; step then returns []. Without it (LLM.generate, which
        returns outputs only at the end) the next step is always launched first, which keeps the
        overlap path (pending tokens read on the device) in use on every device."""
        outputs: list[RequestOutput] = []
        streaming = emit is not None
        emit = emit or outputs.extend
        # taken: seconds taking a launched step's tokens back; waited: of them, blocked on the GPU
        t0, taken, waited = time.perf_counter(), 0.0, 0.0
        if self.in_flight is not None and ((streaming and self.in_flight.ready()) or not self._may_overlap()):
            taken, waited = self._take_back(emit, taken, waited)
        t1 = time.perf_counter()
        before = set(map(id, self.scheduler.running)) if self.step_log is not None else None
        step = self.scheduler.schedule()
        t2 = time.perf_counter()
        if self.scheduler.given_up:
            emit([self._ended(req) for req in self.scheduler.given_up])
            self.scheduler.given_up.clear()
        launched = None
        if len(step):
            with self._labelled(step):
                launched = self.runner.run(step, self.in_flight)
            for req, n in zip(step.requests, step.num_new):
                self.scheduler.computed(req, n)
                self.num_computed_tokens += n
            for req in launched.requests:
                req.pending += 1
        t3 = time.perf_counter()
        if self.in_flight is not None:
            taken, waited = self._take_back(emit, taken, waited)  # the device runs `launched` meanwhile
        self.in_flight = launched
        if launched is not None and (not self.config.async_scheduling or (streaming and launched.ready())):
            taken, waited = self._take_back(emit, taken, waited)
        if launched is None and ((self.scheduler.waiting and not self.scheduler.running) or self.scheduler.tail_waits
                                 or self.scheduler.loading):
            time.sleep(0.001)  # waiting only for reads to land: L3 prefetches or tails, or L2 -> L1 loads
        if launched is not None or self.has_unfinished():
            self.stats.stepped(step if launched is not None else None, time.perf_counter() - t0, t2 - t1,
                               t3 - t2, taken, waited)
        if self.step_log is not None:
            admitted = [r for r in self.scheduler.running if id(r) not in before]
            if launched is not None or admitted or taken:  # not the 1 ms polls while loads land
                self.step_log.stepped((t0, t1, t2, t3), step, self.scheduler, admitted, taken, waited)
        return outputs

    def _take_back(self, emit: Callable[[list[RequestOutput]], None], taken: float,
                   waited: float) -> tuple[float, float]:
        """Hand over the outputs of the step in flight (waiting for its tokens); `taken` and
        `waited` plus the seconds it took and the seconds of them it waited for the GPU."""
        t = time.perf_counter()
        launched = self._take_in_flight()
        emit(self._postprocess(launched))
        return taken + time.perf_counter() - t, waited + launched.waited_s

    def _labelled(self, step):
        """A profiler range named after the step (only while `label_steps`): the requests it runs
        and their new tokens, the running ones still waiting for their loads, and how many wait
        for admission. Request ids are cut to their last 6 characters."""
        if not self.label_steps:
            return contextlib.nullcontext()
        import torch

        runs = " ".join(f"{r.request_id[-6:]}+{n}" for r, n in zip(step.requests, step.num_new))
        loading = " ".join(r.request_id[-6:] for r in self.scheduler.loading) or "-"
        return torch.profiler.record_function(
            f"step: run {runs}; loading {loading}; waiting {len(self.scheduler.waiting)}")

    def _take_in_flight(self) -> LaunchedStep:
        launched, self.in_flight = self.in_flight, None
        return launched

    def _may_overlap(self) -> bool:
        """Whether the next step may be launched before the in-flight one's tokens are back.

        Not when a running request's sampling reads its own output (penalties: the pending token
        must be counted), nor while any request streams from L2 (its offloads and per-layer
        stream then see only finished steps). (Without async scheduling nothing is ever in flight here.)
        """
        for req in self.scheduler.running:
            if req.params.penalizes_output or (req.seq is not None and req.seq.offloaded):
                return False
        return not any(self.cache.must_stream(req.num_tokens) for req in self.scheduler.waiting)

    def _postprocess(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Apply a launched step's sampled tokens: logprobs, detokenizing, stop checks, finishing."""
        out = launched.result()  # waits for that step only; the one launched after it keeps running
        seconds = launched.gpu_seconds()  # None on a CPU
        if seconds is not None:
            self.stats.ran(launched.decode, seconds, launched.loaded)
            self._measure_recompute(launched, seconds)
        if out is None:
            return []
        token_ids = out.token_ids.tolist()
        now = time.monotonic()
        eos = self._eos()
        outputs = []
        prompts_done = 0  # prompt tokens of the requests that get their first token now (vLLM's count)
        for i, (req, tok) in enumerate(zip(launched.requests, token_ids)):
            req.pending -= 1
            if req.finished:
                continue  # aborted, or stopped by its previous token, while this one was computed
            if req.first_token_time is None:
                req.first_token_time = now
                prompts_done += len(req.prompt_ids) if req.index == 0 else 0  # n choices share one prompt
            else:
                self.stats.inter_token.observe(now - req.last_token_time)
            req.last_token_time = now
            req.output_ids.append(tok)
            if out.logprobs is not None and req.params.logprobs is not None:
                k = req.params.logprobs
                req.logprobs.append({
                    "token_id": tok, "logprob": float(out.logprobs[i]),
                    "top": list(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist())) if k else [],
                })
            reason = stop_reason(req.params, tok, len(req.output_ids), eos)
            # the token that stopped the request (eos, a stop token id) adds no text unless asked to (vLLM)
            quiet = reason == "stop" and not req.params.include_stop_str_in_output
            new_text = req.detokenizer.add(tok) if req.detokenizer is not None and not quiet else ""
            req.text += new_text
            past_min = len(req.output_ids) > req.params.min_tokens  # stop strings count after min_tokens (vLLM)
            if req.params.stop and new_text and past_min:
                cut = find_stop_string(req.text, len(new_text), req.params)
                if cut is not None:  # the stop string may have begun tokens ago: cut all of it
                    req.text, reason = req.text[:cut], "stop"
            if reason is not None:
                self.scheduler.finish(req, reason)
                self._forget(req)
            elif req.num_known % self.cache.block_size == 0:
                self.scheduler.commit(req)  # the block its token completed can be shared now
            outputs.append(self.output(req, [tok]))
        if outputs:
            self.stats.iteration_tokens.observe(prompts_done + len(outputs))
        return outputs

    def _measure_recompute(self, launched: LaunchedStep, seconds: float) -> None:
        """Fold a prefill-sized step's GPU seconds per computed token into the recompute cost that
        load-or-recompute weighs (CUDA only: CPU runs, tests and tiny models, always load what the
        cache holds). Timed on the GPU, step by step, so that requests sharing the GPU
        do not count as compute: timing a request from admission to its first token (as this did
        before) grew with the load and made slow tiers look worth reading under it."""
        if launched.loaded:
            return  # it may have waited for loads: its time is not all compute
        if launched.computed_tokens < min(PREFILL_SAMPLE_TOKENS, self.config.max_num_batched_tokens):
            return  # small steps: their share of the weights' read is not what a long prefill's tokens cost
        per_token = seconds / launched.computed_tokens
        old = self.scheduler.recompute_seconds_per_token
        self.scheduler.recompute_seconds_per_token = per_token if old is None else old + 0.2 * (per_token - old)

    def _ended(self, req: Request) -> RequestOutput:
        log.warning("request %s stopped at %d tokens: L1 cannot hold more of it", req.request_id, req.num_tokens)
        self._forget(req)
        return self.output(req)

    def _forget(self, req: Request) -> None:
        """Drop a finished request's id once every choice of it has finished."""
        if all(c.finished for c in req.choices) and self.requests.pop(req.request_id, None) is not None:
            self.stats.finished(req.choices)

    def _eos(self) -> list[int]:
        return self.tokenizer.eos_token_ids if self.tokenizer is not None else []

    @staticmethod
    def output(req: Request, new_ids: list[int] | None = None) -> RequestOutput:
        """The request's state for its caller, with the text not handed out before (Request.take_text)."""
        new_text = req.take_text()
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_ids, token_ids=list(req.output_ids),
            text=req.text[: req.sent], cached_tokens=req.cached_tokens or 0, finish_reason=req.finish_reason,
            cached_by_tier=req.cached_by_tier,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            new_token_ids=new_ids or [], new_text=new_text, index=req.index,
            request_finished=req.finished and (req.group is None or all(c.finished for c in req.group)),
        )

    def engine_stats(self) -> dict:
        """A copy of the engine's own counters (EngineStats) with the scheduler's preemptions."""
        return {**self.stats.snapshot(self.scheduler.num_preemptions), "kernel_compiles": self.compiles.stats()}

    def cache_stats(self) -> dict:
        """The cache's stats. Under tensor parallelism these are rank 0's decisions, with each
        tier's bytes for all ranks together (rank 0's times the rank count: every rank holds and
        moves the same blocks, each of its own KV heads), and under "ranks" each rank's own
        counters: the workers count the L1/L2 moves they repeated, so a rank that fell out of step
        shows there. L3 figures are rank 0's alone: it reads and writes every rank's heads. With a
        cache per layer group, each rank's entry has its groups' counters too."""
        out = self.cache.stats()
        # what load-or-recompute weighs each L3 read's estimate against (None until measured)
        out["recompute_seconds_per_token"] = self.scheduler.recompute_seconds_per_token
        if self.workers is None:
            return out
        each = [copy.deepcopy(out)] + self.workers.stats()
        out["ranks"] = [{"rank": r, "tiers": s["tiers"],
                         **({"groups": [{"group": g["group"], "tiers": g["tiers"]} for g in s["groups"]]}
                            if "groups" in s else {})}
                        for r, s in enumerate(each)]
        for tiers in [out["tiers"], *(g["tiers"] for g in out.get("groups", []))]:
            for tier, counters in tiers.items():
                if tier == "l3":  # rank 0 alone moves L3's whole-model blocks: counted once already
                    continue
                for key in ("bytes_in", "bytes_out", "capacity_bytes", "used_bytes"):
                    if key in counters:
                        counters[key] *= len(each)
        return out

    def close(self) -> None:
        self.compiles.disarm()
        try:
            if self.in_flight is not None:
                self._postprocess(self._take_in_flight())
            self.cache.close()
            if self.step_log is not None:
                self.step_log.close()
        finally:
            if self.workers is not None:
                self.workers.close()
