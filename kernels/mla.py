"""Triton decode for multi-head latent attention (DeepSeek-V2/V3): absorbed queries over the latent cache.

Each token's latent, cat(c_kv [L], k_pe [R]), sits in a one-head pool split over the two planes
(K plane = latent[:D], V plane = latent[D:], 2 * D = L + R). A program owns one (sequence, group of
query heads, split) and reads each latent tile ONCE for all its heads: the scores are
q_latent . c_kv + q_pe . k_pe and the output, still in latent space, is p @ c_kv. A program takes
up to 64 query heads, so each latent is read once (DeepSeek-V2-Lite's 16 heads; V3's 128 at tensor
parallel 2 or more) or twice (V3's 128 on one GPU). Long sequences are split over programs
(flash-decoding) and merged by a second kernel. This file never reads a block-table entry past a
sequence's length and never syncs the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._launch import check_triton_device, dot_precision, pow2, sm_count, split_partials

_LOG2E = 1.4426950408889634
MAX_HEADS_PER_PROGRAM = 64  # an fp32 [64, 512] accumulator is as much as a program's registers hold
MAX_SPLITS = 256


@triton.jit(do_not_specialize=["stride_btb", "num_splits", "stride_pb", "stride_ph", "stride_lb", "stride_lh"])
def _mla_decode_kernel(
    QL, QP, KV, BT, SL, Out, Part, Lse,
    stride_qlb, stride_qlh, stride_qpb, stride_qph,
    stride_kvb, stride_kvs, stride_kvt,
    stride_btb, stride_btn,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    qk_scale, num_splits,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, LAT: tl.constexpr, BLOCK_L: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr, VEC: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    hg = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SL + b)
    # each sequence divides its own length into the splits, whole tiles each
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(seq_len, lo + per_split)

    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)                 # [BLOCK_H] query heads
    offs_l = tl.arange(0, BLOCK_L)                                # [BLOCK_L] c_kv features
    offs_r = tl.arange(0, BLOCK_R)                                # [BLOCK_R] rope features
    h_mask = offs_h < HEADS
    l_mask = offs_l < LAT
    r_mask = offs_r < ROPE
    ql = tl.load(QL + b.to(tl.int64) * stride_qlb + offs_h[:, None] * stride_qlh + offs_l[None, :],
                 mask=h_mask[:, None] & l_mask[None, :], other=0.0)      # [BLOCK_H, BLOCK_L]
    qp = tl.load(QP + b.to(tl.int64) * stride_qpb + offs_h[:, None] * stride_qph + offs_r[None, :],
                 mask=h_mask[:, None] & r_mask[None, :], other=0.0)      # [BLOCK_H, BLOCK_R]
    # where each latent feature lives in a token's row: c_kv[c] in the K plane for c < HALF, else in
    # the V plane at c - HALF; k_pe right after c_kv, in the V plane. Runs of VEC features are contiguous.
    c_off = tl.where(offs_l < HALF, offs_l, stride_kvs + offs_l - HALF)
    c_off = tl.max_contiguous(tl.multiple_of(c_off, VEC), VEC)
    pe_off = stride_kvs + (LAT - HALF) + offs_r

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)                    # [BLOCK_N] token positions
        n_mask = offs_n < hi
        # block-table entries are read only for positions < seq_len
        blk = tl.load(bt_row + (offs_n // PAGE) * stride_btn, mask=n_mask, other=0).to(tl.int64)
        row = blk * stride_kvb + (offs_n % PAGE) * stride_kvt    # [BLOCK_N]
        c = tl.load(KV + row[:, None] + c_off[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0)
        pe = tl.load(KV + row[:, None] + pe_off[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        qk = tl.dot(ql, tl.trans(c), input_precision=DOT_PREC)                 # [BLOCK_H, BLOCK_N]
        qk = tl.dot(qp, tl.trans(pe), qk, input_precision=DOT_PREC) * qk_scale  # log2 units
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PREC)   # [BLOCK_H, BLOCK_L]
        m_i = m_new

    out_mask = h_mask[:, None] & l_mask[None, :]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if DIRECT:
        # one split: normalise here; an empty sequence gives zeros, as the reference does
        o_ptr = Out + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_l[None, :]
        tl.store(o_ptr, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=out_mask)
    else:
        # normalised partial output and its log2-sum-exp; an empty split (a short sequence in a wide
        # table) writes only its lse = -inf, and the merge reads no partial of it
        base = b.to(tl.int64) * stride_pb + offs_h * stride_ph + split * stride_ps     # [BLOCK_H]
        tl.store(Part + base[:, None] + offs_l[None, :], acc / l_safe[:, None],
                 mask=out_mask & (l_i > 0)[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + b.to(tl.int64) * stride_lb + offs_h * stride_lh + split, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph", "stride_lb", "stride_lh"])
def _mla_merge_kernel(
    Part, Lse, Out,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits,
    LAT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # one (sequence, head): the splits' outputs weighed by their lse, BLOCK_S splits at a time with a
    # running max, so that hundreds of splits of a 512-wide latent never sit in registers at once
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < LAT
    # the running max and total are kept per feature (all equal): loop-carried tensors of one shape
    m = tl.full([BLOCK_L], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_L], tl.float32)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        offs_s = first + tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_splits
        lse = tl.load(Lse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))                       # [BLOCK_L]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # all empty so far: weights 0
        w = tl.exp2(lse[:, None] - m_safe[None, :])                 # [BLOCK_S, BLOCK_L]
        rescale = tl.exp2(m - m_safe)                               # [BLOCK_L]
        seen = s_mask & (lse > float("-inf"))                       # splits that saw a key
        part = tl.load(Part + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_l[None, :],
                       mask=seen[:, None] & l_mask[None, :], other=0.0)            # [BLOCK_S, BLOCK_L]
        acc = acc * rescale + tl.sum(part * w, 0)
        total = total * rescale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_l, out.to(Out.dtype.element_ty), mask=l_mask)


def choose_launch(batch: int, heads: int, max_tokens: int, device: torch.device) -> tuple[int, int, int]:
    """(heads per program, splits per sequence, tokens per tile) of an mla_decode launch.

    The whole decode reads the latents once per head group, so the grid has batch x head groups x
    splits programs: about two programs per SM are enough to keep HBM busy (as for paged_decode),
    so a small batch splits each sequence, at least 256 tokens a split: each split writes (and the
    merge reads) an fp32 partial of heads x kv_lora_rank, 32 KB at 16 heads and 512, against the
    295 KB of latents it read, so finer splits would spend more on the merge than they gain.
    Not yet tuned on the H200: bench_mla_decode.py --sweep times the choices around this one.
    """
    block_h = min(pow2(heads, 16), MAX_HEADS_PER_PROGRAM)
    programs = batch * triton.cdiv(heads, block_h)
    slots = 2 * sm_count(device)
    splits = 1 if programs >= slots else max(1, min(slots // programs, triton.cdiv(max_tokens, 256), MAX_SPLITS))
    return block_h, splits, 32


def _mla_decode(q_latent, q_pe, kv, block_tables, seq_lens, scale, *,
                num_splits=None, block_n=None, num_warps=None, num_stages=None):
    """mla_decode with its launch choices exposed (tests and benchmarks sweep them)."""
    heads, lat, rope = _checks.check_mla_decode(q_latent, q_pe, kv, block_tables, seq_lens)
    check_triton_device(q_latent, q_pe, kv, block_tables, seq_lens)
    if kv.stride(-1) != 1 or q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise _checks.ShapeError("mla_decode needs the last dim of kv, q_latent and q_pe contiguous")
    batch, page, half = q_latent.shape[0], kv.shape[2], kv.shape[4]
    if batch > 65535:
        raise _checks.ShapeError(f"mla_decode takes at most 65535 sequences per call, got {batch}; split the batch")
    out = torch.empty_like(q_latent)
    if batch == 0:
        return out
    block_h, auto_splits, auto_block_n = choose_launch(batch, heads, block_tables.shape[1] * page, q_latent.device)
    block_n = block_n or auto_block_n
    splits = max(1, min(num_splits or auto_splits, triton.cdiv(max(block_tables.shape[1] * page, 1), block_n)))
    direct = splits == 1
    part, lse, part_strides, lse_strides = split_partials(out, batch, heads, splits, lat)
    # features contiguous in runs of VEC: both planes' pieces start on a multiple of it
    vec = next(v for v in (8, 4, 2, 1) if half % v == 0 and kv.stride(1) % v == 0 and kv.stride(2) % v == 0)
    block_l = pow2(lat, 16)
    _mla_decode_kernel[(triton.cdiv(heads, block_h), splits, batch)](
        q_latent, q_pe, kv, block_tables, seq_lens, out, part, lse,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2),
        *block_tables.stride(), out.stride(0), out.stride(1),
        *part_strides, *lse_strides,
        scale * _LOG2E, splits,
        HEADS=heads, BLOCK_H=block_h, LAT=lat, BLOCK_L=block_l, ROPE=rope, BLOCK_R=pow2(rope, 16),
        HALF=half, VEC=vec, PAGE=page, BLOCK_N=block_n, DIRECT=direct, DOT_PREC=dot_precision(q_latent.dtype),
        num_warps=num_warps or (8 if block_h * block_l >= 8192 else 4), num_stages=num_stages or 2,
    )
    if not direct:
        _mla_merge_kernel[(batch, heads)](
            part, lse, out, *part_strides, *lse_strides, out.stride(0), out.stride(1), splits,
            LAT=lat, BLOCK_L=block_l, BLOCK_S=min(pow2(splits), 16), num_warps=4,
        )
    return out


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q_latent [B, H, L], q_pe [B, H, R] over the latent pool kv [num_blocks, 2, bs, 1, (L + R) / 2];
    returns [B, H, L]. See reference.mla_decode. seq_lens[b] must not exceed the block table's tokens
    (not checked: that would read seq_lens on the host)."""
    return _mla_decode(q_latent, q_pe, kv, block_tables, seq_lens, scale)
