"""Triton paged prefill (extend) attention over a flat varlen batch of new tokens.

New tokens attend causally to themselves and fully to their sequence's cached prefix, all read
from the paged pool through the block table: plain prefill, chunked prefill and prefix-cache hits
are one kernel. Each program owns (query tile of one sequence, query head). This file must never
read a block-table entry past a sequence's length, and never syncs the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._launch import INTERPRETING, check_triton_device, dot_precision, pow2, sm_count

_LOG2E = 1.4426950408889634


@triton.jit
def _tile(KV, bt_row, stride_btn, offs_n, n_mask, head_off, offs_d, d_mask,
          stride_kvb, stride_kvt, stride_kvd, PAGE: tl.constexpr, MASKED: tl.constexpr):
    """Offsets into KV of token positions offs_n [BLOCK_N] x dims (K at +0, V at +stride_kvs)."""
    if MASKED:
        blk = tl.load(bt_row + (offs_n // PAGE) * stride_btn, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + (offs_n // PAGE) * stride_btn).to(tl.int64)
    row = blk * stride_kvb + (offs_n % PAGE) * stride_kvt + head_off
    return row[:, None] + offs_d[None, :] * stride_kvd


# integers that change from step to step are not specialised on (1, multiples of 16):
# each new combination would compile another copy of the kernel in the middle of serving
@triton.jit(do_not_specialize=["stride_btb", "window", "num_seqs"])
def _prefill_kernel(
    Q, KV, BT, CU, SL, TileSeq, TileIdx, Out,
    stride_qt, stride_qh, stride_qd,
    stride_kvb, stride_kvs, stride_kvt, stride_kvh, stride_kvd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    qk_scale, window, num_seqs,
    GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # query head varies fastest: the GROUP heads sharing a kv head run side by side and read the
    # same K/V tiles (hits in L2), rather than each streaming them at different times
    h = tl.program_id(0)
    tile = tl.program_id(1)
    b = tl.load(TileSeq + tile)
    if b >= num_seqs:
        return  # the grid is an upper bound on tiles; spare programs leave at once
    t = tl.load(TileIdx + tile)
    q_start = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - q_start
    seq_len = tl.load(SL + b)
    ctx = seq_len - q_len                                   # position of the first new token

    offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)            # [BLOCK_M] row within the sequence
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_D
    pos = ctx + offs_m                                      # [BLOCK_M] token positions
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)           # [BLOCK_M, BLOCK_D]

    first_pos = ctx + t * BLOCK_M                           # smallest position in this tile
    last_pos = ctx + tl.minimum((t + 1) * BLOCK_M, q_len) - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, first_pos - window + 1)
    # keys in [lo, mid) are visible to every row (causally); [mid, last_pos] need the causal mask
    mid = lo + tl.maximum(0, first_pos - lo) // BLOCK_N * BLOCK_N
    hi = last_pos + 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    head_off = (h // GROUP).to(tl.int64) * stride_kvh
    for phase in tl.static_range(2):
        start_at = lo if phase == 0 else mid
        end_at = mid if phase == 0 else hi
        for start in range(start_at, end_at, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end_at
            if phase == 0:  # whole tiles: unmasked loads
                ptrs = _tile(KV, bt_row, stride_btn, offs_n, n_mask, head_off, offs_d, d_mask,
                             stride_kvb, stride_kvt, stride_kvd, PAGE, False)
                if BLOCK_D == HEAD_D:
                    k = tl.load(KV + ptrs)                                      # [BLOCK_N, BLOCK_D]
                    v = tl.load(KV + stride_kvs + ptrs)
                else:
                    k = tl.load(KV + ptrs, mask=d_mask[None, :], other=0.0)
                    v = tl.load(KV + stride_kvs + ptrs, mask=d_mask[None, :], other=0.0)
            else:
                ptrs = _tile(KV, bt_row, stride_btn, offs_n, n_mask, head_off, offs_d, d_mask,
                             stride_kvb, stride_kvt, stride_kvd, PAGE, True)
                ld_mask = n_mask[:, None] & d_mask[None, :]
                k = tl.load(KV + ptrs, mask=ld_mask, other=0.0)
                v = tl.load(KV + stride_kvs + ptrs, mask=ld_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)            # [BLOCK_M, BLOCK_N]
            # phase 0 tiles are whole and causally visible to every row: no mask (unless a window)
            if phase == 1:
                visible = n_mask[None, :] & (offs_n[None, :] <= pos[:, None])
                if HAS_WINDOW:
                    visible = visible & (offs_n[None, :] > pos[:, None] - window)
                qk = tl.where(visible, qk, float("-inf"))
            elif HAS_WINDOW:
                qk = tl.where(offs_n[None, :] > pos[:, None] - window, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)                   # log2 units
            if HAS_WINDOW:
                # a row may see nothing in a tile yet (m = -inf): subtract 0 so exp2 gives 0, not NaN;
                # without a window every row's first tile holds at least one visible key
                m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_new_safe = m_new
            alpha = tl.exp2(m_i - m_new_safe)
            p = tl.exp2(qk * qk_scale - m_new_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
            m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o_ptr = Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptr, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _tile_map(cu_seqlens_q: torch.Tensor, num_tokens: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sequence, tile within it) of every program, built on the device without a host sync.

    Sequence b needs ceil(q_len_b / block_m) tiles; their sum is at most ceil(T / block_m) + B,
    which sizes the grid. Programs past the real count get sequence index B and return. The map
    is reversed so that late (causally heaviest) tiles start first and light ones fill the tail.
    """
    num_seqs = cu_seqlens_q.shape[0] - 1
    grid = triton.cdiv(num_tokens, block_m) + num_seqs
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)          # [B]
    ends = torch.cumsum((q_lens + block_m - 1) // block_m, 0)                # [B] tiles up to b
    ids = torch.arange(grid, device=cu_seqlens_q.device)
    seq = torch.searchsorted(ends, ids, right=True)                          # [grid] in [0, B]
    starts = torch.cat([ends.new_zeros(1), ends])                            # [B+1]
    idx = ids - starts[seq]
    return seq.flip(0).to(torch.int32), idx.flip(0).to(torch.int32), grid


def _choose_tiles(num_tokens: int, num_seqs: int, num_heads: int, head_dim: int,
                  device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) from shapes only (no host sync).

    Measured on the H200 (bench_kernels --sweep, one 16K sequence, d=128): 256x64 tiles on 8 warps
    ran at 439-445 TFLOP/s, 128x64 on 4 warps at 406-410, 128x64 on 8 warps at 318, 128x128 on
    4 warps at ~200. But at 4K tokens the 256-row tiles gave only 512 programs and 232 TFLOP/s
    where 128-row tiles gave 324. So 256-row tiles need long sequences (>= 1024 new tokens each on
    average) and enough of them to give every SM about 4 programs.
    """
    if head_dim > 128:
        return 64, 32, 4
    big_programs = triton.cdiv(num_tokens, 256) * num_heads   # about; spare programs exit at once
    if num_tokens >= 1024 * num_seqs and big_programs >= 4 * sm_count(device):
        return 256, 64, 8
    return 128, 64, 4


def _paged_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window=None, *,
                   block_m=None, block_n=None, num_warps=None, num_stages=None):
    """paged_prefill with its launch choices exposed (tests and benchmarks sweep them)."""
    hq, hkv, d = _checks.check_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, sliding_window)
    check_triton_device(q, kv, block_tables, cu_seqlens_q, seq_lens)
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if INTERPRETING:
        block_m, block_n = block_m or 16, block_n or 16
    auto_m, auto_n, auto_warps = _choose_tiles(q.shape[0], num_seqs, hq, d, q.device)
    block_m, block_n = block_m or auto_m, block_n or auto_n
    num_warps = num_warps or (auto_warps if block_m == auto_m else 4)
    seq_of_tile, tile_in_seq, grid = _tile_map(cu_seqlens_q, q.shape[0], block_m)
    _prefill_kernel[(hq, grid)](
        q, kv, block_tables, cu_seqlens_q, seq_lens, seq_of_tile, tile_in_seq, out,
        *q.stride(), *kv.stride(), *block_tables.stride(), *out.stride(),
        scale * _LOG2E, sliding_window or 0, num_seqs,
        GROUP=hq // hkv, HEAD_D=d, BLOCK_D=pow2(d, 16), PAGE=kv.shape[2], BLOCK_M=block_m,
        BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None, DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages or 3,
    )
    return out


def paged_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Flat varlen q [T, Hq, D] over the paged kv, causal; see reference.paged_prefill.

    seq_lens[b] must not exceed block_tables.shape[1] * block_size and must be at least that
    sequence's new-token count; neither is checked here, as checking would sync the host.
    """
    return _paged_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window)
