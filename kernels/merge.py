"""The log-sum-exp merge of split-KV attention: rows whose keys were divided among splits.

Decode (one query per sequence) and prefill (short extends over long prefixes) both split a row's
keys among programs; each split writes its normalised partial output [rows, Hq, S, D] and its
log2-sum-exp [rows, Hq, S]. One program per (row, head) weighs the splits and writes the result.
A split that saw no key has lse = -inf and weight 0. Never launched on its own by users. On
Hopper and later it is launched while the split kernel runs (`dependent_launch`), and waits on the
GPU for it: 1.2 us less at 1x128K decode (H100, sweep_decode_long), the launch gap gone.

Attention sinks (gpt-oss: a logit per query head that joins the softmax's denominator and adds
no value) join here once, at the merge, never in a split: a split's partial is normalised over its
own keys only. An unsplit launch joins them with `add_sink` instead.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


LOG2E = tl.constexpr(1.4426950408889634)  # sinks are natural-log logits; the kernels work in log2


@triton.jit
def add_sink(l_i, m_i, Sinks, heads, mask):
    """The exp-sum l_i of rows whose running max is m_i (log2 units), with each row's sink
    Sinks[heads] joined: l_i + exp2(sink - m_i). A row that saw no key (m_i = -inf, l_i = 0)
    stays 0, its output the zeros of an empty attention."""
    sink = tl.load(Sinks + heads, mask=mask, other=0.0).to(tl.float32) * LOG2E
    return l_i + tl.where(m_i == float("-inf"), 0.0, tl.exp2(sink - m_i))


# integers that change from step to step are not specialised on (1, multiples of 16):
# each new combination would compile another copy of the kernel in the middle of serving
@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph", "stride_lb", "stride_lh"])
def merge_splits_kernel(
    Part, Lse, Out, Sinks,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh, stride_od,
    num_splits,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        # launched while the split kernel still runs (programmatic dependent launch): its programs
        # are resident when it ends; wait until then for its partials
        gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32) * LOG2E  # the head's sink, one more term of the sum
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)           # every split empty: weights 0, output 0
    w = tl.exp2(lse - m)                               # [BLOCK_S]
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m)
    w = w / tl.where(total > 0, total, 1.0)
    part = tl.load(
        Part + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_D), other=0.0,
    )                                                  # [BLOCK_S, BLOCK_D]
    out = tl.sum(part * w[:, None], 0)                 # [BLOCK_D]
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_D)
