"""StagingBuffer: the device buffer that staged L1<->L2 moves pass through, and where a chunk lies in it.

A staged move goes in chunks. A chunk fills one half of the buffer (all of it when it holds a
single block) with its blocks' parts, packed from the half's start: a group of layers of each
block, or whole blocks. So a chunk of a quarter of the layers holds four times the blocks of
whole ones, and the halves' bytes never overlap whatever parts one move mixes. This file says
where things are: the plane tables that the gather and scatter kernels address a half through,
the whole rows of a half (fp8's packed rows), and the DMAs between a half and L2. It never
copies, and it never orders anything on a stream (transfer.py does both).
"""

from __future__ import annotations

import numpy as np
import torch

from .kernels import PlaneTable
from .layout import KVLayout, OffloadLayout


def layer_span(layers: range | None, num_layers: int, row: int) -> tuple[int, int]:
    """(offset, length) in bytes, within an L2 row of `row` bytes in L1's format ([layers, 2, bs,
    h, d] per block), of `layers` (None: the whole row)."""
    if layers is None:
        return 0, row
    per_layer = row // num_layers
    return layers.start * per_layer, len(layers) * per_layer


class StagingBuffer:
    def __init__(self, l1_layout: KVLayout, l2_layout: KVLayout | OffloadLayout, blocks: int,
                 device: torch.device) -> None:
        """`blocks` L2 rows on `device`: blocks [n, layers, 2, bs, h, d] in L1's dtype, or packed
        rows [n, bytes] (uint8) when L2 holds fp8."""
        shape, dtype = l2_layout.block_storage
        self.tensor = torch.empty((blocks, *shape), dtype=dtype, device=device)   # [blocks, *an L2 row]
        self.row = l2_layout.bytes_per_block
        self.num_layers = l1_layout.num_layers
        self.plane_shape = l1_layout.block_shape[1:]   # (2, bs, h, d) of one layer, where L2 holds L1's format
        self.halves = 2 if blocks > 1 else 1
        self.half_bytes = max(1, blocks // 2) * self.row
        self._tables: dict[tuple, PlaneTable] = {}     # by (layers, half)

    def span(self, layers: range | None) -> tuple[int, int]:
        return layer_span(layers, self.num_layers, self.row)

    def chunk_blocks(self, layers: range | None) -> int:
        """Blocks a chunk of `layers` of each block (None: all) holds: as many parts as fit in a half."""
        return self.half_bytes // self.span(layers)[1]

    def table(self, layers: range | None, half: int) -> PlaneTable:
        """The planes of half `half` holding `layers` of each block (None: all) packed from its
        start: [rows, len(layers), 2, bs, h, d] in L1's format. The table has every plane of the
        model, so its plane numbers are L1's; a layer outside `layers` is given the first one's
        place, never copied. Built once per (layers, half): building one copies its pointers to
        the device, which waits for the stream it is built on."""
        key = (None if layers is None else (layers.start, layers.stop), half)
        table = self._tables.get(key)
        if table is None:
            group = range(self.num_layers) if layers is None else layers
            elt = self.tensor.element_size()
            per_block = self.span(layers)[1] // elt                   # elements of a block's part
            start = half * self.half_bytes // elt
            rows = self.chunk_blocks(layers)
            packed = self.tensor.view(-1)[start : start + rows * per_block].view(
                rows, len(group), *self.plane_shape)                  # [rows, len(group), 2, bs, h, d]
            table = self._tables[key] = PlaneTable([packed[:, layer - group.start if layer in group else 0, c]
                                                    for layer in range(self.num_layers) for c in (0, 1)])
        return table

    def rows(self, half: int, n: int) -> torch.Tensor:
        """The first n whole rows of half `half` (moves of whole blocks)."""
        first = half * self.half_bytes // self.row
        return self.tensor[first : first + n]

    def copies(self, l2_rows: torch.Tensor, l2_slots: list[int], layers: range | None, to_l2: bool,
               half: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(destination addresses, source addresses, sizes) of the DMAs between half `half`, where
        a chunk's parts lie packed in order, and L2 slots `l2_slots` of `l2_rows` (L2's contiguous
        [N, row] storage): one a run of neighbouring slots where whole blocks move, else one a
        block (a part of its row). Three int64 arrays [copies], which dma.copy_batch hands to the
        runtime as they are: as Python lists (and ctypes arrays of them) a chunk's 256 copies
        cost the host ~0.1 ms, paid for every chunk of every load."""
        offset, width = self.span(layers)
        host, staged = l2_rows.data_ptr() + offset, self.tensor.data_ptr() + half * self.half_bytes
        slots = np.asarray(l2_slots, dtype=np.int64)                     # [n]
        if width == self.row:  # whole rows: one DMA a run
            pos, length = run_starts(slots)
            sizes = length * width                                         # [runs] its bytes
        else:  # parts: one DMA a block
            pos, sizes = np.arange(len(slots)), np.full(len(slots), width, dtype=np.int64)
        on_device, in_l2 = staged + pos * width, host + slots[pos] * self.row
        return (in_l2, on_device, sizes) if to_l2 else (on_device, in_l2, sizes)


def run_starts(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each run of consecutive numbers in `slots` ([n] int64) starts, and its length: two
    [runs] arrays."""
    pos = np.flatnonzero(np.diff(slots, prepend=slots[:1] - 2) != 1)
    return pos, np.diff(pos, append=len(slots))


def runs(slots: list[int]):
    """Split `slots` into runs of consecutive numbers: (position in slots, first slot, length) of each."""
    s = np.asarray(slots, dtype=np.int64)
    pos, length = run_starts(s)
    return zip(pos.tolist(), s[pos].tolist(), length.tolist())
