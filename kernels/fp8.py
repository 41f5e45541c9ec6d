"""Triton fp8 KV (de)quantisation, fused with the L1 pool gather/scatter: one kernel per move.

gather_quantize_fp8:    pool [layers, slots, 2, bs, h, d] at `slots` -> q [n, layers, 2, bs, h, d] fp8
                        and scales [n, layers, 2, h] fp32 (the L1 -> L2 direction)
dequantize_scatter_fp8: the inverse, into pool slots (L2 -> L1)
quantize_fp8 / dequantize_fp8: the same kernel on block-first blocks [n, layers, 2, bs, h, d] or
                        one layer's [n, 2, bs, h, d] (what attention streams from L2)
One program owns one (block, layer, K/V, head): its bs x d values and their one scale. The math
is reference.quantize_fp8's bit for bit (IEEE division, round to nearest even), so bytes written
here and by the reference are interchangeable. This file moves and converts values only; it must
never decide which blocks move (transfer.py does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks, reference
from ._launch import INTERPRETING, pow2
from .block_copy import _inner_contiguous

FP8_MAX = tl.constexpr(reference.FP8_MAX)  # a kernel may only read globals that are constexpr


@triton.jit
def _round_e4m3(y):
    """fp32 y, |y| <= 448, rounded to the nearest float8_e4m3fn value (ties to even), as fp32.

    The cast that follows is then exact: the GPU's and the interpreter's fp32 -> fp8 casts agree
    (the interpreter's own rounding does not carry into the exponent: 127.5 -> 64). Works on the
    bits: e4m3 keeps 3 mantissa bits down to 2^-6 (fp32 exponent field 121), below that a fixed
    grid of 2^-9 (its subnormals), so `drop` low bits of the fp32 pattern are rounded away.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & -2147483648                       # 0x80000000: -0.0 and tiny negatives keep it
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    drop = tl.minimum(20 + tl.maximum(121 - exp, 0), 23)
    half = (1 << drop) >> 1
    lsb = ((mag | 0x800000) >> drop) & 1           # the lowest kept bit (the implicit 1 when drop = 23)
    rounded = (mag + half - 1 + lsb) & ~((1 << drop) - 1)
    # below 2^-9 (exponent < 118) the grid has only 0 and 2^-9: 2^-9 above its midpoint 2^-10
    tiny = tl.where(mag > 0x3A800000, 0x3B000000, 0)
    rounded = tl.where(exp >= 118, rounded, tiny)
    return (rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_kernel(
    X, Q, Scales, Slots,
    stride_xn, stride_xl, stride_qn, stride_ql, stride_sn, stride_sl,
    BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr, INDEXED: tl.constexpr,
):
    # X: the values side (pool or blocks), block i of layer l at i * stride_xn + l * stride_xl, then
    # [2, bs, h, d] dense; Q the fp8 side likewise; Scales [.., 2, h] dense after (stride_sn, stride_sl)
    i = tl.program_id(0).to(tl.int64)
    layer = (tl.program_id(1) // 2).to(tl.int64)
    kv = tl.program_id(1) % 2
    head = tl.program_id(2)
    if INDEXED:
        x_block = tl.load(Slots + i).to(tl.int64)  # the pool slot of block i
    else:
        x_block = i
    t = tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (t < BS) & (d < D)
    inner = kv * (BS * H * D) + t * (H * D) + head * D + d        # [BLOCK_T, BLOCK_D] of the head
    x_ptr = X + x_block * stride_xn + layer * stride_xl + inner
    q_ptr = Q + i * stride_qn + layer * stride_ql + inner
    s_ptr = Scales + i * stride_sn + layer * stride_sl + kv * H + head
    if QUANTIZE:
        x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        # div_rn: `/` may lower to an approximate division; the reference divides exactly
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        y = tl.math.div_rn(x, scale)
        # clamp: x / (amax / 448) may round a hair above 448, which e4m3fn cannot hold
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr, _round_e4m3(y).to(Q.dtype.element_ty), mask=mask)
        tl.store(s_ptr, scale)
    else:
        scale = tl.load(s_ptr)
        y = tl.load(q_ptr, mask=mask).to(tl.float32) * scale
        tl.store(x_ptr, y.to(X.dtype.element_ty), mask=mask)


def _usable(values: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the kernel covers these block-first views: [n, layers, 2, bs, h, d] with dense
    [2, bs, h, d] (scales [n, layers, 2, h] with dense [2, h]), on the GPU or interpreted."""
    if values.dim() != 6 or values.shape[2] != 2:
        return False
    if not (_inner_contiguous(values, 2) and _inner_contiguous(q, 2) and _inner_contiguous(scales, 2)):
        return False
    if INTERPRETING:
        return True
    return all(t.is_cuda for t in (values, q, scales))


def _launch(values: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor | None,
            quantize: bool) -> None:
    """values: block-first [n, layers, 2, bs, h, d] (for a pool: its transpose, picked by slots)."""
    n, layers, _, bs, h, d = q.shape
    if n == 0 or layers == 0:
        return
    grid = (n, layers * 2, h)
    _fp8_kernel[grid](
        values, q, scales, slots if slots is not None else q,
        values.stride(0), values.stride(1), q.stride(0), q.stride(1), scales.stride(0), scales.stride(1),
        BS=bs, H=h, D=d, BLOCK_T=pow2(bs), BLOCK_D=pow2(d), QUANTIZE=quantize, INDEXED=slots is not None,
        num_warps=4,
    )


def _as_blocks(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One layer's blocks [n, 2, bs, h, d] (scales [n, 2, h]) as [n, 1, 2, ...]; others as they are."""
    if tensors[0].dim() == 5:
        return tuple(t.unsqueeze(1) for t in tensors)
    return tensors


def quantize_fp8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """x [n, layers, 2, bs, h, d] or [n, 2, bs, h, d] -> q (fp8, same shape; may be a view into
    packed rows) and scales [n, (layers,) 2, h] fp32; other shapes and layouts go to the reference."""
    _checks.check_quantize(x, q, scales, "x", "q")
    blocks = _as_blocks(x, q, scales)
    if not _usable(*blocks):
        return reference.quantize_fp8(x, q, scales)
    _launch(*blocks, None, quantize=True)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The inverse of quantize_fp8: q fp8 with scales -> out in its dtype (same shapes as there)."""
    _checks.check_quantize(out, q, scales, "out", "q")
    blocks = _as_blocks(out, q, scales)
    if not _usable(*blocks):
        return reference.dequantize_fp8(q, scales, out)
    _launch(*blocks, None, quantize=False)


def gather_quantize_fp8(pool: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """pool [layers, N, 2, bs, h, d] blocks `slots` [n] -> q [n, layers, 2, bs, h, d] fp8 and scales
    [n, layers, 2, h]: gather_blocks then quantize_fp8, in one kernel with no staging copy."""
    _checks.check_gather_quantize(pool, slots, q, scales)
    blocks = pool.transpose(0, 1)  # [N, layers, 2, bs, h, d], block i read at slots[i]
    if not _usable(blocks, q, scales):
        return reference.gather_quantize_fp8(pool, slots, q, scales)
    _launch(blocks, q, scales, slots, quantize=True)


def dequantize_scatter_fp8(q: torch.Tensor, scales: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """q [n, layers, 2, bs, h, d] fp8 and scales [n, layers, 2, h] -> pool [layers, N, 2, bs, h, d]
    blocks `slots` in the pool's dtype: dequantize_fp8 then scatter_blocks, in one kernel."""
    _checks.check_gather_quantize(pool, slots, q, scales)
    blocks = pool.transpose(0, 1)
    if not _usable(blocks, q, scales):
        return reference.dequantize_scatter_fp8(q, scales, pool, slots)
    _launch(blocks, q, scales, slots, quantize=False)
