"""Triton fused_moe: a sparse MoE layer's routed experts as two grouped GEMMs over tokens sorted by expert.

The grouped path (see reference.fused_moe for the maths and the weight layout):
1. sort: the T * k (token, expert) pairs are grouped by expert, each expert's run padded to a multiple
   of BLOCK_M, so a tile of BLOCK_M rows never mixes experts. Done on the device, with no host sync,
   into buffers whose sizes follow from T, k, E and BLOCK_M, so the layer can be captured in a CUDA
   graph: by one Triton program (one launch) for decode-sized batches, by a stable torch sort and a
   dozen torch ops for prefill-sized ones (sort_by_expert). At most min(T * k, E) experts are used,
   so the padded rows number at most T * k + min(T * k, E) * (BLOCK_M - 1); tiles past the real
   total (a device scalar) return at once.
2. gate_up: per tile, x rows of its pairs @ its expert's w13, gate and up in two accumulators, the
   activation (silu or swigluoai) applied in the epilogue -> act [padded rows, I].
3. down: act @ w2 of the tile's expert (+ b2), times the pair's routing weight, rounded to x's dtype,
   written to the pair's row of a [T * k, H] buffer (padding rows write nothing).
4. the k rows of each token are summed in fp32 and rounded once -> [T, H].
The per-pair path, for a few tokens (decode at batch 1): the sort's launches would cost more than
reading the experts, and the k experts of a token are distinct anyway, so each (token, expert) pair
reads its expert's weights directly, in two launches: gate_up with the activation per (pair, column
tile), then down per (pair, column tile, intermediate chunk), enough programs for several per SM;
each leaves an fp32 partial and the last of a (token, column tile)'s programs to arrive (an atomic
counter) weights, rounds and sums them in a fixed order (step 4 inside the launch, deterministic).
Both are tl.dot loops over a 16-row tile whose other rows are zeros: the compiler pipelines a dot
loop's loads (several weight tiles in flight), which is what reading HBM at its speed takes; the
tensor cores' wasted rows cost nothing at batch 1.
Rounding follows transformers where it matters (the GEMM outputs are rounded to the dtype before
the activation, the weighted expert output before the sum); the sum over k is in fp32, so bf16 results
can differ from the reference by an ulp. This file never reads tensor contents on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._launch import check_triton_device, dot_precision, sm_count

_ACTIVATIONS = {"silu": 0, "swigluoai": 1}
GEMV_MAX_TOKENS = 4  # up to this many tokens, the per-pair path (no sort; see fused_moe)


@triton.jit
def _activate(acc_gate, acc_up, B13, expert, stride_be, cols, col_ok, inter, alpha, limit, dtype,
              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """The fp32 gate and up accumulators (+ bias) -> the activation, rounded to dtype like transformers."""
    if HAS_BIAS:
        b = B13 + expert * stride_be
        acc_gate += tl.load(b + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc_up += tl.load(b + inter + cols, mask=col_ok, other=0.0).to(tl.float32)
    gate = acc_gate.to(dtype).to(tl.float32)                  # the GEMM's output in the model's dtype
    up = acc_up.to(dtype).to(tl.float32)
    if ACTIVATION == 0:   # silu(gate) * up
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    else:                 # gpt-oss: clamp, gate * sigmoid(alpha * gate), times (up + 1)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    return act.to(dtype)


@triton.jit
def _tile(TileExpert, SortedPairs, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """A grouped tile's expert, its padded rows, the pair of each row and which rows are real pairs."""
    expert = tl.load(TileExpert + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedPairs + rows)                       # index into the flat [T * k] pairs
    return expert, rows, pairs, pairs < num_pairs


@triton.jit
def _gate_up_dots(a, w_gate, w_up, ks, k_ok, col_ok, acc_gate, acc_up, DOT_PREC: tl.constexpr):
    """One BLOCK_K step of gate/up: rows a [M, BLOCK_K] times the expert's gate and up weights at
    ks [BLOCK_K] x the tile's columns (w_gate, w_up: [1, BLOCK_N] pointers), into the fp32 accumulators."""
    w_mask = k_ok[:, None] & col_ok[None, :]
    wg = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)                         # [BLOCK_K, BLOCK_N]
    wu = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)
    return tl.dot(a, wg, acc_gate, input_precision=DOT_PREC), tl.dot(a, wu, acc_up, input_precision=DOT_PREC)


@triton.jit
def _gate_up_kernel(X, W13, B13, Act, SortedPairs, TileExpert, NumPadded,
                    hidden, inter, top_k, num_pairs,
                    stride_xt, stride_we, stride_wn, stride_be, alpha, limit,
                    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, DOT_PREC: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (m, n): padded rows [m * BLOCK_M, +BLOCK_M) (one expert), act columns [n * BLOCK_N, +BLOCK_N)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    expert, rows, pairs, real = _tile(TileExpert, SortedPairs, pid_m, num_pairs, BLOCK_M)
    tokens = (pairs // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_gate = W13 + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn          # [1, BLOCK_N]
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(X + tokens[:, None] * stride_xt + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        acc_gate, acc_up = _gate_up_dots(a, w_gate, w_up, ks, k_ok, col_ok, acc_gate, acc_up, DOT_PREC)
    act = _activate(acc_gate, acc_up, B13, expert, stride_be, cols[None, :], col_ok[None, :], inter, alpha, limit,
                    Act.dtype.element_ty, HAS_BIAS, ACTIVATION)
    tl.store(Act + rows[:, None].to(tl.int64) * inter + cols[None, :], act, mask=col_ok[None, :])


@triton.jit
def _down_kernel(Act, W2, B2, Weights, Out, SortedPairs, TileExpert, NumPadded,
                 hidden, inter, num_pairs, stride_we, stride_wn, stride_be,
                 HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (m, n): padded rows [m * BLOCK_M, +BLOCK_M), output columns [n * BLOCK_N, +BLOCK_N)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    expert, rows, pairs, real = _tile(TileExpert, SortedPairs, pid_m, num_pairs, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = W2 + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn                 # [1, BLOCK_N]
    a_rows = Act + rows[:, None].to(tl.int64) * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
        wd = tl.load(w + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, wd, acc, input_precision=DOT_PREC)
    dtype = Out.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(B2 + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(Weights + pairs, mask=real, other=0.0).to(tl.float32)
    out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(Out + pairs[:, None].to(tl.int64) * hidden + cols[None, :], out, mask=real[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_pair_kernel(X, W13, B13, Act, Ids, Arrived, arrived_count, hidden, inter, top_k, stride_xt, stride_we,
                         stride_wn, stride_be, alpha, limit, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                         DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (p, n): pair p (token p // k, its expert Ids[p]), act columns [n * BLOCK_N, +BLOCK_N). The
    # token's x is row 0 of a 16-row tile (tl.dot's smallest; the other rows are zeros and read nothing):
    # a dot loop, which the compiler pipelines (weight tiles of later steps in flight), unlike a
    # multiply-reduce loop, whose one tile at a time left HBM idle
    pair, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if (pair == 0) & (pid_n == 0):
        # zero the down launch's arrival counters: this launch runs before it on the same stream, so
        # the down launch needs no memset of its own (one launch fewer per layer)
        for i in range(0, arrived_count, 1024):
            offs = i + tl.arange(0, 1024)
            tl.store(Arrived + offs, tl.zeros((1024,), dtype=tl.int32), mask=offs < arrived_count)
    expert = tl.load(Ids + pair).to(tl.int64)
    first = (tl.arange(0, 16) == 0)[:, None]                                               # [16, 1]
    x_row = X + (pair // top_k) * stride_xt
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_gate = W13 + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn          # [1, BLOCK_N]
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_row + ks, mask=k_ok, other=0.0)                                    # [BLOCK_K]
        a = tl.where(first, x[None, :], 0.0).to(x.dtype)                                 # [16, BLOCK_K]
        acc_gate, acc_up = _gate_up_dots(a, w_gate, w_up, ks, k_ok, col_ok, acc_gate, acc_up, DOT_PREC)
    act = _activate(acc_gate, acc_up, B13, expert, stride_be, cols[None, :], col_ok[None, :], inter, alpha, limit,
                    Act.dtype.element_ty, HAS_BIAS, ACTIVATION)                        # [16, BLOCK_N], row 0 real
    tl.store(Act + pair * inter + tl.zeros((16, 1), dtype=tl.int64) + cols[None, :], act,
             mask=first & col_ok[None, :])


@triton.jit
def _down_pair_kernel(Act, W2, B2, Weights, Ids, Out, Partial, Arrived, hidden, inter, top_k, chunk,
                      stride_we, stride_wn, stride_be, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                      SPLITS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (p * SPLITS + s, n): pair p's down product over the intermediate chunk s ([s * chunk,
    # +chunk)) for output columns [n * BLOCK_N, +BLOCK_N): batch 1 gets k * SPLITS * hidden / BLOCK_N
    # programs (several per SM, each a short pipelined dot loop), where one program per column tile
    # walking all k experts had about one per SM. Each writes its fp32 partial row to Partial; the
    # last of a (token, column tile)'s k * SPLITS programs to arrive (an atomic counter, zeroed by
    # the gate_up launch) sums them in a fixed order (splits, then weighted pairs), so the result
    # does not depend on which program came last: deterministic, and one launch
    pid, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    pair, split = pid // SPLITS, pid % SPLITS
    token = pair // top_k
    expert = tl.load(Ids + pair).to(tl.int64)
    first = (tl.arange(0, 16) == 0)[:, None]                                               # [16, 1]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = W2 + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn                 # [1, BLOCK_N]
    act_row = Act + pair * inter
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    start = split * chunk
    for k0 in range(start, tl.minimum(start + chunk, inter), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        row = tl.load(act_row + ks, mask=k_ok, other=0.0)                                  # [BLOCK_K]
        a = tl.where(first, row[None, :], 0.0).to(row.dtype)                              # [16, BLOCK_K]
        wd = tl.load(w + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, wd, acc, input_precision=DOT_PREC)
    tl.store(Partial + pid * hidden + cols, tl.sum(acc, axis=0), mask=col_ok)            # rows 1.. are zeros
    # every thread's store before the counter's release (the CUDA semaphore pattern: barrier, then
    # one thread's acq_rel atomic); the last arriver's acquire then sees all partials
    tl.debug_barrier()
    arrived = tl.atomic_add(Arrived + token * tl.num_programs(1) + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == top_k * SPLITS - 1:
        js, ss = tl.arange(0, BLOCK_J), tl.arange(0, BLOCK_S)
        j_ok = js < top_k
        rows = token * top_k * SPLITS + js[:, None, None] * SPLITS + ss[None, :, None]     # [BLOCK_J, BLOCK_S, 1]
        ok = j_ok[:, None, None] & (ss < SPLITS)[None, :, None] & col_ok[None, None, :]
        parts = tl.load(Partial + rows * hidden + cols[None, None, :], mask=ok, other=0.0, volatile=True)
        out = tl.sum(parts, axis=1)                                                       # [BLOCK_J, BLOCK_N]
        dtype = Out.dtype.element_ty
        if HAS_BIAS:
            experts = tl.load(Ids + token * top_k + js, mask=j_ok, other=0).to(tl.int64)
            out += tl.load(B2 + experts[:, None] * stride_be + cols[None, :], mask=j_ok[:, None] & col_ok[None, :],
                           other=0.0).to(tl.float32)
        weight = tl.load(Weights + token * top_k + js, mask=j_ok, other=0.0).to(tl.float32)   # [BLOCK_J]
        # like transformers: the expert output rounded, weighted, rounded again; then summed in fp32
        weighted = (out.to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)  # rows past k: 0
        tl.store(Out + token * hidden + cols, tl.sum(weighted, axis=0).to(dtype), mask=col_ok)


def padded_rows(pairs: int, experts: int, block_m: int) -> int:
    """Rows of the expert-sorted buffer: every pair, plus at most block_m - 1 padding per used expert."""
    return pairs + min(pairs, experts) * (block_m - 1)


@triton.jit
def _align_kernel(Ids, Rank, RunStart, SortedPairs, TileExpert, NumPadded, num_pairs, experts, rows,
                  tiles, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    # ONE program does sort_by_expert's work: (1) each pair's rank among the earlier pairs of its
    # expert (stable: as a stable sort orders them), the experts' counts kept in registers; (2) each
    # expert's padded run, the tiles' experts, the real total; (3) every pair to its row. A barrier
    # orders phase 3's reads after the writes before it (one program: its threads only); what this
    # program wrote is read back volatile, past the SM's L1.
    e_offs = tl.arange(0, BLOCK_E)
    e_ok = e_offs < experts
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        p = start + offs
        ok = p < num_pairs
        e = tl.load(Ids + p, mask=ok, other=0)
        hit = ((e[:, None] == e_offs[None, :]) & ok[:, None]).to(tl.int32)       # [BLOCK, BLOCK_E] one-hot
        upto = tl.cumsum(hit, axis=0)                                             # this chunk's pairs so far
        rank = tl.sum((upto - 1 + counts[None, :]) * hit, axis=1)                 # earlier pairs, same expert
        tl.store(Rank + p, rank, mask=ok)
        counts += tl.sum(hit, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)                           # past the last expert: the total
    tl.store(RunStart + e_offs, run_end - padded, mask=e_ok)
    tl.store(NumPadded, tl.sum(padded, axis=0))
    for r in range(0, rows, BLOCK):
        tl.store(SortedPairs + r + offs, tl.full((BLOCK,), 0, tl.int64) + num_pairs, mask=r + offs < rows)
    for t0 in range(0, tiles, BLOCK):
        t = t0 + offs
        ends_before = (run_end[None, :] <= (t * BLOCK_M)[:, None]) & e_ok[None, :]   # searchsorted(right=True)
        tl.store(TileExpert + t, tl.sum(ends_before.to(tl.int32), axis=1), mask=t < tiles)
    tl.debug_barrier()
    for start in range(0, num_pairs, BLOCK):
        p = start + offs
        ok = p < num_pairs
        e = tl.load(Ids + p, mask=ok, other=0)
        dest = tl.load(RunStart + e, mask=ok, other=0, volatile=True) + tl.load(Rank + p, mask=ok, other=0,
                                                                              volatile=True)
        tl.store(SortedPairs + dest, p.to(tl.int64), mask=ok)


ALIGN_IN_ONE_PROGRAM = (8192, 512)  # (pairs, experts) up to which one program sorts (decode, graphs)


def sort_by_expert(topk_ids: torch.Tensor, experts: int, block_m: int, method: str | None = None):
    """(sorted_pairs [R], tile_expert [R / block_m], num_padded [1]) for R = padded_rows(...), int64.

    sorted_pairs lists the flat pair indices (t * k + j) expert by expert (in pair order within an
    expert), each expert's run padded with the sentinel T * k to a multiple of block_m; tile_expert
    names each tile's expert (E for tiles past num_padded, which the kernels skip). No host sync.
    method "kernel" (the default up to ALIGN_IN_ONE_PROGRAM): one Triton program, one launch, as a
    decode step wants; "torch" (larger, prefill): a stable sort and a dozen torch ops.
    """
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    rows = padded_rows(pairs, experts, block_m)
    tiles = -(-rows // block_m)
    device = flat.device
    sorted_pairs = torch.empty(rows, dtype=torch.int64, device=device)
    tile_expert = torch.empty(tiles, dtype=torch.int64, device=device)
    num_padded = torch.empty(1, dtype=torch.int64, device=device)
    max_pairs, max_experts = ALIGN_IN_ONE_PROGRAM
    if method is None:
        method = "kernel" if pairs <= max_pairs and experts <= max_experts else "torch"
    if method == "kernel":
        block_e = triton.next_power_of_2(experts)
        rank = torch.empty(pairs, dtype=torch.int32, device=device)
        run_start = torch.empty(block_e, dtype=torch.int32, device=device)
        _align_kernel[(1,)](flat, rank, run_start, sorted_pairs, tile_expert, num_padded, pairs, experts, rows, tiles,
                            BLOCK_M=block_m, BLOCK=max(16, 8192 // block_e), BLOCK_E=block_e, num_warps=8)
        return sorted_pairs, tile_expert, num_padded
    counts = torch.zeros(experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m                     # [E]
    padded_end = padded.cumsum(0)                                             # [E] end of each expert's run
    run_start = padded_end - padded
    sorted_experts, order = torch.sort(flat.long(), stable=True)              # [P] each
    count_start = counts.cumsum(0) - counts                                   # first sorted index per expert
    dest = run_start[sorted_experts] + torch.arange(pairs, device=device) - count_start[sorted_experts]
    sorted_pairs.fill_(pairs).scatter_(0, dest, order)
    torch.searchsorted(padded_end, torch.arange(0, rows, block_m, device=device), right=True, out=tile_expert)
    return sorted_pairs, tile_expert, padded_end[-1:]


# (unused, BLOCK_N, BLOCK_K) of the per-pair gate_up launch (4 warps, 3 stages): bench_moe's sweep on
# the H200 at 9cecb1f, batch 1, the whole fused_moe: 0.1145 ms per 4 layers of Qwen3-30B (the best,
# 64-column tiles, 0.1132) and the best for gpt-oss-20b, 0.2515 ms (32 x 128: 0.1346 and 0.2595)
GATE_UP_TILES = (1, 32, 256)


# (BLOCK_N, BLOCK_K, num_warps, num_stages, splits) of the per-pair path's down launch; splits None:
# as many intermediate chunks as it takes to give DOWN_PROGRAMS_PER_SM programs per SM (batch 1 has only
# k * hidden / BLOCK_N (pair, column tile) programs: 256 for Qwen3-30B, 180 for gpt-oss-20b at 64).
# The H200 sweep at 9cecb1f found no split best on both shapes: 0.1241 ms per 4 Qwen3-30B layers (the
# best) and 0.2388 for gpt-oss-20b (best 0.2384), against 0.1344 and 0.2594 for (32, 256, 4, 3, None)
DOWN_LAUNCH = (64, 256, 4, 3, 1)
DOWN_PROGRAMS_PER_SM = 4


def _down_chunk(pairs: int, hidden: int, inter: int, launch: tuple, device: torch.device) -> tuple[int, int]:
    """(chunk, splits) of the down launch: intermediate columns per program and programs per pair."""
    block_n, block_k, _, _, splits = launch
    if splits is None:
        splits = 1
        programs = pairs * triton.cdiv(hidden, block_n)
        while programs * splits < DOWN_PROGRAMS_PER_SM * sm_count(device) and inter >= 2 * splits * block_k:
            splits *= 2
    chunk = triton.cdiv(triton.cdiv(inter, splits), block_k) * block_k   # whole BLOCK_K steps
    return chunk, triton.cdiv(inter, chunk)


def _tiles(pairs: int, experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the grouped path: row tiles near the rows an expert gets on
    average (16 to 64), since the rest of an expert's last tile is padding that reads its weights."""
    block_m = min(64, max(16, triton.next_power_of_2(max(1, pairs // experts))))
    return block_m, 64, 128 if block_m == 16 else 64


def fused_moe(x, w13, w2, topk_ids, topk_weights, activation="silu", b13=None, b2=None, alpha=1.702, limit=7.0,
              *, method: str | None = None, tiles: tuple[int, int, int] | None = None, num_warps: int = 4,
              num_stages: int = 3, down_launch: tuple[int, int, int, int] | None = None):
    """See reference.fused_moe. Two paths, chosen by the token count (or `method`):
    "gemv" (at most GEMV_MAX_TOKENS tokens, decode): no sort; one program per (pair, column tile)
    reads its expert's gate/up tile, then one per (token, column tile) reads the down tiles of all
    k of the token's experts and sums them: two launches, each used expert read about once;
    "grouped": the expert-sorted grouped GEMMs (module docstring), which read each expert once per
    tile of BLOCK_M rows. `tiles` = (BLOCK_M, BLOCK_N, BLOCK_K), `num_warps` and `num_stages`
    override the launch (of "gemv": its gate_up launch, BLOCK_M unused); `down_launch` =
    (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the down launch of "gemv" (DOWN_LAUNCH)."""
    tokens, hidden, experts, inter, k = _checks.check_fused_moe(x, w13, w2, topk_ids, topk_weights, activation,
                                                                b13, b2)
    check_triton_device(x)
    if tokens == 0:
        return torch.empty_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no-ops for loaded weights
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    method = method or ("gemv" if tokens <= GEMV_MAX_TOKENS else "grouped")
    if method == "gemv":
        return _gemv(x, w13, w2, topk_ids, topk_weights, activation, b13, b2, alpha, limit,
                     tiles or GATE_UP_TILES, num_warps, num_stages,
                     down_launch or DOWN_LAUNCH)
    return _grouped(x, w13, w2, topk_ids, topk_weights, activation, b13, b2, alpha, limit,
                    tiles or _tiles(tokens * k, experts), num_warps, num_stages)


def _gemv(x, w13, w2, topk_ids, topk_weights, activation, b13, b2, alpha, limit, tiles, num_warps, num_stages,
          down_launch):
    (tokens, hidden), (_, two_inter, _), k = x.shape, w13.shape, topk_ids.shape[1]
    inter, (_, block_n, block_k) = two_inter // 2, tiles
    ids, weights = topk_ids.reshape(-1), topk_weights.reshape(-1)
    prec = dot_precision(x.dtype)
    down_n, down_k, down_warps, down_stages, _ = down_launch
    chunk, splits = _down_chunk(tokens * k, hidden, inter, down_launch, x.device)
    down_tiles = triton.cdiv(hidden, down_n)
    act = torch.empty((tokens * k, inter), dtype=x.dtype, device=x.device)
    partial = torch.empty((tokens * k * splits, hidden), dtype=torch.float32, device=x.device)
    arrived = torch.empty(tokens * down_tiles, dtype=torch.int32, device=x.device)  # zeroed by gate_up
    out = torch.empty_like(x)
    _gate_up_pair_kernel[(tokens * k, triton.cdiv(inter, block_n))](
        x, w13, b13 if b13 is not None else w13, act, ids, arrived, arrived.numel(), hidden, inter, k, x.stride(0),
        w13.stride(0), w13.stride(1), b13.stride(0) if b13 is not None else 0, float(alpha), float(limit),
        HAS_BIAS=b13 is not None, ACTIVATION=_ACTIVATIONS[activation], DOT_PREC=prec, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    _down_pair_kernel[(tokens * k * splits, down_tiles)](
        act, w2, b2 if b2 is not None else w2, weights, ids, out, partial, arrived, hidden, inter, k, chunk,
        w2.stride(0), w2.stride(1), b2.stride(0) if b2 is not None else 0, HAS_BIAS=b2 is not None, DOT_PREC=prec,
        SPLITS=splits, BLOCK_J=triton.next_power_of_2(k), BLOCK_S=triton.next_power_of_2(splits), BLOCK_N=down_n,
        BLOCK_K=down_k, num_warps=down_warps, num_stages=down_stages,
    )
    return out


def _sum_over_k(per_pair: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """[T * k, H] weighted expert outputs -> [T, H]: summed in fp32, rounded once."""
    return per_pair.view(tokens, k, -1).sum(dim=1, dtype=torch.float32).to(per_pair.dtype, copy=False)


def _grouped(x, w13, w2, topk_ids, topk_weights, activation, b13, b2, alpha, limit, tiles, num_warps, num_stages):
    (tokens, hidden), (experts, two_inter, _), k = x.shape, w13.shape, topk_ids.shape[1]
    inter, (block_m, block_n, block_k) = two_inter // 2, tiles
    sorted_pairs, tile_expert, num_padded = sort_by_expert(topk_ids, experts, block_m)
    rows, pairs = sorted_pairs.numel(), tokens * k
    act = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    per_pair = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1)
    prec = dot_precision(x.dtype)
    m_tiles = rows // block_m
    _gate_up_kernel[(m_tiles, triton.cdiv(inter, block_n))](
        x, w13, b13 if b13 is not None else w13, act, sorted_pairs, tile_expert, num_padded,
        hidden, inter, k, pairs, x.stride(0), w13.stride(0), w13.stride(1),
        b13.stride(0) if b13 is not None else 0, float(alpha), float(limit),
        HAS_BIAS=b13 is not None, ACTIVATION=_ACTIVATIONS[activation], DOT_PREC=prec,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    _down_kernel[(m_tiles, triton.cdiv(hidden, block_n))](
        act, w2, b2 if b2 is not None else w2, weights, per_pair, sorted_pairs, tile_expert, num_padded,
        hidden, inter, pairs, w2.stride(0), w2.stride(1), b2.stride(0) if b2 is not None else 0,
        HAS_BIAS=b2 is not None, DOT_PREC=prec,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return _sum_over_k(per_pair, tokens, k)
