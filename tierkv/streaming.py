"""Streamed attention input: the KV of sequences larger than L1, assembled one layer at a time.

A streamed sequence keeps its oldest blocks in L2 (pinned host) and only its recent blocks in L1.
For each step and layer, `LayerStream` builds that layer's KV of every streamed sequence in a
device staging buffer: the L2 blocks are read by the GPU over PCIe on a side stream, one layer
ahead of the compute (two buffers, events per layer), and the L1 blocks are copied in once the
layer's new K/V are written. Attention then reads the staging buffer through ordinary block
tables, so the kernels do not know streaming exists. With fp8 in L2 (an OffloadLayout) the
layer's fp8 values and scales cross PCIe and are dequantised into the buffer on the side stream.
This file moves bytes only: which blocks live where is decided in cache.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .layout import OffloadLayout
from .sequence import SequenceBlocks
from .tiers import DevicePool, HostPool
from .transfer import Transfer


@dataclass(slots=True)
class StreamPlan:
    """Where every block of this step's streamed sequences comes from, and its staging row.

    l2_slots/l2_rows: [m] int64, L2 slot -> staging row, for the blocks that live in L2.
    l1_slots/l1_rows: [r] int64, L1 slot -> staging row, for the blocks that live in L1.
    block_tables: [B, width] int32, each sequence's staging rows in token order (-1 padded).
    """

    l2_slots: torch.Tensor
    l2_rows: torch.Tensor
    l1_slots: torch.Tensor
    l1_rows: torch.Tensor
    block_tables: torch.Tensor
    num_rows: int

    @property
    def l2_blocks(self) -> int:
        return int(self.l2_slots.shape[0])

    @classmethod
    def build(cls, seqs: list[SequenceBlocks], device: torch.device) -> StreamPlan:
        """The plan for one step of `seqs`: each sequence's blocks take consecutive staging rows,
        its offloaded leading blocks from L2, the rest from L1."""
        l2_slots, l2_rows, l1_slots, l1_rows = [], [], [], []
        width = max(len(s.slots) for s in seqs)
        table = torch.full((len(seqs), width), -1, dtype=torch.int32)  # [B, width]
        row = 0
        for b, s in enumerate(seqs):
            n, k = len(s.slots), s.offloaded
            table[b, :n] = torch.arange(row, row + n, dtype=torch.int32)
            l2_slots += s.l2_slots
            l2_rows += range(row, row + k)
            l1_slots += s.slots[k:]
            l1_rows += range(row + k, row + n)
            row += n

        def index(values: list[int]) -> torch.Tensor:  # [n] int64 on the device
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        return cls(index(l2_slots), index(l2_rows), index(l1_slots), index(l1_rows),
                   table.to(device, non_blocking=True), row)


class LayerStreamer:
    """Owns the two staging buffers and the side stream; `start` hands out one step's LayerStream."""

    def __init__(self, l1: DevicePool, l2: HostPool) -> None:
        self.l1, self.l2 = l1, l2
        self.device = l1.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.buffers: list[torch.Tensor] = []  # 2 x [rows, 2, bs, h, d], grown on demand, never shrunk
        self.fmt = l2.layout if isinstance(l2.layout, OffloadLayout) else None  # L2 holds fp8 + scales
        self.bytes_read = 0  # bytes streamed out of L2 so far (all layers)

    def start(self, plan: StreamPlan, after: Transfer) -> LayerStream:
        """Begin a step: its first two layers start loading at once. `after`: the last L1<->L2 move,
        which may have written the L2 blocks the plan reads."""
        if not self.buffers or self.buffers[0].shape[0] < plan.num_rows:
            rows = max(plan.num_rows, 2 * self.buffers[0].shape[0] if self.buffers else 0)
            self.synchronize()  # the old buffers may still be read by the previous step
            shape = (rows, *self.l1.kv.shape[2:])
            self.buffers = [torch.empty(shape, dtype=self.l1.kv.dtype, device=self.device) for _ in range(2)]
        self.bytes_read += plan.l2_blocks * self.l2.layout.bytes_per_block
        return LayerStream(self, plan, after)

    def synchronize(self) -> None:
        """Wait until every load issued so far is complete (before L2 slots it read are reused)."""
        if self.stream is not None:
            self.stream.synchronize()


class LayerStream:
    """One step's streamed KV: `layer_kv(i, pool_i)` before layer i's attention, `release(i)` after."""

    def __init__(self, streamer: LayerStreamer, plan: StreamPlan, after: Transfer) -> None:
        self.s, self.plan = streamer, plan
        self.num_layers = streamer.l1.layout.num_layers
        self.loaded: list[torch.cuda.Event | None] = [None] * self.num_layers
        if streamer.cuda:
            # The side stream must not overwrite a buffer the previous step still reads, and must
            # see the L1 -> L2 copies that filled the blocks it reads.
            streamer.stream.wait_stream(torch.cuda.current_stream(streamer.device))
            after.wait_on(streamer.stream)
        for layer in range(min(2, self.num_layers)):
            self._load(layer)

    def _buffer(self, layer: int) -> torch.Tensor:
        return self.s.buffers[layer % 2][: self.plan.num_rows]  # [rows, 2, bs, h, d]

    def _load(self, layer: int) -> None:
        """Copy layer `layer` of the plan's L2 blocks into its buffer (on the side stream on CUDA)."""
        if not self.s.cuda:
            self._copy_layer(layer)
            return
        with torch.cuda.stream(self.s.stream):
            self._copy_layer(layer)
            event = torch.cuda.Event()
            event.record(self.s.stream)
        self.loaded[layer] = event

    def _copy_layer(self, layer: int) -> None:
        """The plan's L2 blocks' layer `layer` into their buffer rows, on the current stream."""
        buf, plan, fmt = self._buffer(layer), self.plan, self.s.fmt
        if fmt is None:
            src = self.s.l2.kv[:, layer]  # [N, 2, bs, h, d], rows strided by the layer count
            kernels.copy_blocks(src, plan.l2_slots, buf, plan.l2_rows)
            return
        # fp8: the layer's values (as bytes) and scales come over into scratch rows 0..m-1, are
        # dequantised there, then go to their buffer rows. Scratch is allocated on this stream,
        # which alone uses it, so the allocator reuses it safely.
        rows = self.s.l2.kv  # [N, bytes_per_block] uint8
        values = fmt.payload(rows)[:, layer].view(torch.uint8)  # [N, 2, bs, h, d]
        scales = fmt.scales(rows)[:, layer]  # [N, 2, h] fp32
        m = plan.l2_blocks
        at = torch.arange(m, device=buf.device)
        q = kernels.copy_blocks(values, plan.l2_slots, torch.empty((m, *values.shape[1:]), dtype=torch.uint8,
                                                                   device=buf.device), at)
        sc = kernels.copy_blocks(scales, plan.l2_slots, torch.empty((m, *scales.shape[1:]), dtype=torch.float32,
                                                                   device=buf.device), at)
        deq = torch.empty((m, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
        kernels.dequantize_fp8(q.view(fmt.dtype), sc, deq)
        kernels.copy_blocks(deq, at, buf, plan.l2_rows)

    def layer_kv(self, layer: int, pool: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s staged KV [rows, 2, bs, h, d]; `pool` is that layer's L1 view, whose new
        K/V must already be written (the L1 blocks are copied now, on the current stream)."""
        if self.loaded[layer] is not None:
            torch.cuda.current_stream(self.s.device).wait_event(self.loaded[layer])
        buf = self._buffer(layer)
        kernels.copy_blocks(pool, self.plan.l1_slots, buf, self.plan.l1_rows)
        return buf

    def release(self, layer: int) -> None:
        """Layer `layer`'s attention is issued: its buffer may take layer + 2 once that attention ends."""
        nxt = layer + 2
        if nxt >= self.num_layers:
            return
        if self.s.cuda:
            self.s.stream.wait_stream(torch.cuda.current_stream(self.s.device))
        self._load(nxt)
