"""Triton matrix-vector product for one row of activations: y [N] = W [N, K] @ x [K] (+ bias).

Batch-1 decode reads every weight once per token, so its linear layers are pure HBM reads. Each
program owns BLOCK_N whole output rows and streams their K weights in BLOCK_K chunks, multiplying
and summing in fp32 registers: no tensor cores (one row of x leaves them idle), no split over K
and so no second kernel to reduce partial sums (cuBLAS's split-K GEMVs launch one). Many
independent 16-byte loads per thread keep enough bytes in flight to fill the memory pipes.

`linear` is what the engine's linear layers call (kernels.linear): one row of bf16/fp16
activations inside a CUDA graph capture takes the GEMV, everything else torch's F.linear (cuBLAS).
Only in a graph: benchmarks/bench_gemv.py has it read Llama-3.1-8B's five shapes 1.07-1.21x faster
than cuBLAS on an H100 at 2bdd8bb, GPU time alone, but a Triton launch costs the host several times
a cuBLAS call's, which an eager batch-1 step pays on every layer and a graph pays once, at capture.
Fusing the RMSNorm before it into each program was measured and dropped: every program re-reads
the whole row for its RMS, which cost more than the norm's launch on gate_up (91.7 against 83.9
us). This file never syncs the host and never allocates anything but the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._launch import check_triton_device


@triton.jit
def _gemv_kernel(X, W, Bias, Y, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]      # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
            x = tl.load(X + k0 + offs_k)
        else:
            k_mask = k0 + offs_k < K
            w = tl.load(w_ptrs + k0, mask=(rows < N)[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(X + k0 + offs_k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)                                                           # [BLOCK_N] fp32
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < N)


def choose_launch(n: int, k: int) -> tuple[int, int, int]:
    """(rows per program, K chunk, warps). From bench_gemv's sweep on an H100 at 2bdd8bb
    (bench_gemv-h100-2bdd8bb.json, 36 launches x Llama-3.1-8B's five shapes): 4 rows and
    2048-wide chunks with 4 warps were best or within 1% of it on every shape (the pipeline's
    stages made no difference), at 87-106% of a d2d copy's bandwidth where cuBLAS read at 67-95%."""
    return 4, min(2048, triton.next_power_of_2(k)), 4


# Whether one-row linears captured in CUDA graphs take the GEMV; bench_latency --compare-cublas turns it
# off, before the engine captures its graphs, to time the same model on cuBLAS.
GEMV_IN_GRAPHS = True


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` sends x through the GEMV: one row, bf16/fp16 like its row-major weight,
    while the current CUDA stream is being captured into a graph."""
    return (GEMV_IN_GRAPHS and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1
            and torch.cuda.is_current_stream_capturing())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [T, K], weight [N, K], bias) -> [T, N]; one row in a CUDA graph through `gemv`."""
    if takes_gemv(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None) -> torch.Tensor:
    """x [1, K] or [K] times weight [N, K] (row-major, as nn.Linear holds it) -> [1, N] or [N]."""
    check_triton_device(x, weight)
    k = x.shape[-1]
    if x.numel() != k or weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"gemv takes one row x [1, K] and a row-major weight [N, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)} with strides {weight.stride()}")
    n = weight.shape[0]
    bn, bk, warps = choose_launch(n, k)
    bn, bk, warps = block_n or bn, block_k or bk, num_warps or warps
    xv = x.reshape(k)
    if xv.stride(0) != 1:
        xv = xv.contiguous()
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        xv, weight, bias if bias is not None else y, y, n, k, weight.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, EVEN=(n % bn == 0 and k % bk == 0), HAS_BIAS=bias is not None,
        num_warps=warps, num_stages=num_stages or 1,
    )
    return y.view(*x.shape[:-1], n)
