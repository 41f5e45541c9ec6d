"""bench_gemv: batch-1 linear layers (one row of activations) against cuBLAS, as HBM reads.

Batch-1 decode of Llama-3.1-8B spends ~85% of a step in five matrix-vector products (qkv, o,
gate_up, down per layer; the LM head once); bench_latency's profile shows cuBLAS reading the
smaller ones (qkv, o) at ~3.1 TB/s and splitting o and down over K with a second reduce kernel.
For each shape this times torch's F.linear and kernels/matvec.py (its default and, with --sweep,
every launch of a small grid), each replayed in a CUDA graph over `copies` distinct weights
whose total is many times the 60 MB L2, so every call reads its weight from HBM. Figure: weight
bytes / time against a d2d copy's bytes read + written per second measured in the same run.

    python benchmarks/bench_gemv.py [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import copy_bandwidth
from common import machine_tag, write_results

from tierkv.kernels import matvec

# (name, in_features K, out_features N): Llama-3.1-8B's layers and head
SHAPES = [("llama8b-qkv", 4096, 6144), ("llama8b-o", 4096, 4096), ("llama8b-gate_up", 4096, 28672),
          ("llama8b-down", 14336, 4096), ("llama8b-lm_head", 4096, 128256)]
SWEEP = list(itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8), (1, 2)))  # block_n, block_k, warps, stages
GB = 1e9


def per_call_ms(fn, copies: int) -> float:
    """GPU time of one call, from a CUDA graph that makes `copies` calls (one per weight copy)."""
    return do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=50, return_mode="median") / copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also time every launch of SWEEP per shape")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth()
    rows = []
    for name, k, n in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-(1 << 30) // nbytes))        # >= 1 GiB of weights per graph replay
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x, ws[0]).float()
        err = (matvec.gemv(x, ws[0]).float() - want).abs().max().item()
        t_torch = per_call_ms(lambda i: F.linear(x, ws[i]), copies)
        t_ours = per_call_ms(lambda i: matvec.gemv(x, ws[i]), copies)
        row = dict(shape=name, in_features=k, out_features=n, weight_bytes=nbytes, copies=copies,
                   max_abs_diff_vs_torch=err, torch_ms=t_torch, gemv_ms=t_ours,
                   torch_of_copy=nbytes / (t_torch * 1e-3) / GB / copy_gbps,
                   gemv_of_copy=nbytes / (t_ours * 1e-3) / GB / copy_gbps, ratio_vs_torch=t_torch / t_ours)
        if a.sweep:
            row["sweep"] = []
            for bn, bk, warps, stages in SWEEP:
                launch = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                try:
                    t = per_call_ms(lambda i: matvec.gemv(x, ws[i], **launch), copies)
                    row["sweep"].append(dict(launch, ms=t, of_copy=nbytes / (t * 1e-3) / GB / copy_gbps))
                except Exception as e:  # a launch that does not compile is recorded, not fatal
                    row["sweep"].append(dict(launch, error=str(e)[:200]))
            timed = [r for r in row["sweep"] if "ms" in r]
            if timed:
                row["best"] = min(timed, key=lambda r: r["ms"])
        rows.append(row)
        best = row.get("best")
        print(f"{name:16s} {nbytes / 1e6:7.1f} MB  torch {t_torch * 1e3:7.1f} us ({row['torch_of_copy']:.0%} of copy)"
              f"  gemv {t_ours * 1e3:7.1f} us ({row['gemv_of_copy']:.0%})  x{row['ratio_vs_torch']:.2f}"
              + (f"  best {best['ms'] * 1e3:.1f} us ({best['of_copy']:.0%}) {best}" if best else "")
              + f"  max|diff| {err:.1e}", flush=True)
        ws.clear()  # free this shape's copies before the next
        torch.cuda.empty_cache()
    path = write_results("bench_gemv", dict(copy_gbps=copy_gbps, rows=rows), a.out)
    print(f"copy {copy_gbps:.0f} GB/s; wrote {path}  ({machine_tag()})")


if __name__ == "__main__":
    main()
