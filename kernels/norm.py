"""Triton rms_norm: a decoder's RMSNorm, optionally fused with the residual add before it.

One program normalises one row of H features, accumulating in fp32, and rounds in the order of
transformers' RMSNorm (normalise in fp32, round to x's dtype, multiply by the weight, round), so
only the fp32 sum and rsqrt can differ from the reference, by a few fp32 ulps, which moves the
rounded output by at most 1 ulp of x's dtype and almost never. The outputs are freshly allocated
and nothing is read back to the host (CUDA-graph safe). This file must never write its inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._launch import check_triton_device, pow2


@triton.jit
def _rms_norm_kernel(
    X, R, W, Out, Sum, eps,
    stride_xa, stride_xb, stride_xh,
    stride_ra, stride_rb, stride_rh,
    stride_w, rows_b, H,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    # row (a, b) of x seen as [A, B, H]; Out and Sum are contiguous [A * B, H]
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + a * stride_xa + b * stride_xb + offs * stride_xh, mask=mask, other=0.0)   # [BLOCK]
    row = (a * rows_b + b) * H
    if HAS_RESIDUAL:
        # the residual add of the decoder (`x = x + attn(...)`): in fp32, rounded to x's dtype
        r = tl.load(R + a * stride_ra + b * stride_rb + offs * stride_rh, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Sum + row + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / H + eps)         # padding lanes add 0
    w = tl.load(W + offs * stride_w, mask=mask, other=0.0)
    if UNIT_OFFSET:
        # Gemma: (x * rstd) * (1 + w) all in fp32, rounded once at the end
        out = ((x32 * rstd) * (1.0 + w.to(tl.float32))).to(X.dtype.element_ty)
    else:
        normed = (x32 * rstd).to(X.dtype.element_ty)                  # HF: .to(input_dtype) first
        # weight * normed: both in x's dtype, so the fp32 product is exact and rounds once, as torch's
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(X.dtype.element_ty)
    tl.store(Out + row + offs, out, mask=mask)


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int, int]]:
    """t [..., H] seen as [A, B, H] rows, without a copy where the strides allow one.

    Returns (t, (A, B), (stride_a, stride_b, stride_h)). Up to 3 dims any strides work (q of a
    fused qkv GEMM viewed [T, Hq, D] has rows T apart by the qkv width and heads D apart); more
    leading dims are flattened into A, which copies only if they cannot be merged. B is grid
    axis 1, which CUDA caps at 65535: a larger B is folded into A the same way.
    """
    if t.dim() > 3:
        t = t.flatten(0, t.dim() - 3)
    if t.dim() == 3 and t.shape[1] > 65535:
        t = t.reshape(-1, t.shape[-1])
    if t.dim() == 1:
        return t, (1, 1), (0, 0, t.stride(0))
    if t.dim() == 2:
        return t, (t.shape[0], 1), (t.stride(0), 0, t.stride(1))
    return t, (t.shape[0], t.shape[1]), tuple(t.stride())


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (rows may be strided), weight [H] -> out [..., H] contiguous, x's dtype.

    With residual [..., H] (x's shape and dtype): s = x + residual rounded to x's dtype, and
    returns (rms_norm(s), s), both freshly allocated. unit_offset: Gemma's (1 + weight), in fp32.
    """
    _checks.check_rms_norm(x, weight, eps, residual)
    check_triton_device(x, weight, *(() if residual is None else (residual,)))
    h = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if x.numel() == 0:
        return out if residual is None else (out, total)
    xr, (rows_a, rows_b), xs = _as_rows(x)
    rr, _, rs = _as_rows(residual) if residual is not None else (xr, None, (0, 0, 0))
    block = pow2(h)
    _rms_norm_kernel[(rows_a, rows_b)](
        xr, rr, weight, out, total, float(eps),
        *xs, *rs, weight.stride(0), rows_b, h,
        BLOCK=block, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=bool(unit_offset),
        num_warps=1 if block <= 256 else 4 if block <= 1024 else 8 if block <= 4096 else 16,
    )
    return out if residual is None else (out, total)
