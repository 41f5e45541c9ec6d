"""ModelRunner: turns a scheduled step into one forward pass and the next token of each request.

Builds the flat batch (token ids, positions, slot mapping, block tables, sequence lengths) with
tensor ops rather than per-token Python loops, runs the model on the L1 pool (decode steps as
CUDA graph replays), and samples only the rows that finished their prompt or decode. Sequences
larger than L1 go last in the batch and read their KV through the cache's per-layer stream.
Knows nothing of queues, scheduling or HTTP.
"""

from __future__ import annotations

import itertools

import torch

from tierkv import kernels

from ..cache import TieredKVCache
from .attention import AttentionMetadata, StreamedAttention
from .graphs import DecodeGraphs
from .loader import LoadedModel
from .request import Request
from .sampler import Sampler, SamplerOutput, SamplingBatch
from .scheduler import ScheduledStep


class ModelRunner:
    def __init__(
        self, lm: LoadedModel, cache: TieredKVCache, *,
        max_num_seqs: int = 256, max_model_len: int | None = None, enforce_eager: bool = False,
    ) -> None:
        self.lm, self.cache = lm, cache
        self.device = lm.device
        self.vocab_size = lm.config.vocab_size
        self.sampler = Sampler()
        # Every attention kernel variant a step may pick is compiled now: a variant first met
        # mid-run would stall that step (and every request in it) for about a second.
        cfg = lm.model.config
        windows = set(cfg.layer_windows or [None])
        kernels.compile_variants(cache.l1.kv[0], cfg.num_heads, cfg.head_dim**-0.5, windows)
        # Decode steps replay CUDA graphs (never on CPU or with enforce_eager); captured now,
        # before any request runs, so no step pays for it.
        self.graphs = DecodeGraphs(
            lm.model, cache.l1.kv, block_size=cache.block_size, enabled=not enforce_eager,
            max_model_len=max_model_len or lm.config.max_position_embeddings, max_batch_size=max_num_seqs,
        )
        self.graphs.capture()

    def prepare(self, step: ScheduledStep) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[Request]]:
        """input_ids [T], positions [T], the step's AttentionMetadata, and the requests that sample."""
        bs = self.cache.block_size
        # Streamed sequences (larger than L1) go last: attention takes the batch's head from the
        # L1 pool and its tail from the staging buffer their layers stream into.
        order = sorted(range(len(step)), key=lambda i: step.requests[i].seq.offloaded > 0)
        step = ScheduledStep([step.requests[i] for i in order], [step.num_new[i] for i in order])
        starts = [r.num_computed for r in step.requests]
        ends = [start + n for start, n in zip(starts, step.num_new)]
        cu = list(itertools.accumulate(step.num_new, initial=0))  # [B + 1]
        ids: list[int] = []
        for r, start, end in zip(step.requests, starts, ends):
            ids += r.tokens(start, end)
        # the rows that finish their prompt or decode sample a token, from their last new token
        sample_rows = [b for b, (r, end) in enumerate(zip(step.requests, ends)) if end == r.num_tokens]
        sampling = [step.requests[b] for b in sample_rows]
        last = [cu[b + 1] - 1 for b in sample_rows]
        lens = torch.tensor(step.num_new)  # [B]
        row = torch.repeat_interleave(torch.arange(len(step)), lens)  # [T]: which sequence
        positions = torch.arange(len(ids)) + torch.tensor([s - c for s, c in zip(starts, cu)])[row]  # [T]
        table = self.cache.block_table([r.seq for r in step.requests], device="cpu")  # [B, max_blocks]
        slots = table[row, positions // bs].long() * bs + positions % bs  # [T]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=table.to(dev, non_blocking=True),
            seq_lens=torch.tensor(ends, dtype=torch.int32).to(dev, non_blocking=True),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(dev, non_blocking=True),
            logits_indices=torch.tensor(last, dtype=torch.int64).to(dev, non_blocking=True),
            is_decode=step.is_decode,
        )
        first = next((b for b, r in enumerate(step.requests) if r.seq.offloaded), None)
        if first is not None:
            meta.streamed = self._streamed(meta, step, first, cu)
        return torch.tensor(ids).to(dev, non_blocking=True), positions.to(dev, non_blocking=True), meta, sampling

    def _streamed(self, meta: AttentionMetadata, step: ScheduledStep, first: int, cu: list[int]) -> StreamedAttention:
        """Split `meta` at sequence `first`, where the streamed sequences begin, and start their stream."""

        def part(lo: int, hi: int) -> AttentionMetadata:  # the sequences [lo, hi) of the batch
            return AttentionMetadata(
                slot_mapping=meta.slot_mapping[cu[lo] : cu[hi]],
                block_tables=meta.block_tables[lo:hi],
                seq_lens=meta.seq_lens[lo:hi],
                cu_seqlens_q=meta.cu_seqlens_q[lo : hi + 1] - cu[lo],
                logits_indices=meta.logits_indices[:0],
                is_decode=all(n == 1 for n in step.num_new[lo:hi]),
            )

        stream = self.cache.stream([r.seq for r in step.requests[first:]])
        tail = part(first, len(step))
        tail.block_tables = stream.plan.block_tables  # [B_streamed, width]: rows of the staging buffer
        return StreamedAttention(cu[first], part(0, first) if first else None, tail, stream)

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> tuple[list[Request], SamplerOutput | None]:
        """One forward pass; returns the requests that got a next token and the sampler's output."""
        input_ids, positions, meta, sampling = self.prepare(step)
        for r in step.requests:
            r.seq.wait()  # L2 -> L1 loads into its blocks, ordered before the attention reads
        logits = self.graphs.run(input_ids, positions, self.cache.l1.kv, meta)  # None: not a graph step
        if logits is None:
            logits = self.lm.model(input_ids, positions, self.cache.l1.kv, meta)  # [len(sampling), vocab]
        if not sampling:
            return [], None
        batch = SamplingBatch.build(
            [r.params for r in sampling], self.vocab_size, self.device,
            generators=[r.generator for r in sampling],
            prompt_ids=[r.prompt_ids for r in sampling], output_ids=[r.output_ids for r in sampling],
        )
        return sampling, self.sampler(logits, batch)
