"""Triton top-k / top-p filtering of sampling logits without sorting the vocabulary.

One program owns one row of logits [V]. It bisects for the smallest logit a token may have and
still be kept, for top-k (a count of larger logits) and top-p (the fp32 softmax mass of larger
logits) at once, both searches sharing each pass over the row, then writes the row with every
token below the higher threshold set to -inf. The search runs on the ordered int32 bit pattern of
the fp32 logits and snaps to values present in the row, so it ends on the exact boundary between
two distinct values: ~10-22 passes over a 152K row (+3 for range, softmax sum and output), read
in chunks. Semantics and tie rule are reference.top_k_top_p_filter's; only top-p's sums round
differently (chunked here, a cumsum there), so a token whose mass before it lies within fp32
rounding (~1e-6) of p may fall the other way. This file must never sort, sync the host or
allocate scratch: a fixed grid of B programs, so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._launch import check_triton_device

_LOG2E = tl.constexpr(1.4426950408889634)
_INT32_MAX = tl.constexpr(2**31 - 1)
_INT32_MIN = tl.constexpr(-(2**31))
# logits per chunk: 8 fp32 a thread at 8 warps, with several 16-byte loads in flight per pass
_BLOCK = 2048
_NUM_WARPS = 8


@triton.jit
def _ordered_key(x):
    """fp32 [BLOCK] -> int32 [BLOCK] whose signed order is the float order (-0.0 made +0.0, so
    the two zeros are one value, as they compare equal)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    # negative floats order backwards in their bits: flip all but the sign bit
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _midpoint(lo, hi):
    """floor((lo + hi) / 2) of two int32 scalars without the overflow of lo + hi."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


@triton.jit
def _top_k_top_p_kernel(
    Logits, Out, TopK, TopP, V, stride_lb, stride_ob,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = Logits + row * stride_lb
    dst = Out + row * stride_ob
    offs = tl.arange(0, BLOCK)

    # Pass 1: the row's key range and max. Per-lane accumulators [BLOCK], reduced once at the end,
    # keep cross-warp reductions out of the chunk loop.
    kmin_v = tl.full((BLOCK,), _INT32_MAX, tl.int32)
    kmax_v = tl.full((BLOCK,), _INT32_MIN, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        inside = cols < V
        key = _ordered_key(tl.load(src + cols, mask=inside, other=0.0).to(tl.float32))
        kmin_v = tl.minimum(kmin_v, tl.where(inside, key, _INT32_MAX))
        kmax_v = tl.maximum(kmax_v, tl.where(inside, key, _INT32_MIN))
    kmin = tl.min(kmin_v, 0)
    kmax = tl.max(kmax_v, 0)

    # A search looks for t* = the smallest key t with F(t) < bound, where F(t) is the count (top-k)
    # or softmax mass (top-p) of the tokens with key > t; a token is kept iff its key >= t*.
    # Invariant: t* in (lo, hi], F(lo) >= bound > F(hi). lo = kmin - 1 has every token above it
    # (count V >= k, mass 1 >= p); hi = kmax has none. A row whose filter is off starts done at
    # hi = kmin (keep all).
    lo_k = kmin - 1
    hi_k = kmin
    k = 0
    if HAS_K:
        k = tl.load(TopK + row).to(tl.int64)
        hi_k = tl.where((k >= 1) & (k < V), kmax, kmin)
    lo_p = kmin - 1
    hi_p = kmin
    m = 0.0
    bound = 0.0
    if HAS_P:
        p = tl.load(TopP + row).to(tl.float32)
        hi_p = tl.where(p >= 1.0, kmin, kmax)
        # the row max as a float: the key is its own inverse on the bit pattern
        mbits = tl.where(kmax < 0, kmax ^ 0x7FFFFFFF, kmax)
        m = mbits.to(tl.float32, bitcast=True)  # -inf only if the whole row is: then kmin == kmax
        z_v = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            z_v += tl.exp2((x - m) * _LOG2E)
        # compare unnormalised mass with p * Z rather than dividing every term by Z
        bound = p * tl.sum(z_v, 0)

    # Each pass evaluates F at the midpoint of both live intervals and also finds the nearest
    # keys present on either side of it, so an interval snaps to keys that exist: the search ends
    # once (lo, hi] holds a single key (hi), after at most 32 halvings of the int32 range.
    while (hi_k > lo_k + 1) | (hi_p > lo_p + 1):
        mid_k = _midpoint(lo_k, hi_k)
        mid_p = _midpoint(lo_p, hi_p)
        cnt_v = tl.zeros((BLOCK,), tl.int32)
        up_k_v = tl.full((BLOCK,), _INT32_MAX, tl.int32)
        down_k_v = tl.full((BLOCK,), _INT32_MIN, tl.int32)
        mass_v = tl.zeros((BLOCK,), tl.float32)
        up_p_v = tl.full((BLOCK,), _INT32_MAX, tl.int32)
        down_p_v = tl.full((BLOCK,), _INT32_MIN, tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            inside = cols < V
            x = tl.load(src + cols, mask=inside, other=float("-inf")).to(tl.float32)
            key = _ordered_key(x)
            if HAS_K:
                above = inside & (key > mid_k)
                cnt_v += above.to(tl.int32)
                up_k_v = tl.minimum(up_k_v, tl.where(above, key, _INT32_MAX))
                down_k_v = tl.maximum(down_k_v, tl.where(inside & (key <= mid_k), key, _INT32_MIN))
            if HAS_P:
                above = inside & (key > mid_p)
                mass_v += tl.where(above, tl.exp2((x - m) * _LOG2E), 0.0)
                up_p_v = tl.minimum(up_p_v, tl.where(above, key, _INT32_MAX))
                down_p_v = tl.maximum(down_p_v, tl.where(inside & (key <= mid_p), key, _INT32_MIN))
        if HAS_K:
            live = hi_k > lo_k + 1
            fits = tl.sum(cnt_v, 0).to(tl.int64) < k
            # F(mid) < k: t* <= mid, and the largest key <= mid has the same F. Else t* > mid,
            # and every t in [mid, smallest key > mid) has F(mid).
            hi_k = tl.where(live & fits, tl.max(down_k_v, 0), hi_k)
            lo_k = tl.where(live & ~fits, tl.min(up_k_v, 0) - 1, lo_k)
        if HAS_P:
            live = hi_p > lo_p + 1
            fits = tl.sum(mass_v, 0) < bound
            hi_p = tl.where(live & fits, tl.max(down_p_v, 0), hi_p)
            lo_p = tl.where(live & ~fits, tl.min(up_p_v, 0) - 1, lo_p)

    # Last pass: keep the tokens at or above both thresholds, as they were (dtype, -0.0 and all)
    threshold = tl.maximum(hi_k, hi_p)
    for start in range(0, V, BLOCK):
        cols = start + offs
        inside = cols < V
        x = tl.load(src + cols, mask=inside, other=0.0)
        key = _ordered_key(x.to(tl.float32))
        tl.store(dst + cols, tl.where(key >= threshold, x, float("-inf")).to(x.dtype), mask=inside)


def _top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                        *, block: int = _BLOCK, num_warps: int = _NUM_WARPS) -> torch.Tensor:
    """top_k_top_p_filter with the chunk size and warps exposed (tests pick small chunks)."""
    _checks.check_top_k_top_p(logits, top_k, top_p)
    check_triton_device(*(t for t in (logits, top_k, top_p) if t is not None))
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # rows are read as contiguous chunks
    batch, vocab = logits.shape
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if batch == 0 or vocab == 0:
        return out
    if top_k is None and top_p is None:
        return out.copy_(logits)
    _top_k_top_p_kernel[(batch,)](
        logits, out, top_k if top_k is not None else logits, top_p if top_p is not None else logits,
        vocab, logits.stride(0), out.stride(0),
        HAS_K=top_k is not None, HAS_P=top_p is not None, BLOCK=block, num_warps=num_warps,
    )
    return out


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] -> a new [B, V] with the tokens outside each row's top-k / top-p set to -inf.

    top_k: None or [B] int, k < 1 or >= V keeps all; top_p: None or [B] fp32 in (0, 1], 1 keeps
    all. Same semantics and tie rule as reference.top_k_top_p_filter.
    """
    return _top_k_top_p_filter(logits, top_k, top_p)
