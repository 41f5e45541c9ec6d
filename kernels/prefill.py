"""Triton paged prefill (extend) attention over a flat varlen batch of new tokens.

New tokens attend causally to themselves and fully to their sequence's cached prefix, all read
from the paged pool through the block table: plain prefill, chunked prefill and prefix-cache hits
are one kernel. Each program owns (query tile of one sequence, query heads, split). A short extend
over a long prefix (a cache hit) would give too few programs to fill the GPU, so its tiles pack the
query heads of one kv head into rows (each K/V tile is loaded once for the group), and each
sequence's fully visible keys are divided among splits (flash-decoding); the last split also takes
the causal part, and a second small kernel merges the splits by log-sum-exp. Attention sinks
(gpt-oss), where given, join each head's softmax once: in the kernel when it runs unsplit, else at
the merge. Splits and tiles are chosen from shapes only. This file must never read a block-table
entry past a sequence's length, and never syncs the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from . import _checks, dense
from ._launch import INTERPRETING, check_triton_device, dependent_launch, dot_precision, pow2, sm_count, split_partials
from .merge import add_sink, merge_splits_kernel

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


@triton.jit
def _split_range(lo, mid, split, num_splits, BLOCK_N: tl.constexpr):
    """This split's share [start, end) of the fully visible keys [lo, mid), in whole tiles.

    Each sequence divides its own range, so a short one in a wide block table still spreads over
    all the splits; a split past the end gets an empty range (start >= end).
    """
    per_split = tl.cdiv(tl.cdiv(mid - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    return start, tl.minimum(mid, start + per_split)


# integers that change from step to step are not specialised on (1, multiples of 16):
# each new combination would compile another copy of the kernel in the middle of serving
@triton.jit(do_not_specialize=["stride_btb", "window", "num_seqs", "num_splits", "stride_pt", "stride_ph",
                             "stride_lt", "stride_lh"])
def _prefill_kernel(
    Q, KV, BT, CU, SL, TileSeq, TileIdx, Sinks, Out, Part, Lse,
    stride_qt, stride_qh, stride_qd,
    stride_kvb, stride_kvs, stride_kvt, stride_kvh, stride_kvd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    qk_scale, window, num_seqs, num_splits,
    GROUP: tl.constexpr, PACK: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
    SHORT_M: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # the merge may launch now: it waits on the GPU for this kernel's end
    # heads vary fastest: the programs sharing a kv head (one, when packed) run side by side and
    # read the same K/V tiles (hits in L2), rather than each streaming them at different times
    heads_at = tl.program_id(0) * PACK                      # first query head of this program
    tile = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(TileSeq + tile)
    if b >= num_seqs:
        return  # the grid is an upper bound on tiles; spare programs leave at once
    t = tl.load(TileIdx + tile)
    q_start = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - q_start
    ctx = tl.load(SL + b) - q_len                           # position of the first new token
    bt_row = BT + b.to(tl.int64) * stride_btb
    head_off = (heads_at // GROUP).to(tl.int64) * stride_kvh
    # SHORT_M (0: none): rows of the tile a sequence of few new tokens takes instead of BLOCK_M;
    # tested as a constexpr first, so that a launch without it compiles the BLOCK_M instance alone
    if SHORT_M > 0:
        if q_len * PACK <= SHORT_M:
            # a decode beside a prompt chunk, say: each K/V tile costs it a SHORT_M-row product
            # rather than a BLOCK_M-row one of which it fills a few rows
            _attend_tile(Q, KV, Sinks, Out, Part, Lse, bt_row, head_off, heads_at, t, q_start, q_len, ctx, split,
                         stride_qt, stride_qh, stride_qd, stride_kvs, stride_kvb, stride_kvt, stride_kvd, stride_btn,
                         stride_ot, stride_oh, stride_od, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                         qk_scale, window, num_splits,
                         PACK, HEAD_D, BLOCK_D, PAGE, SHORT_M, BLOCK_N, HAS_WINDOW, DIRECT, HAS_SINKS, DOT_PREC)
        else:
            _attend_tile(Q, KV, Sinks, Out, Part, Lse, bt_row, head_off, heads_at, t, q_start, q_len, ctx, split,
                         stride_qt, stride_qh, stride_qd, stride_kvs, stride_kvb, stride_kvt, stride_kvd, stride_btn,
                         stride_ot, stride_oh, stride_od, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                         qk_scale, window, num_splits,
                         PACK, HEAD_D, BLOCK_D, PAGE, BLOCK_M, BLOCK_N, HAS_WINDOW, DIRECT, HAS_SINKS, DOT_PREC)
    else:
        _attend_tile(Q, KV, Sinks, Out, Part, Lse, bt_row, head_off, heads_at, t, q_start, q_len, ctx, split,
                     stride_qt, stride_qh, stride_qd, stride_kvs, stride_kvb, stride_kvt, stride_kvd, stride_btn,
                     stride_ot, stride_oh, stride_od, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                     qk_scale, window, num_splits,
                     PACK, HEAD_D, BLOCK_D, PAGE, BLOCK_M, BLOCK_N, HAS_WINDOW, DIRECT, HAS_SINKS, DOT_PREC)


@triton.jit
def _attend_tile(
    Q, KV, Sinks, Out, Part, Lse, bt_row, head_off, heads_at, t, q_start, q_len, ctx, split,
    stride_qt, stride_qh, stride_qd, stride_kvs, stride_kvb, stride_kvt, stride_kvd, stride_btn,
    stride_ot, stride_oh, stride_od, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    qk_scale, window, num_splits,
    PACK: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Query tile `t` of one sequence (its new tokens [q_start, q_start + q_len) at positions ctx
    on) against its keys: this split's share of the fully visible ones, and the causal part where
    this is the last split; writes the output (DIRECT) or this split's partial and log-sum-exp."""
    # row r of the tile is (new token r // PACK, query head heads_at + r % PACK); PACK is 1 (one
    # head, a token a row) or the GQA group (short extends: the group shares every K/V tile)
    TOKENS: tl.constexpr = BLOCK_M // PACK                  # new tokens per tile
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = t * TOKENS + offs_r // PACK                    # [BLOCK_M] token within the sequence
    heads = heads_at + offs_r % PACK                        # [BLOCK_M] query head
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = (offs_r < TOKENS * PACK) & (offs_m < q_len)
    d_mask = offs_d < HEAD_D
    pos = ctx + offs_m                                      # [BLOCK_M] token positions
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)           # [BLOCK_M, BLOCK_D]

    first_pos = ctx + t * TOKENS                            # smallest position in this tile
    last_pos = ctx + tl.minimum((t + 1) * TOKENS, q_len) - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, first_pos - window + 1)
    # keys in [lo, mid) are visible to every row (causally); [mid, last_pos] need the causal mask
    mid = lo + tl.maximum(0, first_pos - lo) // BLOCK_N * BLOCK_N
    hi = last_pos + 1
    if DIRECT:
        visible_lo, visible_hi, causal_lo = lo, mid, mid
    else:
        visible_lo, visible_hi = _split_range(lo, mid, split, num_splits, BLOCK_N)
        # the causal part goes to the last split (it holds the shortest share of [lo, mid))
        causal_lo = tl.where(split == num_splits - 1, mid, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for phase in tl.static_range(2):
        start_at = visible_lo if phase == 0 else causal_lo
        end_at = visible_hi if phase == 0 else hi
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
                # without a window every row's first tile holds at least one visible key (phase 0
                # tiles are unmasked, and phase 1 starts at mid <= first_pos)
                m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_new_safe = m_new
            alpha = tl.exp2(m_i - m_new_safe)
            p = tl.exp2(qk * qk_scale - m_new_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
            m_i = m_new

    if DIRECT:
        if HAS_SINKS:  # unsplit: the sink joins here (a split launch joins it at the merge)
            l_i = add_sink(l_i, m_i, Sinks, heads, m_mask)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out_mask = m_mask[:, None] & d_mask[None, :]
    if DIRECT:
        o_ptr = Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptr, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=out_mask)
    else:
        # this split's normalised output and its log2-sum-exp; a split that saw no key has
        # lse = -inf (weight 0 in the merge) and a zero partial
        p_row = q_rows * stride_pt + heads * stride_ph + split * stride_ps         # [BLOCK_M]
        tl.store(Part + p_row[:, None] + offs_d[None, :], acc / l_safe[:, None], mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + q_rows * stride_lt + heads * stride_lh + split, lse, mask=m_mask)


def _tile_map(cu_seqlens_q: torch.Tensor, num_tokens: int,
              tokens_per_tile: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sequence, tile within it) of every program, built on the device without a host sync.

    Sequence b needs ceil(q_len_b / tokens_per_tile) tiles; their sum is at most
    ceil(T / tokens_per_tile) + B, which sizes the grid. Programs past the real count get sequence
    index B and return. The map is reversed so that late (causally heaviest) tiles start first and
    light ones fill the tail.
    """
    num_seqs = cu_seqlens_q.shape[0] - 1
    grid = triton.cdiv(num_tokens, tokens_per_tile) + num_seqs
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)          # [B]
    ends = torch.cumsum((q_lens + tokens_per_tile - 1) // tokens_per_tile, 0)  # [B] tiles up to b
    ids = torch.arange(grid, device=cu_seqlens_q.device)
    seq = torch.searchsorted(ends, ids, right=True)                          # [grid] in [0, B]
    starts = torch.cat([ends.new_zeros(1), ends])                            # [B+1]
    idx = ids - starts[seq]
    return seq.flip(0).to(torch.int32), idx.flip(0).to(torch.int32), grid


# Average new tokens a sequence up to which the GQA group shares 128-row tiles (_choose_tiles);
# longer prefills keep one head a tile, as measured for cold prompts
PACKED_EXTEND_TOKENS = 512


@dataclass(slots=True)
class Launch:
    """How one paged_prefill call runs; every field comes from shapes, never from device data."""
    block_m: int      # rows of a query tile
    block_n: int      # keys of a K/V tile
    num_warps: int
    pack: int         # query heads per program, sharing a kv head: 1, or the GQA group
    num_splits: int   # parts of each sequence's fully visible keys, merged afterwards

    @property
    def tokens_per_tile(self) -> int:
        return self.block_m // self.pack


# Rows of the tile a sequence of few new tokens takes in a packed launch whose tiles are taller
# (the fewest tl.dot takes). In a mixed step, four decodes beside a 140-token chunk over 8K-token
# histories, the chunk's 128-row tiles made each decode's 4 rows (its query heads) cost a full
# tile's products: that step's attention took 203 us a layer, 159 us with the decodes on 16-row
# tiles (H100 at 32de91c, the measure now in bench_mixed_step.py; 4 of its 9 tiles are decodes).
# Unpacked launches (cold prompts: 128- and 256-row tiles of one head) keep the one tile size: with
# the second path compiled in, their Triton prefill of 4K-32K tokens measured 276-456 TFLOP/s
# against 323-462 on another H100 before (eager; not yet A/B'd in one run), and a decode beside
# them is rare (a prompt chunk over a history is packed: PACKED_EXTEND_TOKENS).
SHORT_ROWS = 16


def short_rows(launch: Launch) -> int:
    """The rows a short sequence's tile takes in this launch (0: none fewer than block_m): in a
    packed launch, a sequence whose new tokens times `pack` fit them, where they are fewer than
    block_m."""
    return SHORT_ROWS if 1 < launch.pack <= SHORT_ROWS < launch.block_m else 0


def _choose_tiles(num_tokens: int, num_seqs: int, num_heads: int, group: int, head_dim: int,
                  device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, pack) from shapes only (no host sync).

    Measured on the H200 (bench_kernels --sweep, one 16K sequence, d=128): 256x64 tiles on 8 warps
    ran at 439-445 TFLOP/s, 128x64 on 4 warps at 406-410, 128x64 on 8 warps at 318, 128x128 on
    4 warps at ~200. But at 4K tokens the 256-row tiles gave only 512 programs and 232 TFLOP/s
    where 128-row tiles gave 324. So 256-row tiles need long sequences (>= 1024 new tokens each on
    average) and enough of them to give every SM about 4 programs.
    Short extends (a prefix-cache hit: a few new tokens per sequence) get tiles sized to their
    rows instead of 128 mostly masked ones, with the GQA group packed into the rows when they fit
    in 128, so each K/V tile is loaded once per kv head (as decode does). Keys stay 64 a tile:
    compiled for sm_90, 16x64 tiles spill ~70 bytes a thread where 16x128 spill 1-10 KB. These
    short-extend choices are not yet timed on a GPU (bench_kernels --sweep extend does).
    Extends of up to PACKED_EXTEND_TOKENS a sequence on average (prompt chunks over a cached
    history, mixed with decodes) pack the group into 128-row tiles too: one head a row, the H200
    profile of bench_rounds at b964e45 had mixed steps of two 140-token chunks and three decodes
    over 8K-token histories spend 10-13 ms of their 21-24 ms here, the tiles 128 rows of one head
    each, a decode's tile one row full and a 140-token chunk's second tile 12: ~2.3x the rows
    the tokens need, each K/V tile read once per query head instead of once per kv head.
    That holds from 33 tokens a sequence on (the group of 4 no longer fits 128 rows), not from 65:
    a mixed graph's step of a 140-token chunk beside 1 or 2 decodes, padded to 256 tokens over 4
    sequences (64 a sequence), took 154 us a layer over 8K-token histories and 749-776 us over 32K
    on unpacked 64-row tiles (2 splits), 131 and 367 us on packed 128-row ones with the 4 splits
    this rule gives them (H100, bench_mixed_step.py --sweep at 32de91c).
    """
    per_seq = triton.cdiv(num_tokens, num_seqs)             # average new tokens of a sequence
    if per_seq * group <= 128:
        block_m = pow2(per_seq * group, 16)                 # tl.dot needs at least 16 rows
        return block_m, 32 if head_dim > 128 else 64, 4, group
    if head_dim > 128:
        return min(pow2(per_seq, 16), 64), 32, 4, 1
    if per_seq <= PACKED_EXTEND_TOKENS and group <= 128:
        return 128, 64, 4, group
    big_programs = triton.cdiv(num_tokens, 256) * num_heads   # about; spare programs exit at once
    if num_tokens >= 1024 * num_seqs and big_programs >= 4 * sm_count(device):
        return 256, 64, 8, 1
    return 128, 64, 4, 1


def _choose_splits(programs: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Splits per sequence: about 2 programs per SM in all, and at least 4 K/V tiles per split.

    programs is the unsplit grid; max_context bounds the fully visible keys of a sequence. A grid
    that already fills the GPU (any long prefill) is never split, so it pays no merge.
    """
    slots = 2 * sm_count(device)
    most = max_context // (4 * block_n)
    return max(1, min(slots // max(programs, 1), most, 256))


def choose_launch(num_tokens: int, num_seqs: int, num_heads: int, kv_heads: int, max_tokens: int,
                  head_dim: int, device: torch.device, *, block_m: int | None = None,
                  block_n: int | None = None, pack: bool | None = None, num_splits: int | None = None,
                  num_warps: int | None = None) -> Launch:
    """The launch for T new tokens of B sequences, from shapes only; keywords override a choice.

    max_tokens is the block table's width in tokens, an upper bound of every sequence's length.
    """
    group = num_heads // kv_heads
    auto_m, auto_n, auto_warps, auto_pack = _choose_tiles(num_tokens, num_seqs, num_heads, group,
                                                          head_dim, device)
    bm, bn = block_m or auto_m, block_n or auto_n
    if pack is None:
        heads = auto_pack if auto_pack <= bm else 1         # a forced small tile may not hold the group
    elif pack and group > bm:
        raise ValueError(f"packing a group of {group} query heads needs block_m >= {group}, got {bm}")
    else:
        heads = group if pack else 1
    warps = num_warps or (auto_warps if bm == auto_m else 4)
    # query tiles, about: as if every sequence had new tokens, none of them a partial tile
    tiles = max(num_seqs, triton.cdiv(num_tokens, bm // heads))
    # keys fully visible to an average sequence's new tokens, at most
    max_context = max_tokens - triton.cdiv(num_tokens, num_seqs)
    splits = num_splits or _choose_splits(num_heads // heads * tiles, max_context, bn, device)
    # no more splits than whole tiles of the longest possible sequence (each split gets at least one)
    splits = max(1, min(splits, triton.cdiv(max(max_tokens, 1), bn)))
    return Launch(bm, bn, warps, heads, splits)


@dataclass(slots=True)
class Plan:
    """A batch's launch and tile map: what every layer of one step with the same shapes shares."""
    launch: Launch
    seq_of_tile: torch.Tensor   # [grid] int32, the sequence of each program's tile (B: none)
    tile_in_seq: torch.Tensor   # [grid] int32, which of its sequence's tiles
    grid: int


def _plan(cu_seqlens_q, num_tokens, num_seqs, hq, hkv, max_tokens, d, device, **choices) -> Plan:
    launch = choose_launch(num_tokens, num_seqs, hq, hkv, max_tokens, d, device, **choices)
    return Plan(launch, *_tile_map(cu_seqlens_q, num_tokens, launch.tokens_per_tile))


def _paged_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window=None, sinks=None, *,
                   block_m=None, block_n=None, num_warps=None, num_stages=None, num_splits=None,
                   pack=None, plans: dict | None = None, short: bool = True):
    """paged_prefill with its launch choices exposed (tests and benchmarks sweep them).
    `short`: whether sequences of few new tokens take tiles of fewer rows (`short_rows`)."""
    hq, hkv, d = _checks.check_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, sliding_window, sinks)
    check_triton_device(q, kv, block_tables, cu_seqlens_q, seq_lens)
    out = torch.empty_like(q)
    num_tokens, num_seqs, page = q.shape[0], seq_lens.shape[0], kv.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if INTERPRETING:
        block_m, block_n = block_m or 16, block_n or 16
    shape = (num_tokens, num_seqs, hq, hkv, block_tables.shape[1] * page, d, q.device)
    choices = dict(block_m=block_m, block_n=block_n, pack=pack, num_splits=num_splits, num_warps=num_warps)
    # one plan per shape and batch: the layers of a step share it (the key names the batch's offsets)
    plans = {} if plans is None else plans
    key = (cu_seqlens_q.data_ptr(), *shape, *choices.values())
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _plan(cu_seqlens_q, *shape, **choices)
    launch, seq_of_tile, tile_in_seq, grid = plan.launch, plan.seq_of_tile, plan.tile_in_seq, plan.grid
    direct = launch.num_splits == 1
    part, lse, part_strides, lse_strides = split_partials(out, num_tokens, hq, launch.num_splits, d)
    pdl = not direct and dependent_launch(q.device)  # the merge launched while the splits run
    block_d = pow2(d, 16)
    has_sinks = sinks is not None
    sinks = sinks if has_sinks else seq_lens  # an unused placeholder pointer
    _prefill_kernel[(hq // launch.pack, grid, launch.num_splits)](
        q, kv, block_tables, cu_seqlens_q, seq_lens, seq_of_tile, tile_in_seq, sinks, out, part, lse,
        *q.stride(), *kv.stride(), *block_tables.stride(), *out.stride(), *part_strides, *lse_strides,
        scale * _LOG2E, sliding_window or 0, num_seqs, launch.num_splits,
        GROUP=hq // hkv, PACK=launch.pack, HEAD_D=d, BLOCK_D=block_d, PAGE=page, BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n, HAS_WINDOW=sliding_window is not None, DIRECT=direct, HAS_SINKS=has_sinks,
        DOT_PREC=dot_precision(q.dtype), PDL=pdl, SHORT_M=short_rows(launch) if short else 0,
        num_warps=launch.num_warps, num_stages=num_stages or 3,
    )
    if not direct:
        # one row per new token: [T, Hq, S, D] partials
        merge_splits_kernel[(num_tokens, hq)](
            part, lse, out, sinks, *part_strides, *lse_strides, *out.stride(), launch.num_splits,
            HEAD_D=d, BLOCK_D=block_d, BLOCK_S=pow2(launch.num_splits), HAS_SINKS=has_sinks, PDL=pdl, launch_pdl=pdl,
            num_warps=4,
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
    context: int | None = None,
    sinks: torch.Tensor | None = None,
    plans: dict | None = None,
) -> torch.Tensor:
    """Flat varlen q [T, Hq, D] over the paged kv, causal; see reference.paged_prefill.

    seq_lens[b] must not exceed block_tables.shape[1] * block_size and must be at least that
    sequence's new-token count; neither is checked here, as checking would sync the host.
    context: the cached tokens of a one-sequence batch, known on the host (seq_lens[0] - T); a
    long chunk then runs through cuDNN (dense.py) when `dense.applies`.
    plans: a dict the caller keeps for one batch (every layer of a step): the launch and its tile
    map (a few small device ops) are made once per shape and taken from it after. It must not
    outlive the batch: cu_seqlens_q's values are read when a plan is made, not on each call.
    """
    if dense.applies(q, kv, seq_lens.shape[0], context, sliding_window):
        _checks.check_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, sliding_window, sinks)
        _checks.check_context(context, q.shape[0], block_tables, kv.shape[2])
        return dense.prefill_one(q, kv, block_tables[0], context, scale, sinks)
    return _paged_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, sinks, plans=plans)


def launch_variants(num_heads: int, kv_heads: int, head_dim: int, device: torch.device) -> list[Launch]:
    """Every launch `choose_launch` can pick for these heads, whatever the batch: one per distinct
    compiled kernel (tile rows, keys, warps, packing, split or not; the split count itself is not
    compiled in)."""
    seen: dict[tuple, Launch] = {}
    for per_seq in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, PACKED_EXTEND_TOKENS, PACKED_EXTEND_TOKENS + 1,
                    1024, 4096, 16384):
        for num_seqs in (1, 8, 64):
            for context in (0, 1 << 17):  # a cold prompt, and one over a long cached prefix
                launch = choose_launch(per_seq * num_seqs, num_seqs, num_heads, kv_heads, per_seq + context,
                                       head_dim, device)
                for splits in (1, 2):
                    key = (launch.block_m, launch.block_n, launch.num_warps, launch.pack, splits == 1)
                    seen.setdefault(key, dataclasses.replace(launch, num_splits=splits))
    return list(seen.values())


def compile_variants(kv: torch.Tensor, num_heads: int, scale: float, windows=(None,), sinks: bool = False) -> int:
    """Compile now every kernel variant paged_prefill may choose on this pool, for each sliding
    window in `windows`, so a server never stalls mid-run (~1 s a variant, once per machine:
    Triton keeps them on disk); with `sinks`, the variants with attention sinks in the pool's dtype
    (a model whose layers all have them, gpt-oss) instead of those without. kv: one layer's pool
    [blocks, 2, page, Hkv, D]; only read. Returns the number of variants."""
    _, _, page, hkv, d = kv.shape
    variants = launch_variants(num_heads, hkv, d, kv.device)
    width = max(triton.cdiv(2 * 128, page), 2)              # room for two key tiles of any size
    tables = torch.zeros(1, width, dtype=torch.int32, device=kv.device)  # every entry block 0: read only
    lens = torch.tensor([width * page], dtype=torch.int32, device=kv.device)
    sink_logits = torch.zeros(num_heads, dtype=kv.dtype, device=kv.device) if sinks else None
    for launch in variants:
        rows = max(1, launch.tokens_per_tile)
        q = torch.zeros(rows, num_heads, d, dtype=kv.dtype, device=kv.device)
        cu = torch.tensor([0, rows], dtype=torch.int32, device=kv.device)
        for window in windows:
            _paged_prefill(q, kv, tables, cu, lens, scale, window, sink_logits, block_m=launch.block_m,
                           block_n=launch.block_n, num_warps=launch.num_warps, pack=launch.pack > 1,
                           num_splits=launch.num_splits)
    return len(variants)
