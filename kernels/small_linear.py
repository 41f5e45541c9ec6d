"""A dense linear layer for a few rows (decode at batch 1..SMALL_M): x [M, K] @ weight [N, K].T + bias.

At M = 1..4 a linear is a weight read: cuBLAS picks split-K kernels for it that ran at 45-66% of the
H200's HBM (qkv, o_proj, a MoE router, measured at 49b6372), plus a separate reduce launch. Here one
launch of (column tile, K chunk) programs, enough for several per SM, each a pipelined tl.dot loop
over a 16-row tile whose rows past M are zeros. With one chunk a program writes its columns directly;
with several, each leaves an fp32 partial and the last of a column tile's programs to arrive (an
atomic counter) sums them in a fixed order, adds the bias in fp32 and rounds once: deterministic,
whoever comes last. The counters live in one zeroed buffer per device that every call leaves zeroed
again (the last arriver resets its own); it is made on the first call, which must not be inside a
CUDA graph capture (a capture without it takes torch's linear instead). Calls on one device must not
run concurrently on two streams (they would share counters). Larger M, other layouts: torch's linear.
This file never reads tensor contents on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._launch import check_triton_device, dot_precision, sm_count

SMALL_M = 4  # up to this many rows, the kernel; above, torch's linear (cuBLAS is at home there)
# (BLOCK_N, BLOCK_K, num_warps, num_stages, splits) of the launch; splits None: as many K chunks as it
# takes to give PROGRAMS_PER_SM programs per SM (Qwen3-30B's qkv: 160 column tiles -> 4 chunks, its
# o_proj: 64 tiles -> 16 chunks of 256)
LAUNCH = (32, 256, 4, 3, None)
PROGRAMS_PER_SM = 4
MAX_TILES = 8192  # column tiles a split launch may have (counters per device); wider layers take one chunk

_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _small_m_kernel(X, W, B, Out, Partial, Arrived, M, N, K, chunk, stride_xm, stride_wn, stride_om,
                    HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (n, s): output columns [n * BLOCK_N, +BLOCK_N) over the K chunk [s * chunk, +chunk)
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, 16)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = W + cols[None, :].to(tl.int64) * stride_wn                                        # [1, BLOCK_N]
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    start = split * chunk
    for k0 in range(start, tl.minimum(start + chunk, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, wt, acc, input_precision=DOT_PREC)
    out_mask = row_ok[:, None] & col_ok[None, :]
    last = True
    if SPLITS > 1:
        tl.store(Partial + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=out_mask)
        # every thread's store before the counter's release (barrier, then one thread's acq_rel
        # atomic); the last arriver's acquire then sees every partial of its column tile
        tl.debug_barrier()
        arrived = tl.atomic_add(Arrived + pid_n, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLITS - 1
        if last:
            ss = tl.arange(0, BLOCK_S)
            at = Partial + (ss[:, None, None] * M + rows[None, :, None]) * N + cols[None, None, :]
            parts = tl.load(at, mask=(ss < SPLITS)[:, None, None] & out_mask[None, :, :], other=0.0, volatile=True)
            acc = tl.sum(parts, axis=0)                                                   # fixed order
            tl.atomic_xchg(Arrived + pid_n, 0)                                            # zero for the next call
    if last:
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + rows[:, None] * stride_om + cols[None, :], acc.to(Out.dtype.element_ty), mask=out_mask)


def _chunk(n: int, k: int, launch: tuple, device: torch.device) -> tuple[int, int]:
    """(chunk, splits): K columns per program and programs per column tile."""
    block_n, block_k, _, _, splits = launch
    tiles = triton.cdiv(n, block_n)
    if tiles > MAX_TILES:
        splits = 1
    elif splits is None:
        splits = 1
        while tiles * splits < PROGRAMS_PER_SM * sm_count(device) and k >= 2 * splits * block_k:
            splits *= 2
    chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k                       # whole BLOCK_K steps
    return chunk, triton.cdiv(k, chunk)


def _arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed counters, made now if not yet (None while a CUDA graph is being captured:
    a zeroing made then would only run at the graph's replays)."""
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return counters


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           launch: tuple | None = None) -> torch.Tensor:
    """torch.nn.functional.linear(x, weight, bias); x [M, K] with M <= SMALL_M through the kernel
    (`launch` = (BLOCK_N, BLOCK_K, num_warps, num_stages, splits or None) overrides LAUNCH), every
    other case through torch."""
    small = (x.dim() == 2 and 0 < x.shape[0] <= SMALL_M and weight.dim() == 2 and weight.stride(1) == 1
             and x.dtype == weight.dtype and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
             and x.shape[1] == weight.shape[1])
    if not small:
        return F.linear(x, weight, bias)
    check_triton_device(x, weight)
    launch = launch or LAUNCH
    (m, k), n = x.shape, weight.shape[0]
    chunk, splits = _chunk(n, k, launch, x.device)
    counters = _arrival_counters(x.device) if splits > 1 else weight
    if counters is None:
        return F.linear(x, weight, bias)
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    block_n, block_k, warps, stages, _ = launch
    _small_m_kernel[(triton.cdiv(n, block_n), splits)](
        x, weight, bias if bias is not None else weight, out, partial, counters, m, n, k, chunk, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, DOT_PREC=dot_precision(x.dtype), SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return out
