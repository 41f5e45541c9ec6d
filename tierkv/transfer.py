"""Moves blocks between L1 (the device pool) and L2 (the host pool); L2<->L3 is l3_mover.py.

L1<->L2: on CUDA every move runs on a dedicated copy stream, so moves never block the compute
stream and are ordered among themselves (a slot written by one move and read by a later one
needs no extra sync). A move goes one of two ways, whatever L1's layout (tierkv's own or an
engine's registered buffers):
  staged DMA: one kernel gathers the blocks into a device staging buffer (or scatters them out of
    it), and the copy engines move the rows between it and L2 in one batch of DMAs (dma.py): one
    a run of neighbouring L2 slots, or one a block for a group of layers. They leave the SMs to
    the compute stream. Where L2 holds another format (an OffloadLayout: fp8 and scales) the
    kernels also quantise and dequantise, so PCIe carries the small format. The buffer has two
    halves, and the kernels run on a stream of their own: a chunk's gather or scatter overlaps
    the next chunk's DMA (on one stream they took turns). A chunk fills a half with its blocks'
    parts packed (staging.py), so a chunk of a quarter of the layers holds four times the blocks
    of whole ones: the host's work per chunk (bookkeeping, a batch call, a kernel launch) comes a
    quarter as often.
  the GPU's own copy: where L2 is pinned in L1's format and a block's part is too narrow for a
    DMA (one layer at a time: below MIN_DMA_ROW), one kernel (kernels.copy_planes) copies the
    blocks straight between the pools, reading and writing host memory through unified addressing.
DMA_MOVES switches staged DMA off for L2 in L1's format. A load goes in groups of layers, each
with its own event, so that attention can wait for its layer alone. On CPU a move is a plain
copy that is done on return. `to_host` / `from_host` convert blocks that bypass L2 (spills,
direct L3 reads).

Where the engine owns L1, its moves are recorded instead and it runs them on a BlockMover of
its own (recorded_moves.py).

This file decides nothing about which blocks move, and never touches the index.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence

import torch

from . import dma, kernels
from .index_ring import IndexRing
from .layout import OffloadLayout
from .staging import StagingBuffer, layer_span, runs
from .tiers import DevicePool, HostPool
from .tiers.gpu import block_planes

log = logging.getLogger(__name__)
EWMA_ALPHA = 0.2  # weight of the newest bandwidth sample

STAGING_BYTES = 256 * 2**20  # device staging buffer: big enough for full-speed DMA, small next to L1
# Loads are issued in this many groups of layers, each with its own event: layer l's attention may
# start once its group has landed (Transfer.wait_layer); a layer-by-layer save copies a group once
# its last layer is written. More groups overlap more finely, at ~46 us of host time per launch
# (H200, bench_planes), and make each block's part of a DMA narrower (a layer alone, 64 KiB of a
# Llama-3.1-8B block, is too narrow for one: the GPU copies it, at ~89% of a memcpy).
LAYER_GROUPS = 4
# Where L2 is pinned in L1's format, the GPU can copy the blocks itself through unified addressing
# (one kernel however scattered the slots: ~89% of a pinned memcpy on the H200, ~62% host->device
# on the H100) or stage them for the copy engines. The GPU's copy fills SMs the compute stream
# needs: beside it a decode step's linears ran 1.2x (4 programs) to 24x (one per item) slower on
# the H100, beside the copy engines' 1.03-1.07x (bench_planes at 5aaa4f8). So staged DMA is chosen
# wherever each block's part is at least MIN_DMA_ROW long and the runtime batches DMAs (one call a
# chunk, dma.copy_batch). Without batching, each DMA costs host time too (~4 us beyond its bytes on
# the H200: 512 KiB ones reach ~72% of a memcpy; bench_custom_engine --compare-paths), so then
# staged DMA needs the DMAs to average at least MIN_DMA_BYTES ...
MIN_DMA_BYTES = 2**20
MIN_DMA_ROW = 256 * 2**10  # ... each block's part at least this long: narrower rows crawl (one
# layer of 64 KiB a block, 2-D D2H: ~35% of a memcpy)
# Staged DMA for L2 in L1's format (off: the GPU copies such blocks itself, ~89% of a memcpy).
# It was off while tierkv-serve crashed with it; the cause was slot lists that the compute stream
# reused (see _index), and the crash came with it off too.
DMA_MOVES = True


class Transfer:
    """A batch of copies in flight; `wait()` orders the current stream after it without blocking the host.

    A load issued in layer groups (`BlockMover.l2_to_l1`) also has an event per group, so that
    layer `l`'s attention can wait for that layer alone (`wait_layer`)."""

    __slots__ = ("event", "groups", "starts")

    def __init__(self, event: torch.cuda.Event | None = None, groups: list[torch.cuda.Event] | None = None,
                 starts: list[int] | None = None) -> None:
        self.event = event  # the last of the copies: every one is complete when it is
        self.groups, self.starts = groups, starts  # per layer group: its event, and its first layer

    def group_of(self, layer: int) -> int:
        """Which of `groups` copies layer `layer`."""
        return bisect.bisect_right(self.starts, layer) - 1

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Make the current CUDA stream wait for this transfer (no host sync)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current CUDA stream) wait for the copies of layer `layer`
        (all of them when the transfer was not issued by layer). A forward that waits before each
        layer passes its stream: looking it up costs ~10 us a call."""
        if self.event is None:
            return
        stream = stream or torch.cuda.current_stream()
        stream.wait_event(self.event if self.groups is None else self.groups[self.group_of(layer)])

    def wait_on(self, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait for this transfer (no host sync)."""
        if self.event is not None:
            stream.wait_event(self.event)

    def synchronize(self) -> None:
        """Block the calling thread until the copies are complete (needed before the CPU reads L2)."""
        if self.event is not None:
            self.event.synchronize()


DONE = Transfer()


def in_flight(transfers: Iterable[Transfer | None]) -> list[Transfer]:
    """The distinct transfers among `transfers` (None skipped) that have not finished. Every block
    of a load shares its Transfer: a 12K-token hit names the same one 750 times, and each repeat
    would cost a query here and a wait per layer in the forward."""
    return [t for t in dict.fromkeys(t for t in transfers if t is not None) if not t.done()]


class BlockMover:
    def __init__(self, l1: DevicePool, l2: HostPool, warm_up: bool = True) -> None:
        """`warm_up`: compile the copy kernels now by copying slot 0 both ways (the first L2 hit
        of a process waited ~0.1 s for it); only where slot 0 holds nothing yet, so never over
        an L2 another process already fills (HostPool.attach)."""
        self.l1, self.l2 = l1, l2
        self.device = l1.device
        self.cuda = self.device.type == "cuda"
        self.layers = l1.layout.num_layers
        self.last = DONE  # the most recent move; every earlier one is complete when it is
        # Bytes/second of finished moves (EWMA), for load-or-recompute. Starts at a typical
        # figure (pinned PCIe Gen5 / a host memcpy) so that the first loads happen and measure.
        self.bandwidth = 25e9 if self.cuda else 5e9
        # (start, end, bytes) of recent CUDA moves, folded into `bandwidth` once they finish;
        # bounded so that a caller who never asks for an estimate never grows it.
        self._timings: deque[tuple[torch.cuda.Event, torch.cuda.Event, int]] = deque(maxlen=64)
        # L2's format when it differs from L1's (fp8 + scales); None: L2 holds L1's blocks as they are
        self.fmt = l2.layout if isinstance(l2.layout, OffloadLayout) else None
        # L2 in L1's format: the GPU copies blocks straight between the pools' planes, reading and
        # writing pinned host memory through unified addressing (no staging, no DMA per run of
        # slots; ~89% of a pinned memcpy on the H200, scattered slots alike: bench_custom_engine)
        self.l2_planes = block_planes(l2.kv, self.device) if self.fmt is None and (l2.pinned or not self.cuda) else None
        # staged DMA for L2 in L1's format (by groups of layers, too); fp8 L2 is always staged, and
        # moves whole packed rows (a layer's part of one is not where it is in L1's format)
        # (a head slice of a shared L2, HostPool.attach(heads=), is no run of whole rows: no DMA)
        self.dma = self.cuda and self.fmt is None and DMA_MOVES and dma.available() and l2.kv.is_contiguous()
        # staged rows move as one batch of DMAs by address (dma.copy_batch) where L2's rows are
        # addressable (any format); else torch's copies, one a run of whole rows
        self.by_address = self.cuda and dma.available() and l2.kv.is_contiguous()
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)  # DMAs, and the GPU's own copies
            self.kernels = torch.cuda.Stream(self.device)  # a staged move's gathers and scatters
            # per half of the staging buffer: the event after which the chunk in it has been read
            # (reset by every move, which starts after the previous one ended on both streams)
            self._free: list[torch.cuda.Event | None] = [None, None]
            self._chunks = 0  # chunks staged so far in this move: the next one takes half _chunks % 2
            self._ring = IndexRing(self.device)  # pinned staging of the moves' slot lists
            if warm_up:
                self._compile()

    def _compile(self) -> None:
        """Launch every kernel a move may use once, so that Triton compiles them now: the first L2
        hit of a process waited ~0.1 s for it (12K tokens, H200). Both pools' slot 0 are free at
        this point: copying between them is harmless."""
        zero = self._index([0])
        launches = []
        if self.l2_planes is not None:  # the GPU's own copies
            launches += [lambda: kernels.copy_planes(self.l1.planes, zero, self.l2_planes, zero),
                         lambda: kernels.copy_planes(self.l2_planes, zero, self.l1.planes, zero, (0, 2))]
        if self.l2_planes is None or self.dma:  # staged copies, whole blocks (and by layer with DMA)
            launches += [lambda: self._d2h([0], [0], zero), lambda: self._h2d([0], [0], zero, None)]
            if self.dma:
                launches.append(lambda: self._h2d([0], [0], zero, range(0, 1)))
        if self.fmt is not None:
            out = self.staging.tensor[:1]
            launches += [  # to_host, read_l2
                lambda: kernels.quantize_fp8(self._blocks(1), self.fmt.payload(out), self.fmt.scales(out)),
                lambda: kernels.dequantize_fp8(self.fmt.payload(out), self.fmt.scales(out), self._blocks(1))]
        self._on_stream(1, launches).synchronize()
        if self.dma:  # the staging tables of the loads' groups: building one copies its pointers
            bounds = [*layer_groups(self.layers), self.layers]  # to the device, a wait mid-move
            for a, b in zip(bounds, bounds[1:]):
                for half in range(self.staging.halves):
                    self.staging.table(range(a, b), half)
        self._timings.clear()  # compile time is no bandwidth sample
        self.last = DONE

    @functools.cached_property
    def staging(self) -> StagingBuffer:
        """The device side of every staged DMA between the pools (staging.py)."""
        n = max(1, min(self.l1.num_blocks, STAGING_BYTES // self.l2.layout.bytes_per_block))
        return StagingBuffer(self.l1.layout, self.l2.layout, n, self.device)

    def _blocks(self, n: int) -> torch.Tensor:
        """Scratch blocks [n, layers, 2, bs, h, d] in L1's dtype on the device."""
        return torch.empty((n, *self.l1.layout.block_shape), dtype=self.l1.layout.dtype, device=self.device)

    def estimate_seconds(self, num_blocks: int) -> float:
        """Expected seconds to move `num_blocks` blocks between L2 and L1 now."""
        while self._timings and self._timings[0][1].query():  # fold in the moves that finished
            start, end, nbytes = self._timings.popleft()
            self._sample(nbytes, start.elapsed_time(end) / 1e3)
        return num_blocks * self.l1.layout.bytes_per_block / self.bandwidth

    def _sample(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self.bandwidth += EWMA_ALPHA * (nbytes / seconds - self.bandwidth)

    def _index(self, slots: list[int]) -> torch.Tensor:
        """`slots` as a device tensor for the copy stream's kernels, without a host sync: staged in
        the pinned IndexRing and copied asynchronously (a copy from pageable memory would wait for
        the copy stream to drain, so the host would sit out every chunk's DMA instead of launching
        the compute meanwhile). Allocated on the copy stream (and recorded on the kernels' stream), so
        that the allocator gives its memory to nothing else before the copies and kernels that read
        it have run: made on the compute stream, it
        went back to that stream's pool when the move returned, and a forward issued beside a
        load still waiting its turn overwrote it (an illegal address on the H200, tierkv-serve)."""
        if not self.cuda:
            return torch.tensor(slots, dtype=torch.int64)
        index = self._ring.to_device(slots, self.stream)
        index.record_stream(self.kernels)  # a staged move's gathers and scatters read it there
        return index

    def l1_to_l2(self, l1_slots: list[int], l2_slots: list[int], layers: range | None = None) -> Transfer:
        """Copy L1 blocks `l1_slots` into L2 slots `l2_slots` (same length); `layers`: only these
        layers of them (a save issued layer by layer), where L2 holds L1's format."""
        assert len(l1_slots) == len(l2_slots)
        if not l1_slots:
            return DONE
        if not self.cuda:
            t = time.perf_counter()
            if self.l2_planes is not None:
                kernels.copy_planes(self.l1.planes, self._index(l1_slots), self.l2_planes, self._index(l2_slots),
                                    _planes(layers))
            else:
                self.l2.kv[torch.tensor(l2_slots)] = self._encode(self.l1.read(l1_slots))
            self._sample(len(l1_slots) * self.l1.layout.bytes_per_block, time.perf_counter() - t)
            return DONE
        if self.l2_planes is not None and not self._dma_pays(l2_slots, layers):
            return self._on_stream(self._bytes(l1_slots, layers), [lambda: kernels.copy_planes(
                self.l1.planes, self._index(l1_slots), self.l2_planes, self._index(l2_slots), _planes(layers))])
        assert layers is None or self.fmt is None, "L2 in another format than L1 is written whole blocks at a time"
        cap, index = self.staging.chunk_blocks(layers), self._index(l1_slots)
        return self._on_stream(self._bytes(l1_slots, layers), [
            lambda i=i: self._d2h(l1_slots[i : i + cap], l2_slots[i : i + cap], index[i : i + cap], layers)
            for i in range(0, len(l1_slots), cap)])

    @property
    def loads_layers(self) -> bool:
        """Whether `l2_to_l1(layers=)` moves only those layers' bytes: where L2 holds L1's format
        (the GPU's plane copies, or staged DMA by layer). Elsewhere it loads whole blocks."""
        return self.fmt is None and (self.l2_planes is not None or self.dma)

    def l2_to_l1(self, l2_slots: list[int], l1_slots: list[int], layers: Sequence[int] | None = None) -> Transfer:
        """Copy L2 blocks `l2_slots` into L1 slots `l1_slots` (same length). Where L2 holds L1's
        format, the copy goes in LAYER_GROUPS groups of layers, each with its own event; `layers`
        (sorted): only these layers of each block (where `loads_layers`; whole blocks otherwise)."""
        assert len(l1_slots) == len(l2_slots)
        if not l1_slots:
            return DONE
        bounds = [*layer_groups(self.layers), self.layers]
        groups = _layer_runs(bounds, layers if self.loads_layers else None)
        nbytes = sum(map(len, groups)) * len(l1_slots) * self.l1.layout.bytes_per_block // self.layers
        if not groups:  # no layer of these blocks is needed
            return DONE
        if not self.cuda:
            t = time.perf_counter()
            if self.l2_planes is not None:
                for g in groups:
                    kernels.copy_planes(self.l2_planes, self._index(l2_slots), self.l1.planes, self._index(l1_slots),
                                        _planes(g))
            else:
                self.l1.write(l1_slots, self._decode(self.l2.kv[torch.tensor(l2_slots)]))
            self._sample(nbytes, time.perf_counter() - t)
            return DONE
        if self.l2_planes is not None and not self._dma_pays(l2_slots, groups[0]):
            src, dst = self._index(l2_slots), self._index(l1_slots)
            return self._on_stream(nbytes, [
                lambda g=g: kernels.copy_planes(self.l2_planes, src, self.l1.planes, dst, _planes(g))
                for g in groups], starts=[g.start for g in groups])
        if not self.dma:
            groups = [None]  # whole blocks: packed rows (fp8), or torch's copies of a pageable L2
        index = self._index(l1_slots)
        # Group by group, so that layer l's attention waits only for its group's DMAs and scatters
        launches, starts = [], []
        for g in groups:
            cap = self.staging.chunk_blocks(g)
            for i in range(0, len(l1_slots), cap):
                launches.append(lambda g=g, i=i, cap=cap: self._h2d(
                    l2_slots[i : i + cap], l1_slots[i : i + cap], index[i : i + cap], g))
                starts.append(0 if g is None else g.start)
        return self._on_stream(nbytes, launches, starts=starts if groups[0] is not None else None)

    def read_l2(self, l2_slots: list[int]) -> torch.Tensor:
        """L2 blocks copied to the L1 device: [n, layers, 2, bs, h, d]. Ordered after earlier moves."""
        if not self.cuda:
            return self._decode(self.l2.kv.index_select(0, torch.tensor(l2_slots, dtype=torch.int64)))
        out = self._blocks(len(l2_slots))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if self.l2_planes is not None:
                kernels.copy_planes(self.l2_planes, self._index(l2_slots), block_planes(out),
                                    self._index(range(len(l2_slots))))
            else:  # packed blocks land in `rows` first and are dequantised into `out` on the copy stream
                rows = torch.empty((len(l2_slots), *self.staging.tensor.shape[1:]), dtype=self.staging.tensor.dtype,
                                   device=self.device)
                for pos, first, n in runs(l2_slots):
                    rows[pos : pos + n].copy_(self.l2.kv[first : first + n], non_blocking=True)
                self._decode(rows, out)
                rows.record_stream(self.stream)
            out.record_stream(torch.cuda.current_stream(self.device))
        event = torch.cuda.Event()
        event.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        return out

    def _encode(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """blocks [n, layers, 2, bs, h, d] in L1's dtype -> L2's format on the same device: the
        blocks themselves, or packed rows [n, bytes_per_block] (into `out` when given)."""
        if self.fmt is None:
            return blocks if out is None else out.copy_(blocks)
        if out is None:
            out = torch.empty((blocks.shape[0], self.fmt.bytes_per_block), dtype=torch.uint8, device=blocks.device)
        kernels.quantize_fp8(blocks, self.fmt.payload(out), self.fmt.scales(out))
        return out

    def _decode(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of _encode: L2-format blocks -> [n, layers, 2, bs, h, d] in L1's dtype (into `out`)."""
        if self.fmt is None:
            return rows if out is None else out.copy_(rows)
        if out is None:
            out = torch.empty((rows.shape[0], *self.l1.layout.block_shape), dtype=self.l1.layout.dtype,
                              device=rows.device)
        kernels.dequantize_fp8(self.fmt.payload(rows), self.fmt.scales(rows), out)
        return out

    def to_host(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [n, layers, 2, bs, h, d] (L1's dtype, any device) as contiguous host blocks in L2's
        format, converted where they are (on the GPU for L1 blocks); synchronous."""
        packed = self._encode(blocks)
        shape, dtype = self.l2.layout.block_storage
        return torch.empty((blocks.shape[0], *shape), dtype=dtype).copy_(packed)

    def from_host(self, rows: torch.Tensor) -> torch.Tensor:
        """Host blocks in L2's format [n, ...] -> [n, layers, 2, bs, h, d] in L1's dtype on L1's device,
        dequantised there (on the current stream)."""
        return self._decode(rows.to(self.device))

    def fence(self) -> None:
        """Make the current stream wait for every move issued so far (before reusing an evicted L1 slot)."""
        self.last.wait()

    def _bytes(self, slots: list[int], layers: range | None) -> int:
        """Bytes of `layers` (None: all) of as many blocks as `slots`, in L1's format."""
        whole = len(slots) * self.l1.layout.bytes_per_block
        return whole if layers is None else whole * len(layers) // self.layers

    def _on_stream(self, nbytes: int, launches: list, starts: list[int] | None = None) -> Transfer:
        """Run `launches` in order on the copy stream, each followed by an event on the stream it
        ended on (a staged chunk returns it: see _staged); `starts`: they copy consecutive groups
        of layers beginning there (a load), which Transfer.wait_layer tells apart. The move ends
        when both streams have done its work."""
        # The copy stream must see everything the compute stream wrote to these blocks so far,
        # and must not overwrite an L1 slot the compute stream may still be reading; the kernels'
        # stream starts where the copy stream is (after the previous move, and the slot lists).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.kernels.wait_stream(self.stream)
        self._free, self._chunks = [None, None], 0
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        events = []
        with torch.cuda.stream(self.stream):
            for launch in launches:
                ended = launch()
                events.append(torch.cuda.Event())
                events[-1].record(ended if isinstance(ended, torch.cuda.Stream) else self.stream)
        self.stream.wait_stream(self.kernels)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        self._timings.append((start, end, nbytes))
        self.last = Transfer(end, events, starts) if starts is not None else Transfer(end)
        return self.last

    def _staged(self, fill, drain, to_l2: bool) -> torch.cuda.Stream:
        """One chunk through a half of the staging buffer: `fill(half)` writes the half,
        `drain(half)` reads it. Towards L2 the kernels' stream fills (gather) and the copy
        stream drains (DMA); towards L1 the other way round. A half is filled again only after
        the chunk before in it was drained. Returns the stream the chunk ends on."""
        half = self._chunks % self.staging.halves
        self._chunks += 1
        first, then = (self.kernels, self.stream) if to_l2 else (self.stream, self.kernels)
        if self._free[half] is not None:
            first.wait_event(self._free[half])
        with torch.cuda.stream(first):
            fill(half)
        then.wait_stream(first)
        with torch.cuda.stream(then):
            drain(half)
        self._free[half] = torch.cuda.Event()
        self._free[half].record(then)
        return then

    @functools.cached_property
    def _rows(self) -> torch.Tensor:
        """[cap] int64 on the device: rows 0..cap-1 of a half of the staging buffer, for the scatter
        and gather kernels; cap: the most a half holds, one layer of each block."""
        return self._index(range(self.staging.chunk_blocks(range(1))))

    def _dma_pays(self, l2_slots: list[int], layers: range | None) -> bool:
        """Whether staged DMA beats the GPU's own copy for these slots (see MIN_DMA_BYTES)."""
        if not self.dma:
            return False
        width = layer_span(layers, self.layers, self.l2.layout.bytes_per_block)[1]
        if width < MIN_DMA_ROW:
            return False
        if dma.batched():  # one call a chunk, however scattered: the copy engines leave the SMs to compute
            return True
        return len(l2_slots) * width >= MIN_DMA_BYTES * sum(1 for _ in runs(l2_slots))

    def _dma(self, l2_slots: list[int], layers: range | None, to_l2: bool, half: int) -> None:
        """Between half `half` of the staging buffer and L2 slots `l2_slots`: `layers` of each
        block (None: all), in one batch of DMAs (dma.copy_batch)."""
        if not self.by_address:  # whole rows only: torch's copies, one a run
            assert layers is None or self.staging.span(layers)[1] == self.staging.row
            staged = self.staging.rows(half, len(l2_slots))
            for pos, first, n in runs(l2_slots):
                host, rows = self.l2.kv[first : first + n], staged[pos : pos + n]
                (host if to_l2 else rows).copy_(rows if to_l2 else host, non_blocking=True)
            return
        dsts, srcs, sizes = self.staging.copies(self.l2.kv, l2_slots, layers, to_l2, half)
        dma.copy_batch(dsts, srcs, sizes, stream=torch.cuda.current_stream(self.device).cuda_stream)

    def _d2h(self, l1_slots: list[int], l2_slots: list[int], l1_index: torch.Tensor,
             layers: range | None = None) -> torch.cuda.Stream:
        """One staged chunk L1 -> L2 in L2's format (fp8: quantised on the device, so the DMA
        carries packed rows)."""
        n = len(l1_slots)

        def gather(half: int) -> None:
            staged = self.staging.rows(half, n)
            if self.fmt is None:  # gathered into the half, each block's slice packed
                kernels.copy_planes(self.l1.planes, l1_index, self.staging.table(layers, half), self._rows[:n],
                                    _planes(layers))
            elif self.l1.kv is not None:
                kernels.gather_quantize_fp8(self.l1.kv, l1_index, self.fmt.payload(staged), self.fmt.scales(staged))
            else:  # an engine's own layout: gathered into tierkv's block layout first
                self._encode(self.l1.read(l1_slots), staged)

        return self._staged(gather, lambda half: self._dma(l2_slots, layers, True, half), to_l2=True)

    def _h2d(self, l2_slots: list[int], l1_slots: list[int], l1_index: torch.Tensor,
             layers: range | None) -> torch.cuda.Stream:
        """One staged chunk L2 -> L1 (`layers` of each block, where L2 holds L1's format)."""
        n = len(l1_slots)

        def scatter(half: int) -> None:
            staged = self.staging.rows(half, n)
            if self.fmt is None:
                kernels.copy_planes(self.staging.table(layers, half), self._rows[:n], self.l1.planes, l1_index,
                                    _planes(layers))
            elif self.l1.kv is not None:  # dequantised on the device, straight into the L1 slots
                kernels.dequantize_scatter_fp8(self.fmt.payload(staged), self.fmt.scales(staged), self.l1.kv, l1_index)
            else:
                self.l1.write(l1_slots, self._decode(staged))

        return self._staged(lambda half: self._dma(l2_slots, layers, False, half), scatter, to_l2=False)


def layer_groups(num_layers: int) -> list[int]:
    """The first layer of each group of layers a load, or a layer-by-layer save, moves together
    (LAYER_GROUPS, as even as can be)."""
    groups = min(num_layers, LAYER_GROUPS)
    return [g * num_layers // groups for g in range(groups)]


def _layer_runs(bounds: list[int], layers: Sequence[int] | None) -> list[range]:
    """The ranges of layers a load copies one after the other: the groups between `bounds` (a
    load's layer groups, then the layer count), cut down to the runs of consecutive `layers`
    within each (None: all layers)."""
    groups = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    if layers is None:
        return groups
    wanted = set(layers)
    out = []
    for g in groups:
        run = [layer for layer in g if layer in wanted]
        for _, first, n in runs(run):
            out.append(range(first, first + n))
    return out


def _planes(layers: range | None) -> tuple[int, int] | None:
    """The planes (K and V of each layer) of `layers`; None: all."""
    return None if layers is None else (2 * layers.start, 2 * layers.stop)

