"""Triton paged decode attention: split-KV (flash-decoding) with a log-sum-exp merge.

One query token per sequence reads its K/V through a block table. Each program owns one
(sequence, kv head, split) and loads every K/V tile once for all the query heads of that kv head
(GQA); the programs of a long sequence take its last tiles from each other by ticket (work
stealing), so none is left reading alone. A second small kernel merges the splits. Attention
sinks (gpt-oss), where given, join each head's softmax once: in the kernel when it runs unsplit,
else at the merge. This file must never read a block-table entry past a sequence's length, and
never syncs the host (the split count comes from tensor shapes only).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from . import _checks
from ._launch import (TICKETS, check_triton_device, dependent_launch, dot_precision, pow2, sm_count, split_partials,
                      ticket_counters)
from .merge import add_sink, merge_splits_kernel

_LOG2E = 1.4426950408889634


# Work stealing of long split launches (see the kernel): (the percent of a sequence's tiles read
# in fixed shares, tiles a ticket, the fewest tiles a split for a sequence to steal at all: shorter
# ones split statically, as a ticket costs an atomic's round trip). On by default where a sequence
# as long as the block table would steal: 1x128K 177.5-177.8 -> 176.5-176.7 us, 2x64K 177.1-177.3
# -> 176.5-176.6 (SDPA 175.4 and 174.6; H100, CUDA graphs, sweep_decode_long at 82058ea). Of six
# other (share, chunk) settings and 24-64 splits none was faster by more than 0.6 us at both.
STEAL_LAUNCH = (80, 2, 16)


@triton.jit
def _attend(q, KV, bt_row, head_off, lo, hi, m_i, l_i, acc, qk_scale, offs_d, d_mask,
            stride_kvb, stride_kvs, stride_kvt, stride_kvd, stride_btn,
            PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax of the query heads q [BLOCK_G, BLOCK_D] over positions [lo, hi) of one
    sequence and kv head: the running max m_i, sum l_i [BLOCK_G] and output acc [BLOCK_G, BLOCK_D]
    carried on."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)                     # [BLOCK_N] token positions
        n_mask = offs_n < hi
        # block-table entries are read only for positions < hi <= seq_len
        blk = tl.load(bt_row + (offs_n // PAGE) * stride_btn, mask=n_mask, other=0).to(tl.int64)
        row = blk * stride_kvb + (offs_n % PAGE) * stride_kvt + head_off      # [BLOCK_N]
        ld_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(KV + row[:, None] + offs_d[None, :] * stride_kvd, mask=ld_mask, other=0.0)
        v = tl.load(KV + stride_kvs + row[:, None] + offs_d[None, :] * stride_kvd, mask=ld_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale     # [BLOCK_G, BLOCK_N], log2 units
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


# integers that change from step to step are not specialised on (1, multiples of 16): each new
# combination would compile another copy of the kernel in the middle of serving (the partials'
# strides follow the split count)
@triton.jit(do_not_specialize=["stride_btb", "window", "num_splits", "stride_pb", "stride_ph",
                               "stride_lb", "stride_lh"])
def _decode_split_kernel(
    Q, KV, BT, SL, Sinks, Tickets, Out, Part, Lse,
    stride_qb, stride_qh, stride_qd,
    stride_kvb, stride_kvs, stride_kvt, stride_kvh, stride_kvd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    qk_scale, window, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr, STEAL: tl.constexpr,
    STEAL_PCT: tl.constexpr, STEAL_CHUNK: tl.constexpr, STEAL_MIN: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # the merge may launch now: it waits on the GPU for this kernel's end
    # kv head varies fastest across the grid: the programs running side by side read the
    # neighbouring head slices of the same pages ([bs, Hkv, D] rows), not far-apart sequences
    hkv = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SL + b)
    first = 0
    if HAS_WINDOW:
        # the query sits at seq_len - 1 and sees positions > seq_len - 1 - window
        first = tl.maximum(seq_len - window, 0)
    # Each sequence divides its own range into the splits (whole tiles each), so a short one in
    # a wide block table (a CUDA graph sized for max_model_len) still spreads over all of them.
    tiles = tl.cdiv(seq_len - first, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits) * BLOCK_N
    # Where asked (STEAL), a long sequence's programs read a fixed share each, then steal the rest
    # (STEAL_CHUNK tiles a ticket): programs read at different rates (1x128K, H100: equal static
    # splits ended 142-176 us after the first start, the median 167-170), so the HBM is under-used
    # while the slowest finish. Decided from the sequence's own length: all its programs agree.
    stealing = STEAL and tiles >= STEAL_MIN * num_splits
    if stealing:
        per_split = (tiles * STEAL_PCT // 100) // num_splits * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(seq_len, lo + per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_D
    heads = hkv * GROUP + offs_g                                   # [BLOCK_G] query heads
    q_ptr = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr, mask=g_mask[:, None] & d_mask[None, :], other=0.0)   # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    head_off = hkv.to(tl.int64) * stride_kvh
    m_i, l_i, acc = _attend(q, KV, bt_row, head_off, lo, hi, m_i, l_i, acc, qk_scale, offs_d, d_mask,
                            stride_kvb, stride_kvs, stride_kvt, stride_kvd, stride_btn,
                            PAGE=PAGE, BLOCK_N=BLOCK_N, DOT_PREC=DOT_PREC)
    if stealing:
        # tickets c = 0, 1, ... name the chunks left after the shares; every program ends on one
        # ticket past them, so the one holding the last ticket is the last to touch the counter
        # and zeroes it for the next launch (ordering: none needed, the kernel's end publishes it)
        left = first + num_splits * per_split
        chunks = tl.cdiv(seq_len - left, STEAL_CHUNK * BLOCK_N)
        ticket = Tickets + b * tl.num_programs(0) + hkv
        c = tl.atomic_add(ticket, 1, sem="relaxed")
        while c < chunks:
            start = left + c * (STEAL_CHUNK * BLOCK_N)
            m_i, l_i, acc = _attend(q, KV, bt_row, head_off, start, tl.minimum(seq_len, start + STEAL_CHUNK * BLOCK_N),
                                    m_i, l_i, acc, qk_scale, offs_d, d_mask,
                                    stride_kvb, stride_kvs, stride_kvt, stride_kvd, stride_btn,
                                    PAGE=PAGE, BLOCK_N=BLOCK_N, DOT_PREC=DOT_PREC)
            c = tl.atomic_add(ticket, 1, sem="relaxed")
        if c == chunks + num_splits - 1:
            tl.atomic_xchg(ticket, 0, sem="relaxed")

    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        # one split: normalise here; an empty range (seq_len 0) gives zeros, as the reference does
        if HAS_SINKS:
            l_i = add_sink(l_i, m_i, Sinks, heads, g_mask)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o_ptr = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptr, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=out_mask)
    else:
        # unnormalised partial output and its log2-sum-exp; an empty split has lse = -inf
        base = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps    # [BLOCK_G]
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(Part + base[:, None] + offs_d[None, :], acc / l_safe[:, None], mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


def choose_launch(batch: int, kv_heads: int, max_tokens: int, head_dim: int, device: torch.device) -> tuple[int, int]:
    """(splits per sequence, tokens per tile) for a decode batch, from shapes only (no host sync).

    max_tokens is the block table's width in tokens, an upper bound of every length. Measured on
    the H200 (Llama-8B layer; bench_kernels --sweep, and batch-1 contexts of 128-4096 tokens timed
    in CUDA graphs): reading is fastest when the grid is about two programs per SM in total. With
    more (batch x kv heads) programs than that, one split and 64-token tiles (more programs fit
    an SM). With fewer, each sequence is split, as finely as one 64-token tile a split: the merge
    costs less than a program reading tiles one after another (batch 1, 512 tokens: 4.9 us with 8
    splits against 9.2 us unsplit); tiles are 128 tokens once a split reads more than 64. A
    sequence that fits one 128-token tile is not split (4.0 us against 4.8).
    Long contexts (H100): at 1x128K this launch runs at 0.983x the speed of SDPA, its split kernel
    alone at the d2d copy rate (bench_kernels at acbb6f8); none of 50 launches (splits, tiles, warps,
    stages) passes 0.988x, nor do the same K/V with their blocks in order or head-major
    (sweep_decode_long at b439937), and a merge fused into the split kernel (its last program
    merging) was 2-7 us slower than the second kernel. Launching the merge while the split kernel
    runs (`dependent_launch`) takes 1.2 us off (179.2 -> 178.0 us; SDPA 175.6), and the split
    kernel's launch behind the kernel before it another 0.6 us (measured behind the previous call's
    merge, not adopted: in a model that kernel is rope_kv_write; sweep_decode_long at e65b05d).
    Work stealing (STEAL_LAUNCH) takes another 0.7-1.1 us off at 1x128K and 2x64K.
    """
    programs = batch * kv_heads
    slots = 2 * sm_count(device)
    if programs > slots:
        return 1, 32 if head_dim > 128 else 64
    if max_tokens <= 128:
        return 1, 32 if head_dim > 128 else 128
    splits = max(1, min(slots // programs, triton.cdiv(max_tokens, 64), 256))
    if head_dim > 128:
        return splits, 32  # a [128, 256] K tile plus V would not fit shared memory with 3 stages
    return splits, 128 if max_tokens > 64 * splits else 64


def decode_launch(batch: int, kv_heads: int, max_tokens: int, head_dim: int, device: torch.device,
                  num_splits: int | None = None, block_n: int | None = None) -> tuple[int, int]:
    """(splits per sequence, tokens per tile) of a paged_decode launch: choose_launch's, or the
    caller's where given, with no more splits than whole tiles of the longest possible sequence."""
    auto_splits, auto_block_n = choose_launch(batch, kv_heads, max_tokens, head_dim, device)
    block_n = block_n or auto_block_n
    tokens = max(max_tokens, 1)
    splits = max(1, min(num_splits or auto_splits, triton.cdiv(tokens, block_n)))
    # A sequence divides its range into splits of whole tiles (the kernel's per_split), so the
    # longest one may leave the last splits empty (1x128K: 33 asked, but splits of 32 whole tiles
    # cover its 1024 tiles in 32): those would still launch and be merged (1x128K in graphs: 179.3 us
    # with 33, 178.0 with 32, H100).
    per_split = triton.cdiv(triton.cdiv(tokens, splits), block_n) * block_n
    return triton.cdiv(tokens, per_split), block_n


_BOTH_KERNELS = ("split", "merge")


def _paged_decode(q, kv, block_tables, seq_lens, scale, sliding_window=None, sinks=None, *,
                  num_splits=None, block_n=None, num_warps=None, num_stages=None, kernels=_BOTH_KERNELS,
                  pdl=None, steal=None, steal_launch=STEAL_LAUNCH):
    """paged_decode with its launch choices exposed (tests and benchmarks sweep them).

    `pdl`: whether the merge is launched while the split kernel runs (programmatic dependent
    launch; None: where the device has it, `dependent_launch`).
    `steal`: whether a split launch's programs steal the last of a long sequence's tiles from each
    other (its ticket counters: `ticket_counters`), and `steal_launch` how (STEAL_LAUNCH's numbers);
    None: where a sequence as long as the block table would (then each sequence decides for itself).
    `kernels`: which of the two to launch (benchmarks time them apart). Either alone leaves the
    output unwritten where the launch splits: the merge alone reads partials never written."""
    # (checked only when a caller chose: every decode launch passes here, eager ones once a layer)
    if kernels is not _BOTH_KERNELS and (not kernels or not set(kernels) <= set(_BOTH_KERNELS)):
        raise ValueError(f"kernels= takes 'split' and/or 'merge', got {kernels!r}")
    hq, hkv, d = _checks.check_decode(q, kv, block_tables, seq_lens, sliding_window, sinks)
    check_triton_device(q, kv, block_tables, seq_lens)  # sinks: checked to be on q's device
    batch, page = q.shape[0], kv.shape[2]
    group = hq // hkv
    if batch > 65535:
        # the batch is the grid's third dimension, which CUDA caps at 65535
        raise _checks.ShapeError(f"paged_decode takes at most 65535 sequences per call, got {batch}; split the batch")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    splits, block_n = decode_launch(batch, hkv, block_tables.shape[1] * page, d, q.device, num_splits, block_n)
    direct = splits == 1
    pdl = not direct and (dependent_launch(q.device) if pdl is None else pdl)
    # by default, the kernel's own rule (`stealing`) for a sequence filling the table; too many
    # (sequence, kv head) pairs for the counters then split statically, and only an explicit ask fails
    wanted = triton.cdiv(block_tables.shape[1] * page, block_n) >= steal_launch[2] * splits if steal is None else steal
    tickets = ticket_counters(q.device, batch * hkv) if wanted and not direct else None
    if steal and tickets is None:
        raise ValueError(f"steal=True needs a split launch of at most {TICKETS} (sequence, kv head) pairs")
    part, lse, part_strides, lse_strides = split_partials(out, batch, hq, splits, d)
    block_d = pow2(d, 16)
    has_sinks = sinks is not None
    sinks = sinks if has_sinks else seq_lens  # an unused placeholder pointer
    if "split" in kernels:
        _decode_split_kernel[(hkv, splits, batch)](
            q, kv, block_tables, seq_lens, sinks, seq_lens if tickets is None else tickets, out, part, lse,
            *q.stride(), *kv.stride(), *block_tables.stride(), *out.stride(),
            *part_strides, *lse_strides,
            scale * _LOG2E, sliding_window or 0, splits,
            GROUP=group, BLOCK_G=pow2(group, 16), HEAD_D=d, BLOCK_D=block_d, PAGE=page, BLOCK_N=block_n,
            HAS_WINDOW=sliding_window is not None, DIRECT=direct, HAS_SINKS=has_sinks,
            DOT_PREC=dot_precision(q.dtype), PDL=pdl, STEAL=tickets is not None,
            STEAL_PCT=steal_launch[0], STEAL_CHUNK=steal_launch[1], STEAL_MIN=steal_launch[2],
            num_warps=num_warps or 4, num_stages=num_stages or 3,
        )
    if not direct and "merge" in kernels:
        merge_splits_kernel[(batch, hq)](
            part, lse, out, sinks, *part_strides, *lse_strides, *out.stride(), splits,
            HEAD_D=d, BLOCK_D=block_d, BLOCK_S=pow2(splits), HAS_SINKS=has_sinks, PDL=pdl, launch_pdl=pdl,
            num_warps=4,
        )
    return out


def paged_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] attends to its sequence in kv [num_blocks, 2, bs, Hkv, D]; see reference.paged_decode.

    seq_lens[b] must not exceed block_tables.shape[1] * block_size; that is not checked here, as
    checking would read seq_lens on the host (a sync per layer). A long split launch counts tickets
    in memory kept per stream (`ticket_counters`): two CUDA graphs captured on one stream must not
    replay at the same time on different streams.
    """
    return _paged_decode(q, kv, block_tables, seq_lens, scale, sliding_window, sinks)
