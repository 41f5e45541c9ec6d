"""bench_planes: copy_planes (kernels/plane_copy.py) between paged KV layouts and a pinned L2, vs memcpy.

Llama-3.1-8B KV (32 layers, 8 kv heads, head_dim 128, bf16, 16-token blocks: 2 MiB a block), 512
blocks (1 GiB) a move. L2 is a pinned host block-first pool [N, layers, 2, bs, h, d], read or
written by the GPU itself (unified addressing, no copy engine). L1 is tierkv's layer-first pool
or vLLM's per-layer tensors [2, N, bs, h, d], at scattered slots. Cases:
  h2d / d2h, whole blocks (all 64 planes in one launch) or per layer (32 launches of 2 planes,
  back to back on one stream), L2 slots in one run or scattered;
  d2d: vLLM layout -> a block-first device staging buffer, vs a torch d2d copy of the same bytes.
Each against one contiguous copy of the same bytes (torch .copy_(non_blocking=True), pinned host
<-> device, or device -> device), timed with CUDA events after warm-up: best and median of
--repeats. GB/s = bytes copied / time.
Programs: an h2d and a d2h move on at most G programs (copy_planes' `programs`; over PCIe its
default is plane_copy.HOST_PROGRAMS_PER_SM of the SMs), alone and beside a decode step's linear
layers (Llama-3.1-8B's, 8 rows, bf16, on another stream), and the copy engine's memcpy of the
same bytes likewise: the step's time beside the copy against alone, and the copy's GB/s
meanwhile. Loads land while the server decodes; a copy that fills the SMs slows the step it
overlaps (H200, bench_rounds at b964e45: 22 ms against 6.6 ms).
Writes benchmarks/results/bench_planes-<machine>.json (or --out DIR) and prints a table. Needs CUDA.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import write_results
from tierkv.kernels import PlaneTable, copy_planes, plane_copy

LAYERS, HEADS, DIM, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
PLANES = 2 * LAYERS


def cuda_times(fn, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """(best, median) seconds of fn() on the current stream, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[0], times[len(times) // 2]


def layer_first(pool: torch.Tensor) -> PlaneTable:
    """tierkv's L1 pool [layers, N, 2, bs, h, d]."""
    return PlaneTable([pool[l, :, c] for l in range(LAYERS) for c in range(2)])


def per_layer(tensors: list[torch.Tensor]) -> PlaneTable:
    """vLLM: one tensor [2, N, bs, h, d] per layer, each its own allocation."""
    return PlaneTable([t[c] for t in tensors for c in range(2)])


def block_first(blocks: torch.Tensor) -> PlaneTable:
    """[N, layers, 2, bs, h, d]: tierkv's L2 pool (pinned host) or a device staging buffer."""
    device = "cuda" if blocks.is_pinned() else None
    return PlaneTable([blocks[:, l, c] for l in range(LAYERS) for c in range(2)], device=device)


def whole(src, src_slots, dst, dst_slots):
    return lambda: copy_planes(src, src_slots, dst, dst_slots)


def layer_by_layer(src, src_slots, dst, dst_slots):
    def go():
        for l in range(LAYERS):
            copy_planes(src, src_slots, dst, dst_slots, (2 * l, 2 * l + 2))
    return go


def check(src: PlaneTable, src_slots, dst: PlaneTable, dst_slots) -> None:
    """What was timed moved the right bytes: a few blocks of a few planes compared on the GPU."""
    torch.cuda.synchronize()
    n = src_slots.shape[0]
    for i in (0, n // 3, n - 1):
        for p in (0, 33, PLANES - 1):
            got = dst.planes[p][int(dst_slots[i])].to("cuda")
            want = src.planes[p][int(src_slots[i])].to("cuda")
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (i, p)


def launch_us(fn, times: int = 20) -> float:
    """Host microseconds a call of fn takes to return (launches only; the GPU runs behind)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(times):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / times * 1e6


def decode_linears(rows: int = 8, layers: int = LAYERS):
    """A Llama-3.1-8B decode step's linear layers at `rows` sequences (qkv, o, gate+up, down, per
    layer): reading ~13 GiB of bf16 weights, memory-bound like the real step."""
    shapes = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
    weights = [torch.randn(k, n, dtype=DTYPE, device="cuda") * 0.01 for k, n in shapes]
    xs = {k: torch.randn(rows, k, dtype=DTYPE, device="cuda") for k, _ in shapes}

    def step():
        for _ in range(layers):  # one set of weights read once per layer, as a layer's own would be
            for w in weights:
                torch.mm(xs[w.shape[0]], w)
    return step


def beside(compute, copy, repeats: int) -> tuple[float, float]:
    """(median seconds of `compute` on the current stream while `copy` runs on a side stream,
    seconds of that copy): each repeat starts the copy, then the compute, on one side of an event."""
    side, spans, copies = torch.cuda.Stream(), [], []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            c0.record()
            copy()
            c1.record()
        s0.record()
        compute()
        s1.record()
        torch.cuda.synchronize()
        spans.append(s0.elapsed_time(s1) / 1e3)
        copies.append(c0.elapsed_time(c1) / 1e3)
    spans, copies = sorted(spans[1:]), sorted(copies[1:])  # the first warms up
    return spans[len(spans) // 2], copies[len(copies) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_planes needs CUDA")
    n = args.blocks
    block_bytes = PLANES * BS * HEADS * DIM * DTYPE.itemsize
    nbytes = n * block_bytes
    g = torch.Generator().manual_seed(0)

    l2 = torch.empty(n, LAYERS, 2, BS, HEADS, DIM, dtype=DTYPE, pin_memory=True)
    l2.copy_(torch.randn(l2.shape, dtype=DTYPE, device="cuda"))
    l1_blocks = 2 * n
    pool = torch.randn(LAYERS, l1_blocks, 2, BS, HEADS, DIM, dtype=DTYPE, device="cuda")
    vllm = [torch.randn(2, l1_blocks, BS, HEADS, DIM, dtype=DTYPE, device="cuda") for _ in range(LAYERS)]
    staging = torch.empty(n, LAYERS, 2, BS, HEADS, DIM, dtype=DTYPE, device="cuda")
    host_flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_flat2 = torch.empty_like(dev_flat)
    tables = {"tierkv_l1": layer_first(pool), "vllm": per_layer(vllm)}
    l2_table, staging_table = block_first(l2), block_first(staging)

    l1_slots = torch.randperm(l1_blocks, generator=g)[:n].cuda()  # scattered, as after churn
    l2_slots = {"run": torch.arange(n).cuda(), "scattered": torch.randperm(n, generator=g).cuda()}

    seconds: dict[str, tuple[float, float]] = {}
    seconds["memcpy_h2d"] = cuda_times(lambda: dev_flat.copy_(host_flat, non_blocking=True), args.repeats)
    seconds["memcpy_d2h"] = cuda_times(lambda: host_flat.copy_(dev_flat, non_blocking=True), args.repeats)
    seconds["memcpy_d2d"] = cuda_times(lambda: dev_flat2.copy_(dev_flat, non_blocking=True), args.repeats)
    launches = {}
    for l1_name, l1 in tables.items():
        for order, slots in l2_slots.items():
            for how, make in (("whole", whole), ("per_layer", layer_by_layer)):
                h2d = make(l2_table, slots, l1, l1_slots)
                seconds[f"h2d_{how}_{l1_name}_l2_{order}"] = cuda_times(h2d, args.repeats)
                check(l2_table, slots, l1, l1_slots)
                d2h = make(l1, l1_slots, l2_table, slots)
                seconds[f"d2h_{how}_{l1_name}_l2_{order}"] = cuda_times(d2h, args.repeats)
                check(l1, l1_slots, l2_table, slots)
                if order == "run" and l1_name == "vllm":
                    launches[how] = launch_us(h2d, 5)
    staged = torch.arange(n).cuda()
    for how, make in (("whole", whole), ("per_layer", layer_by_layer)):
        d2d = make(tables["vllm"], l1_slots, staging_table, staged)
        seconds[f"d2d_{how}_vllm_to_block_first"] = cuda_times(d2d, args.repeats)
        check(tables["vllm"], l1_slots, staging_table, staged)

    # bytes a program moves (plane_copy._TILE_BYTES): whole-block moves at other tile sizes
    sweep = {}
    default_tile = plane_copy._TILE_BYTES
    for kib in (4, 8, 16, 32):  # 32 KiB is one whole plane of a block here
        plane_copy._TILE_BYTES = kib << 10
        for name, fn in (("h2d", whole(l2_table, l2_slots["scattered"], tables["vllm"], l1_slots)),
                         ("d2h", whole(tables["vllm"], l1_slots, l2_table, l2_slots["scattered"])),
                         ("d2d", whole(tables["vllm"], l1_slots, staging_table, staged))):
            sweep[f"{name}_whole_vllm_tile_{kib}kib"] = nbytes / cuda_times(fn, args.repeats)[0] / 1e9
    plane_copy._TILE_BYTES = default_tile

    # programs: a move over PCIe on G programs, alone and beside a decode step's linear layers
    step = decode_linears()
    step_alone = cuda_times(step, args.repeats)[1]
    programs = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = max(1, int(sms * plane_copy.HOST_PROGRAMS_PER_SM))
    for count in sorted({4, 8, 16, default, 2 * default, sms, 0}):
        label = "one per item" if count == 0 else f"{count}" + (" (default)" if count == default else "")
        for name, src, ss, dst, ds in (("h2d", l2_table, l2_slots["scattered"], tables["vllm"], l1_slots),
                                       ("d2h", tables["vllm"], l1_slots, l2_table, l2_slots["scattered"])):
            def moves(src=src, ss=ss, dst=dst, ds=ds, cap=count or 1 << 30):  # 4 moves: they outlast the step
                for _ in range(4):
                    plane_copy.copy_planes(src, ss, dst, ds, programs=cap)
            alone = cuda_times(moves, args.repeats)[1]
            step_beside, copies_beside = beside(step, moves, args.repeats)
            programs[f"{name} {label}"] = dict(
                programs=count or None, GBps_alone=4 * nbytes / alone / 1e9,
                GBps_beside_step=4 * nbytes / copies_beside / 1e9, step_ms_alone=step_alone * 1e3,
                step_ms_beside=step_beside * 1e3, step_slowdown=step_beside / step_alone)
    # the copy engine's own copy of the same bytes beside the step: what a move costs the step with no SMs
    for name, dst_t, src_t in (("h2d", dev_flat, host_flat), ("d2h", host_flat, dev_flat)):
        def memcpys(dst_t=dst_t, src_t=src_t):
            for _ in range(4):
                dst_t.copy_(src_t, non_blocking=True)
        alone = cuda_times(memcpys, args.repeats)[1]
        step_beside, copies_beside = beside(step, memcpys, args.repeats)
        programs[f"{name} copy engine"] = dict(
            programs=0, GBps_alone=4 * nbytes / alone / 1e9,
            GBps_beside_step=4 * nbytes / copies_beside / 1e9, step_ms_alone=step_alone * 1e3,
            step_ms_beside=step_beside * 1e3, step_slowdown=step_beside / step_alone)
    del step

    gbps = {k: {"best": nbytes / best / 1e9, "median": nbytes / median / 1e9} for k, (best, median) in seconds.items()}
    ratio = {}
    print(f"{n} blocks of {block_bytes >> 20} MiB ({nbytes / 2**30:.2f} GiB) a move; GB/s of bytes copied")
    print(f"{'case':<44}{'best GB/s':>10}{'median':>9}{'memcpy':>9}{'ratio':>8}")
    for k, v in gbps.items():
        base = gbps["memcpy_" + k.removeprefix("memcpy_").split("_")[0]]
        ratio[k] = {"best": v["best"] / base["best"], "median": v["median"] / base["median"]}
        print(f"{k:<44}{v['best']:>10.1f}{v['median']:>9.1f}{base['best']:>9.1f}{ratio[k]['best']:>8.1%}")
    print("tile size sweep (best GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in sweep.items()))
    print(f"host time to launch one h2d move: whole {launches['whole']:.0f} us, "
          f"per layer (32 launches) {launches['per_layer']:.0f} us")
    print(f"programs of a move over PCIe, and a decode step's linear layers beside it "
          f"({step_alone * 1e3:.2f} ms alone):")
    for k, v in programs.items():
        print(f"  {k:<22} {v['GBps_alone']:6.1f} GB/s alone, {v['GBps_beside_step']:6.1f} beside the step; "
              f"step {v['step_ms_beside']:6.2f} ms beside it ({v['step_slowdown']:.2f}x)")
    figures = {
        "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "block_size": BS, "dtype": str(DTYPE),
                  "block_bytes": block_bytes, "blocks": n, "bytes_per_move": nbytes, "l1_blocks": l1_blocks},
        "method": "CUDA events around each move after 2 warm-up calls; best and median of "
                  f"{args.repeats}; GB/s = bytes copied / time; ratio to the same direction's memcpy "
                  "(one contiguous torch .copy_ of the same bytes)",
        "seconds": {k: {"best": b, "median": m} for k, (b, m) in seconds.items()},
        "GBps": gbps,
        "ratio_to_memcpy": ratio,
        "host_launch_us": launches,
        "tile_sweep_best_GBps": sweep,
        "programs_over_pcie": programs,
    }
    path = write_results("bench_planes", figures, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
