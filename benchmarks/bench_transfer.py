"""bench_transfer: L1 <-> L2 block moves through tierkv's BlockMover vs one contiguous pinned copy.

For real model layouts and 16-token blocks, moves N blocks from scattered L1 slots to L2 slots
(in one run, and scattered) and back, timed with CUDA events around the whole move, against a
single cudaMemcpy of the same bytes between a contiguous device tensor and pinned host memory
measured in the same run. Target (BENCHMARKS.md): >= 95% both ways. Also the time to make a
--pin-gib L2 (HostPool: allocate, fault in, register with CUDA) against torch's pinned allocator
for the same bytes (which rounds up to a power of two). Needs CUDA.
Writes benchmarks/results/bench_transfer-<machine>.json.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import write_results
from shapes import LLAMA_3_1_8B, QWEN3_0_6B, SMOLLM2_135M
from tierkv import KVLayout
from tierkv.tiers import DevicePool, HostPool
from tierkv.transfer import BlockMover

LAYOUTS = {
    "llama-3.1-8b": LLAMA_3_1_8B,
    "qwen3-0.6b": QWEN3_0_6B,
    "smollm2-135m": SMOLLM2_135M,
}


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn` (which issues work on the current or the mover's stream and returns an event)."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        end = fn()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times[1:])[len(times[1:]) // 2]  # first call warms up


def bench_layout(layout: KVLayout, nbytes: int, repeats: int) -> dict:
    n = max(1, nbytes // layout.bytes_per_block)
    l1, l2 = DevicePool(layout, 2 * n, "cuda"), HostPool(layout, 2 * n, pin=True)
    mover = BlockMover(l1, l2)
    gen = torch.Generator().manual_seed(0)
    l1_slots = torch.randperm(2 * n, generator=gen)[:n].tolist()  # scattered, as after churn
    l2_run = list(range(n))  # one contiguous run of L2 slots
    l2_scattered = torch.randperm(2 * n, generator=gen)[:n].tolist()

    dev = torch.empty(n * layout.bytes_per_block, dtype=torch.uint8, device="cuda")
    host = torch.empty(n * layout.bytes_per_block, dtype=torch.uint8, pin_memory=True)

    def memcpy(dst, src):
        def go():
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return go

    def move(fn, *slots):
        return lambda: fn(*slots).event

    s = {
        "memcpy_d2h": timed(memcpy(host, dev), repeats),
        "memcpy_h2d": timed(memcpy(dev, host), repeats),
        "l1_to_l2_run": timed(move(mover.l1_to_l2, l1_slots, l2_run), repeats),
        "l2_to_l1_run": timed(move(mover.l2_to_l1, l2_run, l1_slots), repeats),
        "l1_to_l2_scattered": timed(move(mover.l1_to_l2, l1_slots, l2_scattered), repeats),
        "l2_to_l1_scattered": timed(move(mover.l2_to_l1, l2_scattered, l1_slots), repeats),
    }
    # correctness of what was timed: a round trip through scattered L2 slots returns the same bytes
    l1.kv.normal_()
    before = l1.kv[:, torch.tensor(l1_slots, device="cuda")].clone()
    mover.l1_to_l2(l1_slots, l2_scattered).synchronize()
    l1.kv.zero_()
    mover.l2_to_l1(l2_scattered, l1_slots).synchronize()
    assert torch.equal(l1.kv[:, torch.tensor(l1_slots, device="cuda")], before)

    gbps = {k: n * layout.bytes_per_block / v / 1e9 for k, v in s.items()}
    ratios = {
        k: gbps[k] / gbps["memcpy_d2h" if k.startswith("l1_to_l2") else "memcpy_h2d"]
        for k in gbps if not k.startswith("memcpy")
    }
    return {"blocks": n, "bytes_per_block": layout.bytes_per_block, "seconds": s, "GBps": gbps, "ratio_to_memcpy": ratios}


def bench_pinning(gib: int) -> dict:
    """Seconds to make a pinned L2 of `gib` GiB: tierkv's HostPool against torch's pinned allocator."""
    layout = LAYOUTS["llama-3.1-8b"]
    blocks = gib * 2**30 // layout.bytes_per_block
    torch.ones(1, device="cuda").sum().item()  # CUDA started before the clocks
    start = time.perf_counter()
    pool = HostPool(layout, blocks, pin=True)
    hostpool_s = time.perf_counter() - start
    assert pool.pinned, "HostPool could not pin its memory"
    pool.close()
    del pool
    start = time.perf_counter()
    t = torch.empty(blocks * layout.bytes_per_block, dtype=torch.uint8, pin_memory=True)
    torch_s = time.perf_counter() - start
    del t
    return {"gib": gib, "hostpool_s": hostpool_s, "torch_pinned_s": torch_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="bytes moved per measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pin-gib", type=int, default=12, help="size of the pinned pools timed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_transfer needs CUDA")
    results = {name: bench_layout(layout, int(args.gib * 2**30), args.repeats) for name, layout in LAYOUTS.items()}
    pinning = bench_pinning(args.pin_gib)
    print(f"pinning {args.pin_gib} GiB: HostPool {pinning['hostpool_s']:.2f} s, "
          f"torch pin_memory {pinning['torch_pinned_s']:.2f} s")
    print(f"{'layout':<14}{'move':<22}{'GB/s':>8}{'memcpy GB/s':>13}{'ratio':>8}")
    for name, r in results.items():
        for k, ratio in r["ratio_to_memcpy"].items():
            base = r["GBps"]["memcpy_d2h" if k.startswith("l1_to_l2") else "memcpy_h2d"]
            print(f"{name:<14}{k:<22}{r['GBps'][k]:>8.1f}{base:>13.1f}{ratio:>8.1%}")
    path = write_results("bench_transfer", {"target": ">= 95% of one contiguous pinned memcpy, both ways",
                                            "layouts": results, "pinning": pinning}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
