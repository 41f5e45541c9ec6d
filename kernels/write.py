"""Triton kv_write: scatter new tokens' K/V into their pool slots (one launch per layer).

(Named write.py, not kv_write.py: importing a submodule kv_write would shadow the package's
kv_write function.)

Each program copies one token's [Hkv, D] of K and of V. A slot of -1 is skipped (padding tokens).
This file must never read or write a slot other than those in slot_mapping.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._launch import check_triton_device, pow2


@triton.jit
def _kv_write_kernel(
    K, V, KV, Slots,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kvb, stride_kvs, stride_kvt, stride_kvh, stride_kvd,
    HEADS: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HEADS) & (offs_d[None, :] < HEAD_D)
    dst = KV + (slot // PAGE) * stride_kvb + (slot % PAGE) * stride_kvt \
        + offs_h[:, None] * stride_kvh + offs_d[None, :] * stride_kvd           # [BLOCK_H, BLOCK_D]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_kvs, v, mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> kv [num_blocks, 2, bs, Hkv, D] at slot_mapping [T] (-1 = skip), in place."""
    _checks.check_kv_write(k, v, kv, slot_mapping)
    check_triton_device(k, v, kv, slot_mapping)
    tokens, heads, d = k.shape
    if tokens == 0:
        return
    _kv_write_kernel[(tokens,)](
        k, v, kv, slot_mapping,
        *k.stride(), *v.stride(), *kv.stride(),
        HEADS=heads, HEAD_D=d, BLOCK_H=pow2(heads), BLOCK_D=pow2(d),
        PAGE=kv.shape[2], num_warps=4 if heads * d >= 1024 else 1,
    )
