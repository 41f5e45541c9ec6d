"""ModelRunner: launches a scheduled step as one forward pass and the sampling of its next tokens.

Inputs come from `StepInputs` (pinned buffers, numpy, no per-token Python), the model runs on
the L1 pool (decode steps as CUDA graph replays), and only the rows that finish their prompt or
decode sample (a prompt with n choices samples its last row n times). `run` returns a
`LaunchedStep` at once: the tokens come back to the host when the engine asks for them, so the
host can prepare the next step while the GPU computes this one.
Sequences larger than L1 go last in the batch and read their KV through the cache's per-layer
stream. Knows nothing of queues, scheduling or HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..cache import TieredKVCache
from ..groups import GroupedSequence, KVGroups, caches_of
from ..sequence import SequenceBlocks
from .attention import AttentionMetadata, StreamedAttention
from .config import EngineConfig
from .graphs import StepGraphs
from .inputs import BuiltStep, StepInputs
from .loader import LoadedModel
from .request import Request
from .sampler import Sampler, SamplerOutput, SamplingBatch
from .scheduler import ScheduledStep
from .step_plan import StepPlan


class LaunchedStep:
    """A step whose forward pass and sampling are queued on the GPU.

    `token_ids` [n] stays on the device (the next step reads its pending tokens there); `result`
    waits for the step and returns the sampler's output on the host.
    """

    def __init__(self, requests: list[Request], out: SamplerOutput | None, device: torch.device,
                 started: torch.cuda.Event | None = None, computed_tokens: int = 0, loaded: bool = False,
                 decode: bool = False) -> None:
        self.requests = requests  # the rows that sampled, in order
        self.decode = decode  # every request in it computed one token
        self.computed_tokens = computed_tokens  # tokens the forward ran, every request's together
        self.loaded = loaded  # some of its requests' blocks were still loading: it may have waited for them
        self._started = started  # recorded before the step's first kernel (CUDA)
        self.token_ids = out.token_ids if out is not None else None  # [n] int64, on the device
        self._host = None if out is None else SamplerOutput(*(_to_host(t) for t in (
            out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)))
        # Fires when everything queued so far ran: the step, its copies to the host, and the copies
        # of its inputs (whose pinned buffers are refilled two steps later).
        self._done = None
        self.waited_s = 0.0  # seconds `result` blocked the host for the step to end
        if device.type == "cuda":
            self._done = torch.cuda.Event(enable_timing=started is not None)
            self._done.record(torch.cuda.current_stream(device))

    def ready(self) -> bool:
        """Whether `result` would return at once (always on a CPU, where `run` computed the step)."""
        return self._done is None or self._done.query()

    def gpu_seconds(self) -> float | None:
        """Seconds the GPU spent on this step, from its first kernel to its last copy, waits for
        loads included (after `result`); None on a CPU."""
        if self._started is None or self._done is None:
            return None
        return self._started.elapsed_time(self._done) / 1e3

    def result(self) -> SamplerOutput | None:
        """The sampled tokens (and log-probabilities) on the host; blocks until the step is done."""
        if self._done is not None:
            t = time.perf_counter()
            self._done.synchronize()
            self.waited_s += time.perf_counter() - t
        return self._host


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of device tensor `t` into pinned host memory, queued on the stream (no wait)."""
    if t is None or not t.is_cuda:
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class ModelRunner:
    def __init__(self, lm: LoadedModel, cache: TieredKVCache | KVGroups, config: EngineConfig,
                 send_plan: Callable[[StepPlan], None] | None = None) -> None:
        """`config` with its device defaults resolved (`EngineConfig.for_device`). `send_plan`:
        tensor parallelism on rank 0, where each step's plan goes to the other ranks before it runs."""
        self.lm, self.cache = lm, cache
        self.send_plan = send_plan
        self.tp = lm.model.tp
        self.device = lm.device
        self.vocab_size = lm.config.vocab_size
        self.eos_token_ids = lm.tokenizer.eos_token_ids if lm.tokenizer is not None else []  # min_tokens bans them
        self.sampler = Sampler()
        # Every attention kernel variant a step may pick is compiled now: a variant first met
        # mid-run would stall that step (and every request in it) for about a second.
        lm.model.compile_kernels(cache.l1.kv[0])
        # a model whose layer groups keep their KV in caches of their own (tierkv/groups.py): each
        # layer's group, whose slots its attention reads
        self.layer_group = cache.group_of if isinstance(cache, KVGroups) else None
        # Decode steps replay CUDA graphs (never on CPU or with enforce_eager); captured now,
        # before any request runs, so no step pays for it. Not yet under tensor parallelism:
        # capturing NCCL collectives has not run on two GPUs here, so those steps stay eager.
        self.graphs = StepGraphs(
            lm.model, cache.l1.kv, block_size=cache.block_size, enabled=not config.enforce_eager and not self.tp.enabled,
            max_model_len=config.max_model_len, max_batch_size=config.max_num_seqs,
            max_step_tokens=config.max_num_batched_tokens, layer_group=self.layer_group,
        )
        self.graphs.capture()
        # a sequence's table holds one more block than max_model_len needs (its next token's)
        self.inputs = StepInputs(block_size=cache.block_size, max_tokens=config.max_num_batched_tokens,
                                 max_seqs=config.max_num_seqs, max_blocks=cache.blocks_needed(config.max_model_len + 1),
                                 device=self.device, layer_group=self.layer_group)
        # and the kernels a step runs outside the model: its inputs' upload, the sampler's filters
        self.inputs.compile()
        Sampler.compile(self.vocab_size, self.device)

    def prepare(self, step: ScheduledStep, previous: LaunchedStep | None = None) -> BuiltStep:
        """The step's device inputs; pending tokens are read from `previous`'s sampled tokens."""
        # Streamed sequences (larger than L1) go last: attention takes the batch's head from the
        # L1 pool and its tail from the staging buffer their layers stream into.
        if any(r.seq.offloaded for r in step.requests):
            order = sorted(range(len(step)), key=lambda i: step.requests[i].seq.offloaded > 0)
            step = ScheduledStep([step.requests[i] for i in order], [step.num_new[i] for i in order])
        if self.layer_group is None:
            tables = [[r.seq.slots for r in step.requests]]
        else:  # each group's own slots
            tables = [[r.seq.parts[g].slots for r in step.requests] for g in range(len(self.cache.caches))]
        built = self.inputs.build(step.requests, step.num_new, tables,
                                  None if previous is None or previous.token_ids is None
                                  else (previous.requests, previous.token_ids))
        first = next((b for b, r in enumerate(step.requests) if r.seq.offloaded), None)
        if first is not None:
            built.meta.streamed = self._streamed(built, first, [r.seq for r in step.requests[first:]])
        return built

    def _streamed(self, built: BuiltStep, first: int, seqs: list[SequenceBlocks]) -> StreamedAttention:
        """Split the step at sequence `first`, where the streamed sequences `seqs` begin, and
        start their stream."""
        meta, cu, seq_lens = built.meta, built.cu, built.host["seq_lens"]

        def part(lo: int, hi: int) -> AttentionMetadata:  # the sequences [lo, hi) of the batch
            return AttentionMetadata(
                slot_mapping=meta.slot_mapping[cu[lo] : cu[hi]],
                block_tables=meta.block_tables[lo:hi],
                seq_lens=meta.seq_lens[lo:hi],
                cu_seqlens_q=meta.cu_seqlens_q[lo : hi + 1] - cu[lo],
                logits_indices=meta.logits_indices[:0],
                is_decode=all(cu[b + 1] - cu[b] == 1 for b in range(lo, hi)),
                # tokens computed before this step: its length less its new tokens
                context=int(seq_lens[lo]) - (cu[lo + 1] - cu[lo]) if hi - lo == 1 else None,
            )

        stream = self.cache.stream(seqs)
        tail = part(first, len(cu) - 1)
        tail.block_tables = stream.plan.block_tables  # [B_streamed, width]: rows of the staging buffer
        # with layer groups only the first streams, and its stream numbers that group's layers
        layer_of = None if self.layer_group is None else self.cache.local
        return StreamedAttention(cu[first], part(0, first) if first else None, tail, stream, layer_of)

    @torch.inference_mode()
    def run(self, step: ScheduledStep, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Launch one forward pass and the sampling of its next tokens, without waiting for them.

        `previous`: the step launched before this one, whose sampled tokens may not have reached
        the host yet (this step's pending tokens are read from them on the device).
        """
        # Every step is timed on the GPU: the engine counts its busy time, and one that waits for no
        # load gives the cost of recomputing a token, whatever else shares the GPU
        # (engine._measure_recompute).
        started = None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record(torch.cuda.current_stream(self.device))
        built = self.prepare(step, previous)
        if self.send_plan is not None:  # tensor parallel: the other ranks repeat this step
            self.send_plan(self._plan(built, step))
            self.tp.broadcast(built.input_ids)  # the token ids, pending ones included, from the device
        loading = []  # sequences whose loads are still in flight
        for seq in (r.seq for r in step.requests if r.seq.pending):
            if seq.loaded():
                seq.wait()  # all landed: this only drops them, and the step may be a graph's
            else:
                loading.append(seq)
        loaded = bool(loading)
        if loading and (built.meta.is_decode or self.send_plan is not None):
            for seq in loading:  # a CUDA-graph step, or one all ranks repeat: all loaded first
                seq.wait()
            loading = []
        elif loading:  # layer i's attention waits for layer i's loads alone: the first layers
            # compute while the later ones are still on their way (the cache's per-layer hook)
            built.meta.wait_layer = lambda layer: self.cache.wait_for_layer(layer, loading)
        sampling = built.sampling
        logits = self._forward(built)  # [len(sampling), vocab]
        for seq in loading:  # waited for layer by layer: this only drops the loads that landed
            seq.wait()
        out = None
        if any(r.forks for r in sampling):
            # A prompt of n choices is computed once: the choices waiting for it sample their
            # first tokens from its logits row, each with its own generator (a rare step: n > 1
            # prefills only).
            rows = [i for i, r in enumerate(sampling) for _ in range(1 + len(r.forks))]
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            sampling = [c for r in sampling for c in (r, *r.forks)]
        if sampling:
            batch = SamplingBatch.build(
                [r.params for r in sampling], self.vocab_size, self.device,
                generators=[r.generator for r in sampling],
                prompt_ids=[r.prompt_ids for r in sampling], output_ids=[r.output_ids for r in sampling],
                num_output=[len(r.output_ids) + r.pending for r in sampling], eos_token_ids=self.eos_token_ids,
            )
            out = self.sampler(logits, batch)
        return LaunchedStep(sampling, out, self.device, started, sum(step.num_new), loaded, step.is_decode)

    def _forward(self, built: BuiltStep) -> torch.Tensor:
        logits = self.graphs.run(built.input_ids, built.positions, self.cache.l1.kv, built.meta)  # None: not a graph step
        if logits is None:
            logits = self.lm.model(built.input_ids, built.positions, self.cache.l1.kv, built.meta)
        return logits

    # ------------------------------------------------------------------ tensor parallelism

    def _plan(self, built: BuiltStep, step: ScheduledStep) -> StepPlan:
        """What the other ranks need of this step: the moves made since the last one, its inputs,
        and the blocks of its streamed sequences (the batch's last, in `prepare`'s order)."""
        moves = []
        for cache in caches_of(self.cache):  # each cache's own, in group order
            moves.append(cache.tiers.moves)
            cache.tiers.moves = []
        # only the first group's cache streams: its blocks are the ones to stream
        seqs = [r.seq if self.layer_group is None else r.seq.parts[0] for r in step.requests if r.seq.offloaded]
        return StepPlan(moves=moves, arrays=built.host, width=built.width, is_decode=built.meta.is_decode,
                        context=built.meta.context, streamed_from=len(step) - len(seqs) if seqs else None,
                        streamed=[(list(s.slots), list(s.l2_slots)) for s in seqs])

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> None:
        """Another rank's step, once it repeated the plan's moves (workers.py): the same forward
        pass over the same batch (its collectives meet rank 0's). Nothing is sampled here."""
        built = self.inputs.load(plan.arrays, plan.width, plan.is_decode, plan.context)
        self.tp.broadcast(built.input_ids)
        if plan.streamed_from is not None:
            # rank 0's streamed sequences, as this rank's cache holds them (same slots, its own heads)
            streams = caches_of(self.cache)[0]  # the first group's cache, the one that streams
            seqs = [SequenceBlocks(ns=b"", priority=0, slots=slots, entries=[None] * len(slots), hashes=[],
                                   committed=0, num_tokens=0, num_cached_tokens=0, pending=[], l2_slots=l2,
                                   owner=streams)
                    for slots, l2 in plan.streamed]
            if self.layer_group is not None:
                seqs = [GroupedSequence([s]) for s in seqs]  # KVGroups.stream reads their first part
            built.meta.streamed = self._streamed(built, plan.streamed_from, seqs)
        self._forward(built)
