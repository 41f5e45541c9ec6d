"""HeadSplit: a stored block's KV heads spread over tensor-parallel ranks, split and joined as bytes.

Under tensor parallelism each rank's L1 and L2 hold the same blocks, each of its own KV heads
(a share of them, or one head replicated when there are fewer heads than ranks). L3 objects hold
whole-model blocks, byte for byte what a single-GPU cache stores, so one store serves every TP
size. A write joins the ranks' pieces of a block into the whole; a read splits the whole into the
piece each rank holds.

Every stored format lays its bytes out with the KV head as the second-fastest axis of each part:

    KVLayout       one part      [layers * 2 * block_size, kv_heads, head_dim * element_size]
    OffloadLayout  the payload   [layers * 2 * block_size, kv_heads, head_dim] fp8
                   the scales    [layers * 2, kv_heads] fp32, at payload_bytes

so splitting by heads is slicing one axis of each part. Bytes outside the parts (alignment
padding) are zero in a joined block. This file moves bytes only; it never talks to other ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from .layout import KVLayout, OffloadLayout


def head_parts(layout: KVLayout | OffloadLayout) -> list[tuple[int, int, int]]:
    """(byte offset, rows, bytes of one head in a row) of each part of a block of `layout`."""
    kv = layout.kv if isinstance(layout, OffloadLayout) else layout
    rows = kv.num_layers * 2 * kv.block_size
    if isinstance(layout, OffloadLayout):
        return [(0, rows, kv.head_dim * layout.dtype.itemsize), (layout.payload_bytes, kv.num_layers * 2, 4)]
    return [(0, rows, kv.head_dim * kv.element_size)]


def with_heads(layout: KVLayout | OffloadLayout, num_kv_heads: int) -> KVLayout | OffloadLayout:
    """`layout` with `num_kv_heads` KV heads (a rank's share of a whole-model layout)."""
    if isinstance(layout, OffloadLayout):
        return dataclasses.replace(layout, kv=dataclasses.replace(layout.kv, num_kv_heads=num_kv_heads))
    return dataclasses.replace(layout, num_kv_heads=num_kv_heads)


class HeadSplit:
    """Blocks of `whole` (all KV heads) against the pieces ranks hold: rank r holds heads `ranks[r]`
    (equal counts; ranks may repeat a head). Pieces and blocks are uint8 rows [n, bytes_per_block]."""

    def __init__(self, whole: KVLayout | OffloadLayout, ranks: list[slice]) -> None:
        counts = {s.stop - s.start for s in ranks}
        if len(counts) != 1:
            raise ValueError(f"every rank must hold as many KV heads as the others, got {ranks}")
        self.whole, self.ranks = whole, ranks
        self.part = with_heads(whole, counts.pop())
        kv = whole.kv if isinstance(whole, OffloadLayout) else whole
        covered = sorted({h for s in ranks for h in range(s.start, s.stop)})
        if covered != list(range(kv.num_kv_heads)):
            raise ValueError(f"the ranks' KV heads {ranks} do not cover the model's {kv.num_kv_heads}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _views(self, rows: torch.Tensor, layout) -> list[torch.Tensor]:
        """rows [n, bytes] -> each part as [n, rows, heads, unit] uint8 (views, no copy)."""
        heads = (layout.kv if isinstance(layout, OffloadLayout) else layout).num_kv_heads
        n = rows.shape[0]
        return [rows[:, off : off + r * heads * unit].view(n, r, heads, unit) for off, r, unit in head_parts(layout)]

    def split(self, blocks: torch.Tensor, rank: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Whole blocks [n, whole bytes] -> rank `rank`'s piece [n, part bytes]: a new tensor, or
        `out` (contiguous; its bytes outside the parts, alignment padding, are left as they are)."""
        heads = self.ranks[rank]
        piece = torch.zeros((blocks.shape[0], self.part.bytes_per_block), dtype=torch.uint8) if out is None else out
        for dst, src in zip(self._views(piece, self.part), self._views(blocks, self.whole)):
            dst.copy_(src[:, :, heads])
        return piece

    def join(self, pieces: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's pieces [n, part bytes] (rank order) -> whole blocks [n, whole bytes]: a new
        tensor, or `out` (contiguous, its padding zero); a head several ranks hold is taken from the first."""
        if out is None:
            out = torch.zeros((pieces[0].shape[0], self.whole.bytes_per_block), dtype=torch.uint8)
        outs = self._views(out, self.whole)
        taken = -1  # heads below this are in `out` already
        for heads, piece in zip(self.ranks, pieces):
            if heads.start <= taken:
                continue
            for dst, src in zip(outs, self._views(piece, self.part)):
                dst[:, :, heads].copy_(src)
            taken = heads.stop - 1
        return out
