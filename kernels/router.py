"""Triton moe_topk: a MoE router's logits -> each token's k experts and their weights, in one launch.

One program per token holds its row of logits (E values) in registers and does what the torch
reference (reference.moe_topk) does in three to six launches: the softmax, k rounds of "take the
largest, knock it out" (k is small: 4 to 8), the renormalisation or the softmax over the k, and the
cast. No host sync, fixed-size outputs: a decode step captures it in a CUDA graph.
Ties: of equal values the lower expert id is taken first (torch.topk leaves the order of ties
unspecified; random logits in fp32 have none). This file never reads tensor contents on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._launch import check_triton_device

_ROUTERS = {"softmax": 0, "topk_softmax": 1}


@triton.jit
def _topk_kernel(Logits, Ids, Weights, experts, stride_t, K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                 RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    # program t: token t's row of logits [E] -> Ids[t, :K] (int64), Weights[t, :K] (Weights' dtype)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < experts
    v = tl.load(Logits + t * stride_t + offs, mask=ok, other=float("-inf")).to(tl.float32)    # [BLOCK_E]
    if SOFTMAX_FIRST:   # Qwen3: softmax over all experts in fp32, then the top k of the probabilities
        e = tl.where(ok, tl.exp(v - tl.max(v, axis=0)), 0.0)
        v = tl.where(ok, e / tl.sum(e, axis=0), float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    top = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(v, axis=0)
        # the lowest id holding the largest value (a NaN row would match none: clamp into [0, E))
        idx = tl.minimum(tl.min(tl.where(v == best, offs, BLOCK_E), axis=0), experts - 1)
        top = tl.where(slots == j, best, top)
        ids = tl.where(slots == j, idx, ids)
        v = tl.where(offs == idx, float("-inf"), v)
    used = slots < K
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            top = top / tl.sum(tl.where(used, top, 0.0), axis=0)
    else:               # gpt-oss: the top k logits, then a softmax over those k
        e = tl.where(used, tl.exp(top - tl.max(tl.where(used, top, float("-inf")), axis=0)), 0.0)
        top = e / tl.sum(e, axis=0)
    tl.store(Ids + t * K + slots, ids.to(tl.int64), mask=used)
    tl.store(Weights + t * K + slots, top.to(Weights.dtype.element_ty), mask=used)


def moe_topk(logits: torch.Tensor, k: int, router: str = "softmax", renormalize: bool = False):
    """See reference.moe_topk: logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] in logits' dtype)."""
    tokens, experts = _checks.check_moe_topk(logits, k, router)
    check_triton_device(logits)
    ids = torch.empty((tokens, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((tokens, k), dtype=logits.dtype, device=logits.device)
    if tokens == 0:
        return ids, weights
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    block_e = triton.next_power_of_2(experts)
    _topk_kernel[(tokens,)](logits, ids, weights, experts, logits.stride(0), K=k,
                            SOFTMAX_FIRST=_ROUTERS[router] == 0, RENORMALIZE=bool(renormalize), BLOCK_E=block_e,
                            BLOCK_K=triton.next_power_of_2(k), num_warps=1 if block_e <= 256 else 4)
    return ids, weights
