"""bench_moe: kernels.fused_moe at decode batch sizes against the HBM bandwidth of the same run (H200).

For the MoE layer shapes of Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert intermediate 768)
and gpt-oss-20b (hidden 2880, 32 experts, top-4, intermediate 2880, clamped SwiGLU with biases), bf16,
random weights and random routing, batch 1, 4 and 256: the time of one fused_moe call, replayed in
a CUDA graph (as the engine's decode runs it) and eagerly, over LAYERS layers of their own weights, and
the bytes of the expert weights it must read (every expert some token routes to, read once) per second, against a d2d torch copy of 2 GiB
(bytes read + written per second: the HBM ceiling of this run). A decode step of a MoE model is bound
by those weight reads, so this fraction is the MoE part of the batch-1 roofline target.
With --sweep, each case is also timed (in a graph) at every launch of SWEEP (path, tiles, warps,
stages, the per-pair path's down launch), to pick kernels/moe.py's defaults from; the best of each
path is printed. Writes benchmarks/results/bench_moe-<machine>.json (or --out DIR).
Prints a table.
Usage: python benchmarks/bench_moe.py [--out DIR] [--reps N] [--sweep]
       python benchmarks/bench_moe.py --smoke   (CPU: tiny shapes through the reference, checks the script)
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

# name -> (hidden, experts, top-k, expert intermediate, gpt-oss activation and biases?)
SHAPES = {"qwen3-30b-a3b": (2048, 128, 8, 768, False), "gpt-oss-20b": (2880, 32, 4, 2880, True)}
SMOKE_SHAPES = {"qwen3-like": (64, 8, 2, 32, False), "gpt-oss-like": (64, 4, 2, 32, True)}
BATCHES = (1, 4, 256)
# (path, (BLOCK_M, BLOCK_N, BLOCK_K), num_warps, num_stages, gemv's down launch or None) tried by --sweep.
# "gemv" entries vary the gate_up launch at the default down launch (moe.DOWN_LAUNCH), "gemv-down"
# entries the down launch (BLOCK_N, BLOCK_K, warps, stages, splits of the intermediate dim; None: as
# many as moe.DOWN_PROGRAMS_PER_SM asks) at the default gate_up launch, so the two kernels' bests are
# found separately; "grouped" at 16 rows for batch 1 (the two best at 49b6372), every tile for 256
# (tiles past the H200's 227 KiB of shared memory left out: 2 * BLOCK_N * BLOCK_K * 2 bytes a stage)
SWEEP = ([("gemv", (1, n, k), 4, s, None) for n, k, s in ((16, 128, 3), (16, 256, 3), (32, 128, 3), (32, 128, 5),
                                                          (32, 256, 3), (64, 128, 3), (64, 128, 5), (64, 256, 3))]
         + [("gemv", (1, 16, 256), 2, 4, None)]
         + [("gemv-down", None, None, None, (n, k, 4, 3, splits)) for n in (16, 32, 64) for k in (128, 256)
            for splits in (None, 1, 2, 4)]
         + [("gemv-down", None, None, None, launch) for launch in ((32, 256, 4, 4, None), (32, 128, 4, 5, None),
                                                                   (16, 256, 2, 3, None), (64, 256, 8, 3, None),
                                                                   (32, 512, 4, 3, 1))]
         + [("grouped", (16, n, 128), 4, 3, None) for n in (32, 64)]
         + [("grouped", (m, n, k), w, 3, None) for m in (32, 64) for n in (64, 128) for k in (64, 128)
            for w in (4, 8)])
SWEPT_BATCHES = (1, 256)  # batch 4 is timed at the defaults only
SMALL_BATCH = 16  # up to this batch: the per-pair path and 16-row grouped tiles; above: no per-pair, no narrow tiles
# each timed call runs this many layers, each with its own weights, as a decode step does: the
# expert weights a call reads (75 MB at Qwen3-30B's batch 1) then never sit in the 50 MB L2 from
# the previous replay
LAYERS = 4
GB = 1e9


def layer(shape: tuple, device: str, dtype: torch.dtype, gen: torch.Generator) -> dict:
    hidden, experts, _, inter, bias = shape

    def rand(*s, scale):
        return (scale * torch.randn(*s, generator=gen, device=device)).to(dtype)

    return dict(w13=rand(experts, 2 * inter, hidden, scale=hidden**-0.5), w2=rand(experts, hidden, inter, scale=inter**-0.5),
                b13=rand(experts, 2 * inter, scale=0.1) if bias else None, b2=rand(experts, hidden, scale=0.1) if bias else None,
                activation="swigluoai" if bias else "silu")


def routing(batch: int, experts: int, k: int, device: str, dtype: torch.dtype, gen: torch.Generator):
    top, ids = torch.randn(batch, experts, generator=gen, device=device).topk(k, dim=-1)
    return ids, top.softmax(-1).to(dtype)


def weight_bytes(w: dict, ids: torch.Tensor) -> int:
    """Bytes of expert weights (and biases) a call must read: each expert used, once."""
    used = torch.unique(ids).numel()
    per_expert = sum(t[0].numel() * t.element_size() for t in (w["w13"], w["w2"], w["b13"], w["b2"]) if t is not None)
    return used * per_expert


def sweep(call_with, batch: int, reps: int) -> list[dict]:
    """Graph-replayed milliseconds of every SWEEP launch that applies (the per-pair path only for
    small batches: it reads an expert once per pair; grouped tiles of more than 16 rows only for
    large ones: at batch 1 they read the same weights with more padding)."""
    from triton.testing import do_bench_cudagraph

    timings = []
    for method, tiles, warps, stages, down in SWEEP:
        if (batch > SMALL_BATCH and (method.startswith("gemv") or tiles[1] < 64)) or \
                (batch <= SMALL_BATCH and method == "grouped" and tiles[0] > 16):
            continue
        launch = dict(method="gemv", down_launch=down) if method == "gemv-down" else \
            dict(method=method, tiles=tiles, num_warps=warps, num_stages=stages)
        entry = dict(method=method, tiles=tiles, num_warps=warps, num_stages=stages, down_launch=down)
        try:
            t = do_bench_cudagraph(lambda: call_with(**launch), rep=reps, return_mode="median")
        except Exception as e:  # a launch that does not fit (shared memory) is reported, not fatal
            timings.append(dict(entry, error=str(e)[:200]))
            continue
        timings.append(dict(entry, graph_ms=t))
    return timings


def run(shapes: dict, reps: int, smoke: bool, do_sweep: bool = False) -> dict:
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    copy_gbps = None
    if not smoke:
        from bench_kernels import copy_bandwidth

        copy_gbps = copy_bandwidth()
    rows = []
    for name, shape in shapes.items():
        layers = [layer(shape, device, dtype, gen) for _ in range(LAYERS)]
        w = layers[0]
        for batch in BATCHES:
            ids, weights = routing(batch, shape[1], shape[2], device, dtype, gen)
            x = torch.randn(batch, shape[0], generator=gen, device=device).to(dtype)

            def call():
                for w in layers:
                    out = kernels.fused_moe(x, w["w13"], w["w2"], ids, weights, w["activation"], w["b13"], w["b2"])
                return out

            def call_with(**launch):
                from tierkv.kernels import moe

                for w in layers:
                    out = moe.fused_moe(x, w["w13"], w["w2"], ids, weights, w["activation"], w["b13"], w["b2"], **launch)
                return out

            out = call()
            assert torch.isfinite(out.float()).all()
            row = dict(shape=name, batch=batch, hidden=shape[0], experts=shape[1], top_k=shape[2],
                       intermediate=shape[3], experts_used=int(torch.unique(ids).numel()),
                       layers=LAYERS, weight_bytes=LAYERS * weight_bytes(w, ids))
            if smoke:
                row["backend"] = kernels.backend_for(x)
            else:
                from triton.testing import do_bench, do_bench_cudagraph

                row["graph_ms"] = do_bench_cudagraph(call, rep=reps, return_mode="median")
                row["eager_ms"] = do_bench(call, warmup=10, rep=reps, return_mode="median")
                row["graph_gbps"] = row["weight_bytes"] / (row["graph_ms"] * 1e-3) / GB
                row["eager_gbps"] = row["weight_bytes"] / (row["eager_ms"] * 1e-3) / GB
                row["graph_of_hbm"] = row["graph_gbps"] / copy_gbps
                row["eager_of_hbm"] = row["eager_gbps"] / copy_gbps
                if do_sweep and batch in SWEPT_BATCHES:
                    row["sweep"] = sweep(call_with, batch, reps)
                    row["best"] = {}
                    for method in {s["method"] for s in row["sweep"]}:
                        best = min((s for s in row["sweep"] if s["method"] == method and "graph_ms" in s),
                                   key=lambda s: s["graph_ms"], default=None)
                        if best is not None:
                            of_hbm = row["weight_bytes"] / (best["graph_ms"] * 1e-3) / GB / copy_gbps
                            row["best"][method] = dict(best, of_hbm=of_hbm)
            rows.append(row)
    return dict(copy_gbps=copy_gbps, dtype=str(dtype), rows=rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--reps", type=int, default=200, help="milliseconds of timing per case (triton do_bench rep)")
    p.add_argument("--sweep", action="store_true", help="also time every launch in SWEEP per case (GPU)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the reference: checks the script")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke on CPU)")
    figures = run(SMOKE_SHAPES if args.smoke else SHAPES, args.reps, args.smoke, args.sweep and not args.smoke)
    print(f"d2d copy: {figures['copy_gbps'] or 0:.0f} GB/s")
    print(f"{'shape':>14} {'batch':>5} {'used':>5} {'MB':>8} {'graph ms':>9} {'GB/s':>7} {'of HBM':>7} {'eager ms':>9}")
    for r in figures["rows"]:
        print(f"{r['shape']:>14} {r['batch']:>5} {r['experts_used']:>5} {r['weight_bytes'] / 1e6:>8.1f} "
              f"{r.get('graph_ms', 0):>9.4f} {r.get('graph_gbps', 0):>7.0f} {r.get('graph_of_hbm', 0):>7.1%} "
              f"{r.get('eager_ms', 0):>9.4f}")
        for method, b in sorted(r.get("best", {}).items()):
            launch = f"down {b['down_launch']}" if b["down_launch"] else \
                f"tiles {b['tiles']} warps {b['num_warps']} stages {b['num_stages']}"
            print(f"{'':>14} best {method} of the sweep: {launch}: {b['graph_ms']:.4f} ms, {b['of_hbm']:.1%} of HBM")
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench_moe-")) if args.smoke else None)
    print("wrote", write_results("bench_moe", figures, out))


if __name__ == "__main__":
    main()
