"""Triton rope_kv_write: RoPE on q and k, and the K/V write into the paged pool, in one launch;
optionally Qwen3 / Gemma 3's per-head RMSNorm of q and k first, in the same launch.

The rotation is the "rotate half" layout of HF checkpoints: out = x * cos + rotate_half(x) * sin
with rotate_half(x) = cat(-x[D/2:], x[:D/2]). Each product is rounded to x's dtype and then the
sum, as torch's elementwise ops in transformers (and reference.rope_kv_write) round, so the
result is bitwise the reference's; fp contraction (FMA) is switched off for that, which costs
nothing in a kernel bound by memory. Rotated k and unrotated v go to the pool slots exactly like
kv_write (-1 skips a token); the rotated q is returned. With q_norm / k_norm, each q and k head is
first RMS-normalised over its D features in norm.py's (HF's) rounding order; only the fp32 sum of
squares (taken in another order than torch's) and, on a GPU, the rsqrt can differ from the
reference, by an fp32 ulp or so, which rarely moves the rounded result: there the output is
bitwise the reference's almost everywhere, not everywhere. QK_NORM is a constexpr, so the plain
kernel compiles as before.
This file must never write a slot other than those in slot_mapping, nor its inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._launch import check_triton_device, pow2


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2):
    # x1, x2 [BLOCK_H, BLOCK_HALF]: the two halves of some heads; c*, s* [BLOCK_HALF] -> the two
    # halves of x * cos + cat(-x2, x1) * sin, each product and each sum rounded to x's dtype
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1[None, :].to(tl.float32)).to(dt)
    b1 = (-(x2.to(tl.float32)) * s1[None, :].to(tl.float32)).to(dt)      # negating is exact
    a2 = (x2.to(tl.float32) * c2[None, :].to(tl.float32)).to(dt)
    b2 = (x1.to(tl.float32) * s2[None, :].to(tl.float32)).to(dt)
    return (a1.to(tl.float32) + b1.to(tl.float32)).to(dt), (a2.to(tl.float32) + b2.to(tl.float32)).to(dt)


@triton.jit
def _head_rms_norm(x1, x2, W, stride_w, offs_d, d_ok, eps, HALF: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    # x1, x2 [BLOCK_H, BLOCK_HALF]: the two halves of some heads -> each head RMS-normalised over
    # its D = 2 * HALF features by weight W [D], rounded as norm.py rounds (padding lanes add 0)
    dt = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(W + offs_d * stride_w, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + (offs_d + HALF) * stride_w, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if UNIT_OFFSET:
        # Gemma: (x * rstd) * (1 + w) all in fp32, rounded once at the end
        return ((a1 * rstd) * (1.0 + w1)).to(dt), ((a2 * rstd) * (1.0 + w2)).to(dt)
    # HF: x * rstd rounded to x's dtype first, then the weight (the fp32 product of two dt values rounds once)
    return (w1 * (a1 * rstd).to(dt).to(tl.float32)).to(dt), (w2 * (a2 * rstd).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _rope_kv_write_kernel(
    Q, K, V, Cos, Sin, KV, Slots, QOut, QW, KW, eps,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ct, stride_cd, stride_st, stride_sd,
    stride_kvb, stride_kvs, stride_kvt, stride_kvh, stride_kvd,
    stride_ot, stride_oh, stride_qw, stride_kw,
    q_heads, kv_heads, q_tiles,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PAGE: tl.constexpr,
    QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    # program (t, tile): tiles [0, q_tiles) rotate BLOCK_H query heads of token t into QOut; the
    # rest rotate BLOCK_H key heads and copy as many value heads into the pool slot of token t.
    # QK_NORM: RMS-normalise each q head by QW, each k head by KW, before rotating
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    # this token's cos/sin, first and second half of D: [BLOCK_HALF] each
    c1 = tl.load(Cos + t * stride_ct + offs_d * stride_cd, mask=d_ok, other=0.0)
    c2 = tl.load(Cos + t * stride_ct + (offs_d + HALF) * stride_cd, mask=d_ok, other=0.0)
    s1 = tl.load(Sin + t * stride_st + offs_d * stride_sd, mask=d_ok, other=0.0)
    s2 = tl.load(Sin + t * stride_st + (offs_d + HALF) * stride_sd, mask=d_ok, other=0.0)
    if tile < q_tiles:
        heads = tile * BLOCK_H + offs_h
        mask = (heads < q_heads)[:, None] & d_ok[None, :]                            # [BLOCK_H, BLOCK_HALF]
        src = Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + HALF * stride_qd, mask=mask, other=0.0)
        if QK_NORM:
            x1, x2 = _head_rms_norm(x1, x2, QW, stride_qw, offs_d, d_ok, eps, HALF, UNIT_OFFSET)
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2)
        dst = QOut + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]    # QOut rows are contiguous
        tl.store(dst, o1, mask=mask)
        tl.store(dst + HALF, o2, mask=mask)
    else:
        slot = tl.load(Slots + t).to(tl.int64)
        if slot >= 0:
            heads = (tile - q_tiles) * BLOCK_H + offs_h
            mask = (heads < kv_heads)[:, None] & d_ok[None, :]
            dst = KV + (slot // PAGE) * stride_kvb + (slot % PAGE) * stride_kvt \
                + heads[:, None] * stride_kvh + offs_d[None, :] * stride_kvd           # K half 1 of the slot
            src = K + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :] * stride_kd
            k1 = tl.load(src, mask=mask, other=0.0)
            k2 = tl.load(src + HALF * stride_kd, mask=mask, other=0.0)
            if QK_NORM:
                k1, k2 = _head_rms_norm(k1, k2, KW, stride_kw, offs_d, d_ok, eps, HALF, UNIT_OFFSET)
            o1, o2 = _rotate(k1, k2, c1, c2, s1, s2)
            tl.store(dst, o1, mask=mask)
            tl.store(dst + HALF * stride_kvd, o2, mask=mask)
            src = V + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :] * stride_vd
            tl.store(dst + stride_kvs, tl.load(src, mask=mask), mask=mask)
            tl.store(dst + stride_kvs + HALF * stride_kvd, tl.load(src + HALF * stride_vd, mask=mask), mask=mask)


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
) -> torch.Tensor:
    """q [T, Hq, D], k, v [T, Hkv, D] (any strides), cos, sin [T, D] in q's dtype.

    Writes rotated k and v into kv [num_blocks, 2, bs, Hkv, D] at slot_mapping [T] (-1 = skip)
    and returns the rotated q, a new contiguous [T, Hq, D] tensor. q_norm, k_norm [D] (both or
    neither): RMS-normalise each q / k head first (eps; unit_offset: Gemma's 1 + weight).
    """
    tokens, q_heads, kv_heads, d = _checks.check_rope_kv_write(
        q, k, v, cos, sin, kv, slot_mapping, q_norm, k_norm, eps)
    qk_norm = q_norm is not None
    check_triton_device(q, k, v, cos, sin, kv, slot_mapping, *((q_norm, k_norm) if qk_norm else ()))
    if not qk_norm:
        q_norm = k_norm = q     # never read: QK_NORM=False compiles the loads out
    q_out = torch.empty((tokens, q_heads, d), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    half = d // 2
    # about 2K elements of q a program: 8 heads of D=128 (Llama/Qwen), never more heads than Hkv
    block_h = max(1, min(pow2(kv_heads), 2048 // pow2(d)))
    q_tiles = triton.cdiv(q_heads, block_h)
    grid = (tokens, q_tiles + triton.cdiv(kv_heads, block_h))
    _rope_kv_write_kernel[grid](
        q, k, v, cos, sin, kv, slot_mapping, q_out, q_norm, k_norm, float(eps),
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(), *kv.stride(),
        q_out.stride(0), q_out.stride(1), q_norm.stride(-1), k_norm.stride(-1),
        q_heads, kv_heads, q_tiles,
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=pow2(half), PAGE=kv.shape[2],
        QK_NORM=qk_norm, UNIT_OFFSET=bool(unit_offset) and qk_norm,
        num_warps=4 if block_h * d >= 1024 else 1,
        enable_fp_fusion=False,  # fp32: x*cos + rot*sin must not become an fma (HF rounds twice)
    )
    return q_out
