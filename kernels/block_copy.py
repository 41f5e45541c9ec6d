"""Triton block copies between the layer-first L1 pool, block-first staging storage and L2.

gather: pool [layers, slots, 2, bs, h, d] -> staged [n, layers, 2, bs, h, d]; scatter: the inverse.
copy_blocks: dst[dst_slots[i]] = src[src_slots[i]] for one-layer block views (streamed attention).
One program copies a piece of one (block, layer) chunk of 2*bs*h*d contiguous elements. The host
side may be pinned memory (the GPU then reads or writes it over PCIe, no copy engine). This
file moves bytes only; it must never decide which blocks move (transfer.py, streaming.py do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks, reference
from ._launch import INTERPRETING

_CHUNK_PIECE = 4096  # elements per program: 8 KiB of bf16, enough to keep loads in flight


@triton.jit
def _block_copy_kernel(
    Pool, Staged, Slots,
    stride_pl, stride_ps, stride_sn, stride_sl,
    chunk, GATHER: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)      # which block of the list
    layer = tl.program_id(1).to(tl.int64)
    piece = tl.program_id(2)
    slot = tl.load(Slots + i).to(tl.int64)
    offs = piece * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk
    pool_ptr = Pool + layer * stride_pl + slot * stride_ps + offs
    staged_ptr = Staged + i * stride_sn + layer * stride_sl + offs
    if GATHER:
        tl.store(staged_ptr, tl.load(pool_ptr, mask=mask), mask=mask)
    else:
        tl.store(pool_ptr, tl.load(staged_ptr, mask=mask), mask=mask)


def _inner_contiguous(t: torch.Tensor, from_dim: int) -> bool:
    """True when dims from_dim.. of t are laid out densely, row-major (one flat chunk)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[from_dim:]), reversed(t.stride()[from_dim:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _usable(pool: torch.Tensor, staged: torch.Tensor) -> bool:
    if INTERPRETING:
        return _inner_contiguous(pool, 2) and _inner_contiguous(staged, 2)
    if not pool.is_cuda:
        return False
    if not (staged.is_cuda or staged.is_pinned()):
        return False  # pageable host memory is not addressable from the GPU
    return _inner_contiguous(pool, 2) and _inner_contiguous(staged, 2)


def _launch(pool: torch.Tensor, staged: torch.Tensor, slots: torch.Tensor, gather: bool) -> None:
    n, layers = staged.shape[0], staged.shape[1]
    if n == 0 or layers == 0:
        return
    chunk = pool[0, 0].numel()
    grid = (n, layers, triton.cdiv(chunk, _CHUNK_PIECE))
    _block_copy_kernel[grid](
        pool, staged, slots, pool.stride(0), pool.stride(1), staged.stride(0), staged.stride(1),
        chunk, GATHER=gather, BLOCK=_CHUNK_PIECE, num_warps=8,
    )


def gather_blocks(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """pool [layers, slots, 2, bs, h, d] -> out [n, layers, 2, bs, h, d] (out may be pinned host)."""
    _checks.check_blocks(pool, slots, out, "out")
    if not _usable(pool, out):
        return reference.gather_blocks(pool, slots, out)  # layouts this kernel does not cover
    _launch(pool, out, slots, gather=True)
    return out


def scatter_blocks(src: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """src [n, layers, 2, bs, h, d] (device or pinned host) -> pool slots, in place."""
    _checks.check_blocks(pool, slots, src, "src")
    if not _usable(pool, src):
        return reference.scatter_blocks(src, pool, slots)
    _launch(pool, src, slots, gather=False)
    return pool


@triton.jit
def _indexed_copy_kernel(Src, Dst, SrcIdx, DstIdx, stride_s, stride_d, chunk, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    piece = tl.program_id(1)
    src = tl.load(SrcIdx + i).to(tl.int64)
    dst = tl.load(DstIdx + i).to(tl.int64)
    offs = piece * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk
    tl.store(Dst + dst * stride_d + offs, tl.load(Src + src * stride_s + offs, mask=mask), mask=mask)


def copy_blocks(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor) -> torch.Tensor:
    """dst[dst_slots[i]] = src[src_slots[i]]: src [N, ...] and dst [M, ...] with one dense block each.

    Typical use: one layer of L2, `l2.kv[:, layer]` [N, 2, bs, h, d] (pinned host, rows strided
    by the layer count), into a device staging buffer, read by the GPU over PCIe.
    """
    _checks.check_copy_blocks(src, src_slots, dst, dst_slots)
    usable = _inner_contiguous(src, 1) and _inner_contiguous(dst, 1) and (
        INTERPRETING or (dst.is_cuda and (src.is_cuda or src.is_pinned()))
    )
    if not usable:
        return reference.copy_blocks(src, src_slots, dst, dst_slots)
    n = src_slots.shape[0]
    if n == 0:
        return dst
    chunk = src[0].numel()
    grid = (n, triton.cdiv(chunk, _CHUNK_PIECE))
    _indexed_copy_kernel[grid](
        src, dst, src_slots, dst_slots, src.stride(0), dst.stride(0), chunk, BLOCK=_CHUNK_PIECE, num_warps=8
    )
    return dst
