"""Triton moe_topk: a MoE router's logits -> each token's k experts and their weights, in one launch.

One program per token holds its row of logits (E values) in registers and does what the torch
reference (reference.moe_topk) does in three to a dozen launches. Qwen3 and gpt-oss (_topk_kernel):
the softmax, k rounds of "take the largest, knock it out" (k is small: 4 to 8), the renormalisation
or the softmax over the k, and the cast. DeepSeek-V3 (_grouped_sigmoid_kernel): the row as [groups,
experts a group]; the sigmoid, + the correction bias, each group's two best, topk_group rounds over
the groups, k rounds over the kept groups' experts, the unbiased scores of those k renormalised and
scaled. Its sigmoid is the one torch's CUDA kernel computes (libdevice's expf, IEEE division), so that
its choice of experts is the reference's to the bit (numpy's exp stands in under the interpreter).
No host sync, fixed-size outputs: a decode step captures it in a CUDA graph.
Ties: of equal values the lower expert id (and group id) is taken first (torch.topk leaves the order
of ties unspecified; random logits in fp32 have none). This file never reads tensor contents on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import _checks
from ._launch import INTERPRETING, check_triton_device

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


@triton.jit
def _grouped_sigmoid_kernel(Logits, Bias, Ids, Weights, groups, per_group, stride_t, scale, K: tl.constexpr,
                            TOPK_GROUP: tl.constexpr, RENORMALIZE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
    # program t: token t's logits as [groups, per_group] (expert g * per_group + j at [g, j]) -> Ids[t, :K],
    # Weights[t, :K]
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_P)
    expert = g[:, None] * per_group + j[None, :]                                     # [BLOCK_G, BLOCK_P]
    ok = (g[:, None] < groups) & (j[None, :] < per_group)
    v = tl.load(Logits + t * stride_t + expert, mask=ok, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:   # CUDA: torch's expf, not tl.exp's ex2.approx (module docstring)
        e = libdevice.exp(-v)
    else:               # the interpreter has no libdevice
        e = tl.exp(-v)
    score = tl.math.div_rn(1.0, 1.0 + e)
    choice = tl.where(ok, score + tl.load(Bias + expert, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    # a group's worth: its two best choice-scores (the best knocked out once: a tie counts twice)
    first = tl.max(choice, axis=1)                                                   # [BLOCK_G]
    at = tl.min(tl.where(choice == first[:, None], j[None, :], BLOCK_P), axis=1)
    second = tl.max(tl.where(j[None, :] == at[:, None], float("-inf"), choice), axis=1)
    worth = tl.where(g < groups, first + second, float("-inf"))
    keep = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(worth, axis=0)
        gi = tl.minimum(tl.min(tl.where(worth == best, g, BLOCK_G), axis=0), groups - 1)
        keep = keep | (g == gi)
        worth = tl.where(g == gi, float("-inf"), worth)
    choice = tl.where(keep[:, None], choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    top = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    last = groups * per_group - 1
    for k in tl.static_range(K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        idx = tl.minimum(tl.min(tl.min(tl.where(choice == best, expert, last + 1), axis=1), axis=0), last)
        # its unbiased score (padding lanes [g, j >= per_group] repeat the next group's ids: masked)
        weight = tl.sum(tl.sum(tl.where((expert == idx) & ok, score, 0.0), axis=1), axis=0)
        top = tl.where(slots == k, weight, top)
        ids = tl.where(slots == k, idx, ids)
        choice = tl.where(expert == idx, float("-inf"), choice)
    used = slots < K
    if RENORMALIZE:
        top = tl.math.div_rn(top, tl.sum(tl.where(used, top, 0.0), axis=0) + 1e-20)
    top = top * scale
    tl.store(Ids + t * K + slots, ids.to(tl.int64), mask=used)
    tl.store(Weights + t * K + slots, top.to(Weights.dtype.element_ty), mask=used)


def moe_topk(logits: torch.Tensor, k: int, router: str = "softmax", renormalize: bool = False,
             correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
             scale: float = 1.0):
    """See reference.moe_topk: logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] in logits' dtype)."""
    tokens, experts = _checks.check_moe_topk(logits, k, router, correction_bias, n_group, topk_group, scale)
    check_triton_device(logits)
    ids = torch.empty((tokens, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((tokens, k), dtype=logits.dtype, device=logits.device)
    if tokens == 0:
        return ids, weights
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    block_e = triton.next_power_of_2(experts)
    warps = 1 if block_e <= 256 else 4
    if router == "grouped_sigmoid":
        per_group = experts // n_group
        _grouped_sigmoid_kernel[(tokens,)](
            logits, correction_bias.contiguous(), ids, weights, n_group, per_group, logits.stride(0), float(scale),
            K=k, TOPK_GROUP=topk_group, RENORMALIZE=bool(renormalize), LIBDEVICE_EXP=not INTERPRETING,
            BLOCK_G=triton.next_power_of_2(n_group), BLOCK_P=triton.next_power_of_2(per_group),
            BLOCK_K=triton.next_power_of_2(k), num_warps=warps)
        return ids, weights
    _topk_kernel[(tokens,)](logits, ids, weights, experts, logits.stride(0), K=k,
                            SOFTMAX_FIRST=_ROUTERS[router] == 0, RENORMALIZE=bool(renormalize), BLOCK_E=block_e,
                            BLOCK_K=triton.next_power_of_2(k), num_warps=warps)
    return ids, weights
