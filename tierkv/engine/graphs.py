"""StepGraphs: a step's forward pass as CUDA graphs: decode steps by padded batch size and
block-table width, and small mixed steps (prompt tokens beside decodes) by padded token and
sequence counts.

A decode step of B sequences copies its inputs into static buffers, replays the graph captured
for the smallest size >= B and the narrowest width that holds its block tables (rows past B are
padding: KV slot -1, length 0), and computes the logits of the rows that sample eagerly from the
graph's hidden states. A mixed step of T <= MIXED_TOKENS[-1] new tokens over B sequences does
the same in a graph of T' >= T tokens over B' > B sequences: its T' - T padding tokens belong
to one more sequence, which writes no KV (slot -1) and attends over itself in block 0; the
sequences after it have no tokens. Anything else (long prompt chunks, streamed steps, loads
still landing, CPU, enforce_eager, too large a batch or block table) runs eagerly: `run`
returns None. This file must never sync the host, allocate with data-dependent shapes on the
replay path, or write the KV pool anywhere but the live rows' slots.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from tierkv import kernels

from .attention import AttentionMetadata
from .model import CausalLM

log = logging.getLogger(__name__)

# Largest batch captured, whatever max_num_seqs says: beyond it the launch overhead a graph
# saves is small next to the step's own work, and each size costs capture time.
MAX_CAPTURE_BATCH = 256

# Context lengths (tokens) below max_model_len whose block-table widths get graphs of their own.
# The decode kernel splits each sequence by the table's width, a shape fixed at capture: replayed
# in a graph as wide as max_model_len, a short context is read by two 128-token splits among
# dozens of empty ones (batch-1 decode of 256 tokens on the H200: 5.8 us a layer, 4.9 us in the
# 512-token graph's 64-token splits). A width is captured only for the batch sizes where the
# kernel would launch differently than at the next wider one.
SHORT_CONTEXTS = (512, 2048)

# Mixed steps of at most the last of these many new tokens replay graphs, padded up to the next
# size. An eager step launches ~300 kernels: with the Llama-3.1-8B shape on an H100 that took the
# host 23-37 ms, against 17 ms of GPU work for four decodes and a 132-token chunk at 8K tokens, so
# such a step kept the GPU waiting (bench_step_graphs). Padding costs little while the linear
# layers read their weights once whatever the row count, and the padding sequence attends over its
# own few tokens only; but at 256 rows Llama-8B's linears on an H100 are past that (2 x 8e9 x 256
# FLOP take longer than reading 16 GB): bench_rounds' hit-round mixed steps, four decodes and a
# 140-token chunk (144 tokens), spent ~7.0 ms in their GEMMs against ~5.4 ms for a decode step's
# (trace at 4b5c5db), so 192 sits between 128 and 256. Longer chunks launch eagerly: their work
# hides the launch.
MIXED_TOKENS = (64, 128, 192, 256, 512)


def mixed_shapes(max_batch: int, max_tokens: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of the mixed-step graphs: every MIXED_TOKENS size up to `max_tokens` (a
    step's budget), each with the powers of two from 2 up to the first that holds max_batch + 1
    (the padding sequence), and none holding more sequences than twice its tokens (every real
    sequence has at least one token)."""
    top = 2
    while top < max_batch + 1:
        top *= 2
    seqs = [2 ** i for i in range(1, top.bit_length())]
    return [(t, b) for t in MIXED_TOKENS if t <= max_tokens for b in seqs if b <= 2 * t]


def mixed_shape_for(shapes, tokens: int, seqs: int) -> tuple[int, int] | None:
    """Of the (tokens, sequences) `shapes`, the one a mixed step of `tokens` new tokens over `seqs`
    sequences replays: the fewest tokens >= tokens, then the fewest sequences > seqs (one more
    holds the padding); None if none."""
    return min(((t, b) for t, b in shapes if t >= tokens and b > seqs), default=None)


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, then max_batch itself.

    Padding a batch wastes at most 7 rows past 8 (of a memory-bound step, so almost free).
    """
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class StepGraphs:
    """Captured forwards of `model` over the pool `kv_pool`, and the static buffers they read.

    The graphs bake in the addresses of the pool, the weights and the static buffers. The L1
    pool (`TieredKVCache.l1.kv`) is allocated once and never reallocated; `run` checks that
    it is given the very tensor it captured and runs eagerly otherwise.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_pool: torch.Tensor,
        *,
        block_size: int,
        max_model_len: int,
        max_batch_size: int,
        max_step_tokens: int | None = None,
        enabled: bool = True,
        layer_group: list[int] | None = None,
    ) -> None:
        """`max_step_tokens`: the most tokens a step computes (the scheduler's budget), which
        bounds the mixed graphs' sizes; None captures none. `layer_group`: each layer's group
        where layer groups keep their KV in caches of their own (tierkv/groups.py); each group
        then has a slot mapping and block tables of its own."""
        self.model, self.kv = model, kv_pool  # kv: [layers, num_blocks, 2, block_size, Hkv, D], or a list per layer
        self.layer_group = layer_group
        self.num_groups = 1 if layer_group is None else max(layer_group) + 1
        self.device = kv_pool[0].device
        self.disabled_reason: str | None = None
        if not enabled:
            self.disabled_reason = "enforce_eager"
        elif self.device.type != "cuda":
            self.disabled_reason = f"the model runs on {self.device.type}"
        elif kernels.backend_for(kv_pool[0]) != "triton":
            # the torch reference kernels read lengths on the host (.tolist()): not capturable
            self.disabled_reason = "the reference kernels are forced (TIERKV_KERNELS)"
        self.sizes = capture_sizes(min(max_batch_size, MAX_CAPTURE_BATCH)) if self.enabled else []
        # the padding sequence's tokens read block 0 through its table row: it must hold them
        max_mixed = min(max_step_tokens or 0, max_model_len)
        self.mixed = mixed_shapes(self.sizes[-1], max_mixed) if self.sizes and max_step_tokens else []
        # Every sequence fits max_model_len tokens, so its block-table row fits this width; the
        # narrower widths serve short contexts (SHORT_CONTEXTS)
        self.width = -(-max_model_len // block_size)
        self.widths = sorted({-(-t // block_size) for t in SHORT_CONTEXTS if t < max_model_len} | {self.width})
        self.block_size = block_size
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch size, table width) -> graph
        self.mixed_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (tokens, sequences) -> graph
        self.mixed_disabled_reason: str | None = None
        self.replays = 0  # decode steps served by a graph (tests and stats read it)
        self.mixed_replays = 0  # mixed steps served by a graph
        self._warned_pool = False

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    # ------------------------------------------------------------------ capture

    def _allocate(self) -> None:
        """Static inputs sized for the largest graph, and the hidden-state output all graphs share."""
        n, dev = self.sizes[-1], self.device
        tokens = max([n] + [t for t, _ in self.mixed])
        seqs = max([n] + [b for _, b in self.mixed])
        hidden = self.model.config.hidden_size
        dtype = self.model.model.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=dev)        # [tokens]
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=dev)        # [tokens]
        # per layer group (one without groups): where each row's token goes, and its blocks
        self.slot_mappings = [torch.full((tokens,), -1, dtype=torch.int64, device=dev)  # [tokens], -1: no write
                              for _ in range(self.num_groups)]
        self.block_tables = [torch.zeros(seqs, self.width, dtype=torch.int32, device=dev)  # [seqs, width]
                             for _ in range(self.num_groups)]
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=dev)          # [seqs], 0: padding
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)    # [max_bs + 1], one token each
        self.cu_mixed = torch.zeros(seqs + 1, dtype=torch.int32, device=dev)      # [seqs + 1], a mixed step's
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)      # [max_bs]
        self.hidden = torch.zeros(tokens, hidden, dtype=dtype, device=dev)        # [tokens, hidden] graph output

    def _meta(self, bs: int, width: int, tokens: int | None = None) -> AttentionMetadata:
        """Metadata over the first `bs` rows and `width` table columns of the static buffers (views:
        the graph reads them live): a decode step's, or with `tokens` a mixed step's of that many
        new tokens (cu_mixed says whose). Each call gives fresh prefill plans: a capture must
        record their making, since a replay's batch is not the one captured."""
        t = bs if tokens is None else tokens
        metas = [AttentionMetadata(
            slot_mapping=self.slot_mappings[g][:t],
            block_tables=self.block_tables[g][:bs, :width],
            seq_lens=self.seq_lens[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1] if tokens is None else self.cu_mixed[: bs + 1],
            logits_indices=self.logits_indices[:bs],
            is_decode=tokens is None,
        ) for g in range(self.num_groups)]
        if self.layer_group is not None:
            metas[0].groups, metas[0].layer_group = metas, self.layer_group
        return metas[0]

    def _forward(self, rows: int, meta: AttentionMetadata) -> None:
        """The captured work: hidden states of `rows` tokens into the shared output buffer."""
        hidden = self.model.hidden_states(self.input_ids[:rows], self.positions[:rows], self.kv, meta)  # [rows, hidden]
        self.hidden[:rows].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per shape, largest first, all in one memory pool; once, before serving:
        the decode graphs, then the mixed ones.

        While capturing, every slot is -1, every length 0 and every sequence empty: the pool is
        neither read nor written. On failure, logs a warning and leaves the engine eager (the
        mixed steps alone, where only a mixed capture failed) rather than failing it.
        """
        if not self.enabled or self.graphs:
            return
        start = time.perf_counter()
        try:
            with torch.cuda.device(self.device):
                self._allocate()
                self._pool, self._side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
                for bs, width in self._shapes():
                    self.graphs[bs, width] = self._capture(bs, lambda: self._meta(bs, width))
                torch.cuda.synchronize()
        except Exception as exc:  # an op that cannot be captured: serve eagerly, say so
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly. Pass enforce_eager=True to "
                        "skip the attempt.", type(exc).__name__, exc, exc_info=True)
            self.graphs.clear()
            self.disabled_reason = f"capture failed: {exc}"
            return
        decode_s = time.perf_counter() - start
        try:
            with torch.cuda.device(self.device):
                for tokens, seqs in reversed(self.mixed):
                    self.mixed_graphs[tokens, seqs] = self._capture(
                        tokens, lambda: self._meta(seqs, self.width, tokens))
                torch.cuda.synchronize()
        except Exception as exc:
            log.warning("CUDA graph capture of the mixed steps failed (%s: %s); they run eagerly.",
                        type(exc).__name__, exc, exc_info=True)
            self.mixed_graphs.clear()
            self.mixed_disabled_reason = f"capture failed: {exc}"
        log.info("captured %d decode CUDA graphs (batch sizes %d..%d, block-table widths %s) in %.2f s, and %d "
                 "of mixed steps (up to %d tokens) in %.2f s", len(self.graphs), self.sizes[0], self.sizes[-1],
                 sorted({w for _, w in self.graphs}), decode_s, len(self.mixed_graphs),
                 max((t for t, _ in self.mixed_graphs), default=0), time.perf_counter() - start - decode_s)

    def _capture(self, rows: int, meta) -> torch.cuda.CUDAGraph:
        """One graph of `_forward` over `rows` tokens, `meta()` making its metadata."""
        # Warm up on a side stream first (PyTorch's recipe): Triton compiles, cuBLAS picks its
        # kernels and workspaces, none of which may happen while capturing.
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            self._forward(rows, meta())
        torch.cuda.current_stream().wait_stream(self._side)
        graph = torch.cuda.CUDAGraph()
        # Captured on the warm-up's stream: what the kernels keep per stream (the decode's work
        # tickets) was made while warming up, outside the graph, not inside it.
        with torch.cuda.graph(graph, pool=self._pool, stream=self._side):
            self._forward(rows, meta())
        return graph

    def _shapes(self) -> list[tuple[int, int]]:
        """(batch size, width) pairs to capture, largest first: every size at the full width, and a
        narrower width where the decode kernel launches differently than at the next wider one."""
        shapes = []
        for bs in reversed(self.sizes):
            wider = None
            for width in reversed(self.widths):
                launch = kernels.decode_launch(self.kv[0], bs, width * self.block_size)
                if launch != wider:
                    shapes.append((bs, width))
                wider = launch
        return shapes

    # ------------------------------------------------------------------ replay

    def _captured_pool(self, kv_pool) -> bool:
        """Whether `kv_pool` is the pool the graphs captured (one tensor, or the same list of them)."""
        if isinstance(self.kv, torch.Tensor):
            return (isinstance(kv_pool, torch.Tensor) and kv_pool.data_ptr() == self.kv.data_ptr()
                    and kv_pool.shape == self.kv.shape)
        return kv_pool is self.kv

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size >= batch, or None when the batch is larger than all."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) and self.graphs else None

    def width_for(self, bs: int, columns: int) -> int:
        """The narrowest width captured for size `bs` that holds `columns` block-table columns."""
        return next(w for w in self.widths if w >= columns and (bs, w) in self.graphs)

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Logits [len(meta.logits_indices), vocab] fp32 as `CausalLM.forward` gives them, from a
        graph replay; None when this step must run eagerly (the caller then runs the model).

        input_ids, positions: [T]; meta: a step of B sequences whose K/V are all in L1 (not
        streamed, no loads still landing: `meta.wait_layer` unset).
        """
        if not self.graphs or meta.streamed is not None or meta.wait_layer is not None:
            return None
        table = meta.block_tables  # [B, w]
        if input_ids.shape[0] == 0 or table.shape[1] > self.width:
            return None
        if not self._captured_pool(kv_pool):
            if not self._warned_pool:
                log.warning("the KV pool is not the one the step graphs captured; running eagerly")
                self._warned_pool = True
            return None
        if meta.is_decode:
            return self._run_decode(input_ids, positions, meta)
        return self._run_mixed(input_ids, positions, meta)

    def _run_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        b = input_ids.shape[0]
        bs = self.size_for(b)
        if bs is None or meta.num_seqs != b:
            return None
        # Padding rows write nothing (slot -1) and attend to nothing (length 0).
        self._stage(input_ids, positions, meta, tokens=bs)
        self.seq_lens[b:bs].zero_()
        self.graphs[bs, self.width_for(bs, meta.block_tables.shape[1])].replay()
        self.replays += 1
        return self._logits(b, meta)

    def _run_mixed(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        t, b = input_ids.shape[0], meta.num_seqs
        shape = mixed_shape_for(self.mixed_graphs, t, b)
        if shape is None:
            return None
        tokens, seqs = shape
        pad = tokens - t  # the padding sequence's tokens: positions 0..pad-1 of its own, in block 0
        self._stage(input_ids, positions, meta, tokens)
        self.seq_lens[b : b + 1].fill_(pad)
        self.seq_lens[b + 1 : seqs].zero_()
        self.cu_mixed[: b + 1].copy_(meta.cu_seqlens_q)
        self.cu_mixed[b + 1 : seqs + 1].fill_(tokens)
        for table in self.block_tables[: len(meta.groups or [meta])]:
            table[b, : -(-pad // self.block_size)].zero_()
        self.mixed_graphs[tokens, seqs].replay()
        self.mixed_replays += 1
        return self._logits(t, meta)

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, tokens: int) -> None:
        """Copy the step's live rows into the static buffers (T tokens of B sequences); its
        slots past T, up to the graph's `tokens`, write nothing (-1). Block-table columns past
        the step's keep stale entries: the kernels read entries only below a row's length."""
        t, b, w = input_ids.shape[0], meta.num_seqs, meta.block_tables.shape[1]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.seq_lens[:b].copy_(meta.seq_lens)
        for g, group in enumerate(meta.groups or [meta]):
            self.slot_mappings[g][:t].copy_(group.slot_mapping)
            self.slot_mappings[g][t:tokens].fill_(-1)
            self.block_tables[g][:b, :w].copy_(group.block_tables)

    def _logits(self, rows: int, meta: AttentionMetadata) -> torch.Tensor:
        """As CausalLM.forward: final norm and LM head only on the rows that sample."""
        return self.model.compute_logits(self.hidden[:rows].index_select(0, meta.logits_indices))
