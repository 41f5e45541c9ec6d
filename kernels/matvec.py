"""Triton matrix-vector product for one row of activations: y [N] = W [N, K] @ x [K] (+ bias).

Batch-1 decode reads every weight once per token, so its linear layers are pure HBM reads. Each
program owns BLOCK_N whole output rows and streams their K weights in BLOCK_K chunks, multiplying
and summing in fp32 registers: no tensor cores (one row of x leaves them idle), no split over K
and so no second kernel to reduce partial sums (cuBLAS's split-K GEMVs launch one). Many
independent 16-byte loads per thread keep enough bytes in flight to fill the memory pipes.

It can also normalise the row first (the decoder's RMSNorm, residual add included), so that a
norm and the projection after it are one launch. Experimental: not dispatched by the engine;
benchmarks/bench_gemv.py times it against cuBLAS. This file never syncs the host and never
allocates anything but its outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_triton_device


@triton.jit
def _row(X, R, NW, Sum, k0, offs_k, k_mask, rstd, store_sum,
         NORM: tl.constexpr, RESIDUAL: tl.constexpr, EVEN: tl.constexpr):
    """Chunk [k0, k0 + BLOCK_K) of the row the weights multiply: x, or with NORM rms_norm(x [+ r])
    rounded as kernels/norm.py rounds it (the sum x + r stored by the one program told to)."""
    if EVEN:
        x = tl.load(X + k0 + offs_k)
    else:
        x = tl.load(X + k0 + offs_k, mask=k_mask, other=0.0)
    if RESIDUAL:
        if EVEN:
            r = tl.load(R + k0 + offs_k)
        else:
            r = tl.load(R + k0 + offs_k, mask=k_mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        if store_sum:
            tl.store(Sum + k0 + offs_k, x, mask=k_mask)
    if NORM:
        w = tl.load(NW + k0 + offs_k, mask=k_mask, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(X.dtype.element_ty)
        x = (w.to(tl.float32) * normed.to(tl.float32)).to(X.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(X, R, NW, Sum, W, Bias, Y, N, K, stride_wn, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)                                # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)
    rstd = 1.0
    if NORM:
        # the row's RMS first: every program reads the whole row (K values, from L2 after the first)
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = k0 + offs_k < K
            x = tl.load(X + k0 + offs_k, mask=k_mask, other=0.0)
            if RESIDUAL:
                r = tl.load(R + k0 + offs_k, mask=k_mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            sq += x.to(tl.float32) * x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(sq, 0) / K + eps)
    w_ptrs = W + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]      # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        x = _row(X, R, NW, Sum, k0, offs_k, k_mask, rstd, pid == 0, NORM, RESIDUAL, EVEN)   # [BLOCK_K] fp32
        if EVEN:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k0, mask=(rows < N)[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)                                                           # [BLOCK_N] fp32
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < N)


def choose_launch(n: int, k: int) -> tuple[int, int, int]:
    """(rows per program, K chunk, warps). From bench_gemv's sweep on an H100 at 2bdd8bb
    (bench_gemv-h100-2bdd8bb.json, 24 launches x Llama-3.1-8B's five shapes): 4 rows and
    2048-wide chunks with 4 warps were best or within 1% of it on every shape (the pipeline's
    stages made no difference), at 87-106% of a d2d copy's bandwidth where cuBLAS read at 67-95%."""
    return 4, min(2048, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
         block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None):
    """x [1, K] or [K] times weight [N, K] (row-major, as nn.Linear holds it) -> [1, N] or [N].

    With norm_weight [K], the row multiplied is kernels.rms_norm(x, norm_weight, eps) instead (one
    launch for the decoder's norm and the projection after it); with residual [K] too, that of
    x + residual, and the result is (y, x + residual) as rms_norm returns its sum.
    """
    check_triton_device(x, weight)
    k = x.shape[-1]
    if x.numel() != k or weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"gemv takes one row x [1, K] and a row-major weight [N, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)} with strides {weight.stride()}")
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError("gemv adds a residual only before its norm: give norm_weight, and a residual shaped like x")
    n = weight.shape[0]
    bn, bk, warps = choose_launch(n, k)
    bn, bk, warps = block_n or bn, block_k or bk, num_warps or warps
    xv = x.reshape(k).contiguous()
    rv = residual.reshape(k).contiguous() if residual is not None else xv
    total = torch.empty_like(xv) if residual is not None else xv
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        xv, rv, norm_weight if norm_weight is not None else xv, total, weight, bias if bias is not None else y, y,
        n, k, weight.stride(0), float(eps),
        BLOCK_N=bn, BLOCK_K=bk, EVEN=(n % bn == 0 and k % bk == 0), HAS_BIAS=bias is not None,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, num_warps=warps, num_stages=num_stages or 1,
    )
    y = y.view(*x.shape[:-1], n)
    return (y, total.view(x.shape)) if residual is not None else y
