"""bench_linear: the small-M Triton linear (kernels/small_linear.py) against torch's linear (cuBLAS) at decode rows.

For the dense GEMMs of a batch-1..4 decode step of Qwen3-30B-A3B (qkv 2048 -> 5120, o_proj 4096 ->
2048, router 2048 -> 128) and gpt-oss-20b (qkv 2880 -> 5120 with bias, o_proj 4096 -> 2880 with
bias, router 2880 -> 32 with bias), bf16, random weights: graph-replayed milliseconds of LAYERS calls,
each on its own weights (so they do not sit in the 50 MB L2 between replays), for both, and the
weight bytes per second of each against a d2d copy of 2 GiB (the HBM ceiling of this run).
With --sweep, batch 1 is also timed at every launch of SWEEP, to pick kernels/small_linear.py's LAUNCH from;
the best is printed. Writes benchmarks/results/bench_linear-<machine>.json (or --out DIR).
Usage: python benchmarks/bench_linear.py [--out DIR] [--reps N] [--sweep]
       python benchmarks/bench_linear.py --smoke   (CPU: tiny shapes under torch, checks the script)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from tierkv import kernels  # noqa: E402

# name -> (in features K, out features N, bias)
SHAPES = {"qwen3-qkv": (2048, 5120, False), "qwen3-o": (4096, 2048, False), "qwen3-router": (2048, 128, False),
          "gpt-oss-qkv": (2880, 5120, True), "gpt-oss-o": (4096, 2880, True), "gpt-oss-router": (2880, 32, True)}
SMOKE_SHAPES = {"tiny": (64, 48, True)}
BATCHES = (1, 4)
# (BLOCK_N, BLOCK_K, num_warps, num_stages, splits or None) tried by --sweep at batch 1
SWEEP = ([(n, k, 4, 3, None) for n in (16, 32, 64) for k in (128, 256)]
         + [(32, 256, 4, 3, s) for s in (1, 2, 8)] + [(32, 128, 4, 5, None), (64, 128, 8, 4, None),
                                                        (16, 256, 2, 3, None)])
LAYERS = 16  # calls per timed replay, each on its own weights (qwen3-router: 8 MB in all, L2-resident)
GB = 1e9


def run(shapes: dict, reps: int, smoke: bool, do_sweep: bool) -> dict:
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    copy_gbps = None
    if not smoke:
        from bench_kernels import copy_bandwidth

        copy_gbps = copy_bandwidth()
    rows = []
    for name, (k, n, bias) in shapes.items():
        weights = [((torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype),
                    torch.randn(n, generator=gen, device=device).to(dtype) if bias else None) for _ in range(LAYERS)]
        for batch in BATCHES:
            x = torch.randn(batch, k, generator=gen, device=device).to(dtype)

            def ours(**launch):
                from tierkv.kernels import small_linear

                for w, b in weights:
                    out = small_linear.linear(x, w, b, **launch) if x.is_cuda else kernels.linear(x, w, b)  # CPU: --smoke
                return out

            def torchs():
                for w, b in weights:
                    out = torch.nn.functional.linear(x, w, b)
                return out

            err = (ours().float() - torchs().float()).abs().max().item()
            row = dict(shape=name, batch=batch, in_features=k, out_features=n, bias=bias, layers=LAYERS,
                       weight_bytes=LAYERS * n * k * x.element_size(), max_abs_diff_vs_torch=err)
            if not smoke:
                from triton.testing import do_bench_cudagraph

                for label, fn in (("kernel", ours), ("torch", torchs)):
                    row[f"{label}_ms"] = do_bench_cudagraph(fn, rep=reps, return_mode="median")
                    row[f"{label}_of_hbm"] = row["weight_bytes"] / (row[f"{label}_ms"] * 1e-3) / GB / copy_gbps
                if do_sweep and batch == 1:
                    row["sweep"] = []
                    for launch in SWEEP:
                        t = do_bench_cudagraph(lambda: ours(launch=launch), rep=reps, return_mode="median")
                        row["sweep"].append(dict(launch=launch, graph_ms=t))
                    best = min(row["sweep"], key=lambda s: s["graph_ms"])
                    row["best"] = dict(best, of_hbm=row["weight_bytes"] / (best["graph_ms"] * 1e-3) / GB / copy_gbps)
            rows.append(row)
    return dict(copy_gbps=copy_gbps, dtype=str(dtype), rows=rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--reps", type=int, default=100, help="milliseconds of timing per case (triton do_bench rep)")
    p.add_argument("--sweep", action="store_true", help="also time every launch in SWEEP at batch 1 (GPU)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through torch: checks the script")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke on CPU)")
    figures = run(SMOKE_SHAPES if args.smoke else SHAPES, args.reps, args.smoke, args.sweep and not args.smoke)
    print(f"d2d copy: {figures['copy_gbps'] or 0:.0f} GB/s")
    print(f"{'shape':>15} {'batch':>5} {'MB':>7} {'kernel ms':>10} {'of HBM':>7} {'torch ms':>9} {'of HBM':>7}")
    for r in figures["rows"]:
        print(f"{r['shape']:>15} {r['batch']:>5} {r['weight_bytes'] / 1e6:>7.1f} {r.get('kernel_ms', 0):>10.4f} "
              f"{r.get('kernel_of_hbm', 0):>7.1%} {r.get('torch_ms', 0):>9.4f} {r.get('torch_of_hbm', 0):>7.1%}")
        if "best" in r:
            b = r["best"]
            print(f"{'':>15} best of the sweep: {tuple(b['launch'])}: {b['graph_ms']:.4f} ms, {b['of_hbm']:.1%} of HBM")
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench_linear-")) if args.smoke else None)
    print("wrote", write_results("bench_linear", figures, out))


if __name__ == "__main__":
    main()
