"""Triton copy_planes: blocks between any two PlaneTables (paged KV of any layout, GPU or pinned host).

A work item is one tile (up to 32 KiB) of one block of one plane: the block's bs*H rows of D
elements, addressed from the plane's base pointer (read from the table's pointer array, so planes
may be separate allocations) plus slot * block stride. Elements move as integers of their size,
so bf16 and fp8 copy bit for bit. A side whose blocks are dense is addressed as one run; when
both are, the tile is a flat range. Pinned host planes are read or written by the GPU directly
over PCIe (no copy engine). Each program takes every G-th item of G programs: a copy within the
GPU launches one program per item, one over PCIe only HOST_PROGRAMS_PER_SM of the SMs' worth,
because PCIe, not the SMs, sets its pace, and a grid of one program per item fills every SM
with programs waiting on PCIe while the compute stream's kernels queue behind them (H200,
bench_rounds at b964e45: decode steps beside a load took 22 ms against 6.6 ms alone). This file
moves bytes only; it must never decide which blocks move.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks, reference
from ._launch import INTERPRETING, pow2, sm_count
from .planes import PlaneTable

_TILE_BYTES = 32 << 10  # per item: enough loads in flight per SM to fill PCIe and HBM
# Programs of a copy that crosses PCIe, per SM: a quarter of the SMs, each with one 32 KiB tile in
# flight, holds ~1 MiB in flight, several times PCIe's bandwidth x latency (~55 GB/s x ~2 us).
HOST_PROGRAMS_PER_SM = 0.25
_TL_WORDS = {torch.int8: tl.int8, torch.int16: tl.int16, torch.int32: tl.int32, torch.int64: tl.int64}


# the item count and the plane range change from call to call: not specialised on, so a copy of
# a new size never compiles another copy of the kernel in the middle of serving
@triton.jit(do_not_specialize=["first_plane", "num_planes", "items"])
def _plane_copy_kernel(
    SrcPtrs, DstPtrs, SrcSlots, DstSlots,
    src_sb, src_st, src_sh, dst_sb, dst_st, dst_sh,   # strides in elements: block, token, head
    first_plane, num_planes, items,
    WORD: tl.constexpr, H: tl.constexpr, D: tl.constexpr, ROWS_ALL: tl.constexpr,
    SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr,
    FLAT: tl.constexpr, SRC_DENSE: tl.constexpr, DST_DENSE: tl.constexpr,
    TILE: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PIECES: tl.constexpr,
):
    # items = slot pairs x planes x PIECES, in that order: programs side by side take neighbours
    for item in tl.range(tl.program_id(0), items, tl.num_programs(0)):
        i = item // (num_planes * PIECES)                          # which slot pair
        p = (item // PIECES) % num_planes + first_plane           # which plane
        _copy_tile(SrcPtrs, DstPtrs, SrcSlots, DstSlots, i, p, item % PIECES,
                   src_sb, src_st, src_sh, dst_sb, dst_st, dst_sh,
                   WORD, H, D, ROWS_ALL, SRC_ALIGN, DST_ALIGN, FLAT, SRC_DENSE, DST_DENSE, TILE, ROWS, BLOCK_D)


@triton.jit
def _copy_tile(
    SrcPtrs, DstPtrs, SrcSlots, DstSlots, i, p, tile,
    src_sb, src_st, src_sh, dst_sb, dst_st, dst_sh,
    WORD: tl.constexpr, H: tl.constexpr, D: tl.constexpr, ROWS_ALL: tl.constexpr,
    SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr,
    FLAT: tl.constexpr, SRC_DENSE: tl.constexpr, DST_DENSE: tl.constexpr,
    TILE: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Tile `tile` of block pair i (SrcSlots[i] -> DstSlots[i]) of plane p."""
    s = tl.load(SrcSlots + i).to(tl.int64)
    d = tl.load(DstSlots + i).to(tl.int64)
    # the plane's base address, with the alignment the table measured: lets loads be 16 bytes wide
    # (the hint goes on the pointer: on the loaded integer the compiler drops it)
    src = tl.multiple_of(tl.load(SrcPtrs + p).to(tl.pointer_type(WORD)), SRC_ALIGN) + s * src_sb
    dst = tl.multiple_of(tl.load(DstPtrs + p).to(tl.pointer_type(WORD)), DST_ALIGN) + d * dst_sb
    if FLAT:
        # both blocks are one run of ROWS_ALL * D elements
        offs = tile * TILE + tl.arange(0, TILE)                          # [TILE]
        if (ROWS_ALL * D) % TILE == 0:
            tl.store(dst + offs, tl.load(src + offs))
        else:
            mask = offs < ROWS_ALL * D
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    else:
        r = tile * ROWS + tl.arange(0, ROWS)                             # [ROWS] row = token * H + head
        cols = tl.arange(0, BLOCK_D)                                     # [BLOCK_D]
        t = (r // H).to(tl.int64)
        h = (r % H).to(tl.int64)
        if SRC_DENSE:
            src_row = r.to(tl.int64) * D
        else:
            src_row = t * src_st + h * src_sh
        if DST_DENSE:
            dst_row = r.to(tl.int64) * D
        else:
            dst_row = t * dst_st + h * dst_sh
        src_at = src + src_row[:, None] + cols[None, :]                 # [ROWS, BLOCK_D]
        dst_at = dst + dst_row[:, None] + cols[None, :]
        if (ROWS_ALL % ROWS == 0) and (D == BLOCK_D):
            tl.store(dst_at, tl.load(src_at))
        else:
            mask = (r < ROWS_ALL)[:, None] & (cols < D)[None, :]
            tl.store(dst_at, tl.load(src_at, mask=mask), mask=mask)


def copy_planes(src: PlaneTable, src_slots: torch.Tensor, dst: PlaneTable, dst_slots: torch.Tensor,
                planes: tuple[int, int] | None = None, programs: int | None = None) -> PlaneTable:
    """dst.planes[p][dst_slots[i]] = src.planes[p][src_slots[i]] for p in [first, end) (default all).

    Both tables' pointers must live on the GPU the copy runs on (pinned host tables are built
    with device="cuda"); a pair this kernel cannot address goes to the reference. `programs`:
    at most this many programs (default: one per item within the GPU, HOST_PROGRAMS_PER_SM of
    the SMs where a side is host memory).
    """
    first, end = _checks.check_copy_planes(src, src_slots, dst, dst_slots, planes)
    if src.device != dst.device or not (INTERPRETING or src.device.type == "cuda"):
        return reference.copy_planes(src, src_slots, dst, dst_slots, planes)
    n = src_slots.shape[0]
    if n == 0 or end == first:
        return dst
    bs, h, d = src.block_shape
    elt = src.element_size
    rows_all = bs * h
    flat = src.dense and dst.dense
    block_d = pow2(d)
    if flat:
        tile = min(pow2(rows_all * d), _TILE_BYTES // elt)
        rows = 1
        pieces = triton.cdiv(rows_all * d, tile)
    else:
        rows = min(pow2(rows_all), max(1, _TILE_BYTES // (block_d * elt)))
        tile = rows * block_d
        pieces = triton.cdiv(rows_all, rows)
    items = n * (end - first) * pieces
    if programs is None and (src.host or dst.host):
        programs = max(1, int(sm_count(src.device) * HOST_PROGRAMS_PER_SM))
    grid = (min(items, programs or items),)
    _plane_copy_kernel[grid](
        src.ptrs, dst.ptrs, src_slots, dst_slots, *src.strides, *dst.strides, first, end - first, items,
        WORD=_TL_WORDS[src.word_dtype], H=h, D=d, ROWS_ALL=rows_all,
        SRC_ALIGN=src.align, DST_ALIGN=dst.align,
        FLAT=flat, SRC_DENSE=src.dense, DST_DENSE=dst.dense,
        TILE=tile, ROWS=rows, BLOCK_D=block_d, PIECES=pieces, num_warps=_warps(tile * elt),
    )
    return dst


def _warps(tile_bytes: int) -> int:
    """8 warps for a full tile (128 bytes a thread), fewer for the small blocks of small models."""
    return max(1, min(8, tile_bytes // 2048))
