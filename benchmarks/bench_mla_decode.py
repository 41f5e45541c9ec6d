"""bench_mla_decode: the MLA decode kernel (kernels/mla.py) against its HBM roofline, on the H200.

DeepSeek-V2-Lite's attention shape: 16 query heads, kv_lora_rank 512, rope 64 (a 576-value latent
per token, bf16, in a paged pool of 16-token blocks with shuffled block ids), nope 128 / v 128 (the
softmax scale). For batch 1 / 32 / 128 at contexts 4K and 32K it times `mla_decode` (absorbed
queries in, latent-space output out) replayed in a CUDA graph, as the engine's decode runs, and
compares it with the roofline: the latent bytes the step must read at the d2d copy bandwidth
measured in this run (bytes read + written by a 2 GiB torch copy). The latents are read once per
sequence (all heads at once), so the roofline is the latent cache size over the bandwidth.
Writes benchmarks/results/bench_mla_decode-<machine>.json (or --out DIR) and prints a table.
Each row also checks the first sequence's output against the fp32 reference (max_abs_err_seq0) and
names the launch chosen; --sweep times the launch choices around it (splits, tile, warps, stages).
--smoke runs tiny sizes on the CPU (the reference kernel; checks the script, measures nothing).
Usage: python benchmarks/bench_mla_decode.py [--out DIR] [--smoke] [--sweep]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from tierkv import kernels  # noqa: E402

HEADS, LATENT, ROPE, NOPE, PAGE, DT = 16, 512, 64, 128, 16, torch.bfloat16   # DeepSeek-V2-Lite
SHAPES = [(batch, ctx) for ctx in (4096, 32768) for batch in (1, 32, 128)]
SMOKE_SHAPES = [(1, 64), (3, 40)]
GB = 1e9


def gpu_ms(fn, calls: int = 20, replays: int = 5) -> float:
    """GPU time of one `fn` call: `calls` of them captured in one CUDA graph (no host launch cost),
    the median of `replays` replays divided by `calls`. The capture's stream first waits for the
    current one, which made the inputs: triton's do_bench_cudagraph does not, and its first call
    read a block table still being written (an illegal memory access at batch 32 x 32K on the H200,
    gone with CUDA_LAUNCH_BLOCKING=1)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiled and warm before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def cpu_ms(fn, reps: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def copy_gbps(device: torch.device, size: int) -> float:
    """GB/s of bytes read + written by one large copy: the memory ceiling of this run."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        from triton.testing import do_bench

        t = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    else:
        t = cpu_ms(lambda: dst.copy_(src))
    return 2 * size / (t * 1e-3) / GB


def latent_batch(batch: int, ctx: int, device: torch.device, gen: torch.Generator):
    """A shuffled paged latent pool of `batch` sequences of `ctx` tokens and absorbed queries."""
    blocks = -(-ctx // PAGE)
    n = batch * blocks
    dt = DT if device.type == "cuda" else torch.float32
    kv = torch.randn(n, 2, PAGE, 1, (LATENT + ROPE) // 2, generator=gen, device=device).to(dt)
    tables = torch.randperm(n, generator=gen, device=device).to(torch.int32).view(batch, blocks)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q_latent = torch.randn(batch, HEADS, LATENT, generator=gen, device=device).to(dt)
    q_pe = torch.randn(batch, HEADS, ROPE, generator=gen, device=device).to(dt)
    return q_latent, q_pe, kv, tables, seq_lens


def sweep(args, auto_splits: int, floor_ms: float) -> list[dict]:
    """The Triton kernel's launch choices around the automatic one, each timed in a CUDA graph."""
    from tierkv.kernels import mla

    rows = []
    for splits in sorted({max(1, auto_splits // 2), auto_splits, min(mla.MAX_SPLITS, 2 * auto_splits)}):
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                for stages in (2, 3):
                    launch = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
                    try:
                        t = gpu_ms(lambda launch=launch: mla._mla_decode(*args, **launch))
                    except Exception as e:  # a launch that does not fit (shared memory, registers) is a row too
                        rows.append(dict(**launch, error=repr(e)[:200]))
                        continue
                    rows.append(dict(**launch, ms=t, of_roofline=floor_ms / t))
    return rows


def bench(shapes, device: torch.device, bandwidth: float, with_sweep: bool = False) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    scale = (NOPE + ROPE) ** -0.5
    rows = []
    for batch, ctx in shapes:
        q_latent, q_pe, kv, tables, seq_lens = latent_batch(batch, ctx, device, gen)

        def step():
            return kernels.mla_decode(q_latent, q_pe, kv, tables, seq_lens, scale)

        t = gpu_ms(step) if device.type == "cuda" else cpu_ms(step)
        # the first sequence against the fp32 reference: a fast kernel that is wrong counts for nothing
        own = tables[0].long()  # its blocks only: the whole pool in fp32 would be 10 GB at batch 128 x 32K
        own_table = torch.arange(own.shape[0], dtype=torch.int32, device=device)[None]
        want = kernels.reference.mla_decode(q_latent[:1].float(), q_pe[:1].float(), kv[own].float(), own_table,
                                            seq_lens[:1], scale)
        err = float((step()[:1].float() - want).abs().max())
        latent_bytes = batch * ctx * (LATENT + ROPE) * kv.element_size()
        floor_ms = latent_bytes / (bandwidth * GB) * 1e3
        row = dict(batch=batch, context=ctx, ms=t, latent_bytes=latent_bytes, roofline_ms=floor_ms,
                   of_roofline=floor_ms / t, latent_gbps=latent_bytes / (t * 1e-3) / GB, max_abs_err_seq0=err)
        if device.type == "cuda":
            from tierkv.kernels import mla

            heads_per_program, splits, block_n = mla.choose_launch(batch, HEADS, tables.shape[1] * PAGE, device)
            row["launch"] = dict(heads_per_program=heads_per_program, num_splits=splits, block_n=block_n)
            if with_sweep:
                row["sweep"] = sweep((q_latent, q_pe, kv, tables, seq_lens, scale), splits, floor_ms)
                best = max((r for r in row["sweep"] if "ms" in r), key=lambda r: r["of_roofline"], default=None)
                print(f"  sweep best: {best}", flush=True)
        rows.append(row)
        print(f"B={batch:4d} ctx={ctx:6d}  {t:8.3f} ms  roofline {floor_ms:8.3f} ms  "
              f"{100 * floor_ms / t:5.1f}% of it  ({latent_bytes / (t * 1e-3) / GB:6.0f} GB/s of latent)  "
              f"max |err| {err:.1e}", flush=True)
        del q_latent, q_pe, kv, tables, seq_lens
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder of the JSON (default benchmarks/results)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script runs")
    ap.add_argument("--sweep", action="store_true", help="also time launch choices around the automatic one")
    ap.add_argument("--shapes", default=None, metavar="B:CTX,...", help="these (batch, context) cases only, and "
                    "the JSON named after them (default: SHAPES)")
    args = ap.parse_args(argv)
    if args.smoke:
        device, shapes, copy_size = torch.device("cpu"), SMOKE_SHAPES, 1 << 24
    elif torch.cuda.is_available():
        device, shapes, copy_size = torch.device("cuda"), SHAPES, 2 << 30
    else:
        sys.exit("bench_mla_decode needs a CUDA GPU (or --smoke)")
    if args.shapes:
        shapes = [tuple(int(x) for x in case.split(":")) for case in args.shapes.split(",")]
    bandwidth = copy_gbps(device, copy_size)
    print(f"copy: {bandwidth:.0f} GB/s (read + written)", flush=True)
    figures = dict(
        benchmark="bench_mla_decode", smoke=args.smoke,
        backend=kernels.backend_for(torch.empty(0, device=device)),
        shape=dict(heads=HEADS, kv_lora_rank=LATENT, rope=ROPE, nope=NOPE, block_size=PAGE,
                   dtype=str(DT if device.type == "cuda" else torch.float32)),
        copy_gbps=bandwidth,
        roofline="latent bytes of the batch / copy_gbps (a copy's read + written bytes per second)",
        decode=bench(shapes, device, bandwidth, args.sweep),
    )
    name = "bench_mla_decode" + ("-smoke" if args.smoke else "")
    if args.shapes:
        name += "-" + args.shapes.replace(":", "x").replace(",", "-")
    path = write_results(name, figures, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
