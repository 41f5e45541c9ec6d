"""Prefill attention of ONE long sequence through cuDNN's fused attention (FA3 class on Hopper).

A chunk of n new tokens at positions [ctx, ctx + n) attends causally to itself and fully to its
ctx cached tokens. cuDNN's causal mask is aligned top-left, which is wrong when ctx > 0, so the
chunk is computed as two attentions merged by log-sum-exp:
    self:   the n new queries over the n new keys, causal (top-left and bottom-right agree here);
    prefix: the n new queries over the ctx cached keys, no mask.
Both read K/V gathered from the paged pool into one contiguous [ctx + n, Hkv, D] buffer per layer
(one copy, ~3% of the attention time at 100K tokens on the H200). Measured there (8192 new tokens,
Llama-8B layer, bf16): cuDNN runs 590-660 TFLOP/s where the paged Triton kernel runs 410-445.
Attention sinks (gpt-oss) scale the merged output by the keys' share of the softmax, sigmoid(lse - sink).

cuDNN builds an execution plan for each new shape, 40-70 ms on the H200 (measured there; its
varlen form rebuilds on every call, ~75 ms, so it is not used). To keep the plans few and reused,
the new tokens are padded to a multiple of ALIGN (zero queries and keys after the real ones, which
the causal mask hides from every real query) and only contexts that are multiples of ALIGN come
here: a chunked prefill's contexts are whole multiples of its chunk budget, so a long prompt
reuses the same plans across requests. Other shapes (short chunks, a prefix-cache hit of any
length) stay on prefill.py's Triton kernel. This file never syncs the host (ctx is the caller's
host-side count) and never writes the pool.
"""

from __future__ import annotations

import functools

import torch

MIN_NEW_TOKENS = 2048   # below this a cuDNN plan's build costs more than it saves
ALIGN = 1024            # new tokens are padded to, and contexts must be, multiples of this


@functools.lru_cache(maxsize=None)
def _cudnn_attention_works(device: torch.device) -> bool:
    """cuDNN's fused attention exists in this torch build and on this GPU (sm_80 and later)."""
    if not (torch.backends.cudnn.is_available() and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def applies(q: torch.Tensor, kv: torch.Tensor, num_seqs: int, context: int | None,
            sliding_window: int | None) -> bool:
    """Whether a prefill batch takes this path: one sequence whose cached length the caller knows
    and is a multiple of ALIGN, at least MIN_NEW_TOKENS new tokens, fp16/bf16, no sliding window,
    a head size cuDNN takes."""
    return (context is not None and num_seqs == 1 and context % ALIGN == 0 and q.shape[0] >= MIN_NEW_TOKENS
            and sliding_window is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and kv.dtype == q.dtype and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
            and _cudnn_attention_works(q.device))


def _attend(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """cuDNN attention of q4 [1, Hq, n, D] over k, v [S, Hkv, D] (GQA by head count).
    Returns (out [n, Hq, D], lse [n, Hq, 1] natural log, fp32)."""
    k4, v4 = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)   # [1, Hkv, S, D] views
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q4, k4, v4, None, True, 0.0, causal, False, scale=scale)[:2]
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def prefill_one(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, context: int,
                scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, Hq, D] of one sequence whose K/V (this chunk's included) are in the pool kv
    [num_blocks, 2, bs, Hkv, D] at block_table [>= ceil((context + n) / bs)] -> out [n, Hq, D].
    sinks: None or [Hq] attention-sink logits (any float dtype)."""
    n, page = q.shape[0], kv.shape[2]
    padded = -(-n // ALIGN) * ALIGN
    total = context + n
    blocks = block_table[: -(-total // page)].long()
    # the sequence's keys and values in order, [context + padded, Hkv, D] each: one copy out of the
    # pool, then zeros after the last real token (pool slots past it are not this sequence's)
    rows = max(blocks.shape[0] * page, context + padded)
    k = kv.new_empty(rows, *kv.shape[3:])
    v = kv.new_empty(rows, *kv.shape[3:])
    torch.index_select(kv[:, 0], 0, blocks, out=k[: blocks.shape[0] * page].unflatten(0, (-1, page)))
    torch.index_select(kv[:, 1], 0, blocks, out=v[: blocks.shape[0] * page].unflatten(0, (-1, page)))
    k[total:].zero_()
    v[total:].zero_()
    if padded != n:
        q = torch.cat([q, q.new_zeros(padded - n, *q.shape[1:])])             # [padded, Hq, D]
    q4 = q.transpose(0, 1).unsqueeze(0)                                     # [1, Hq, padded, D] view
    end = context + padded
    out_self, lse_self = _attend(q4, k[context:end], v[context:end], scale, causal=True)
    if context == 0 and sinks is None:
        return out_self[:n].contiguous()
    if context == 0:
        out, lse = out_self[:n].float(), lse_self[:n]
    else:
        out_prefix, lse_prefix = _attend(q4, k[:context], v[:context], scale, causal=False)
        # softmax over both key sets = the parts weighted by their shares of the total exp-sum:
        # the self part's share is sigmoid(lse_self - lse_prefix) (cuDNN's lse is a natural log)
        weight = torch.sigmoid(lse_self[:n] - lse_prefix[:n])               # [n, Hq, 1] fp32
        out = torch.lerp(out_prefix[:n].float(), out_self[:n].float(), weight)
        lse = torch.logaddexp(lse_self[:n], lse_prefix[:n])
    if sinks is not None:
        # the keys' share of a softmax whose sum also holds e^sink
        out = out * torch.sigmoid(lse - sinks.float()[None, :, None])
    return out.to(q.dtype)
