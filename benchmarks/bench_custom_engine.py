"""bench_custom_engine: L1 <-> L2 block moves into an engine's own registered KV buffers vs pinned memcpy.

The engine of examples/custom_engine.py keeps its KV in its own tensors and registers them with
tierkv (`kv_caches=`, here in vLLM's layout, FlashInfer's HND and tierkv's own). Through the
public API only, on a Llama-3.1-8B KV shape (32 layers, 8 KV heads of 128, bf16, 16-token
blocks: 2 MiB a block), for a prompt of `--blocks` blocks:
  save: `commit` of a freshly computed prompt under write-through copies its blocks L1 -> L2
        (timed from the commit call until the copy is complete);
  save by layer: `save_layer` for each of the 32 layers, then `commit` (same bytes, same end);
  load: after `evict("l1")`, `admit` brings the blocks L2 -> L1 (timed until `seq.wait()` holds),
        and the share of that time after which layer 0 is usable (`wait_for_layer(0)`); `lookup`
        is the part of it that hashes and finds the blocks (`match` timed alone), and
        `load_matched` times `allocate(match=...)` with the lookup made beforehand, the way
        vLLM's scheduler looks a request up before the step that loads it;
each against one contiguous pinned cudaMemcpy of the same bytes measured in the same run, with
L1 and L2 slots in order (a fresh cache) and scattered (both free lists shuffled, as after churn).
A move goes by staged DMA or by the GPU's own copy through unified addressing, by the average DMA
length (tierkv.transfer.MIN_DMA_BYTES), where staged DMA is on (tierkv.transfer.DMA_MOVES, the
default); `--compare-paths` also times each way forced, in vLLM's layout.
Target (BENCHMARKS.md): >= 90% of the memcpy both ways. Needs CUDA.
Writes benchmarks/results/bench_custom_engine-<machine>.json.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from common import write_results
from shapes import LLAMA_3_1_8B
from tierkv import CacheConfig, TieredKVCache, transfer

LAYOUT = LLAMA_3_1_8B
L, _, BS, H, D = LAYOUT.block_shape


def buffers(kind: str, blocks: int):
    """`blocks` blocks of engine KV in `kind`: a KV_LAYOUTS name, or vllm_paged_nhd / vllm_paged_hnd
    (vLLM 0.32's CUDA pages, views of one backing buffer in its LBNHC / LBHNC order)."""
    if kind == "vllm_paged_nhd":
        backing = torch.empty(L, blocks, BS, H, 2 * D, dtype=LAYOUT.dtype, device="cuda")
        return [backing[i].transpose(1, 2) for i in range(L)]
    if kind == "vllm_paged_hnd":
        backing = torch.empty(L, blocks, H, BS, 2 * D, dtype=LAYOUT.dtype, device="cuda")
        return [backing[i] for i in range(L)]
    if kind == "vllm":
        return [torch.empty(2, blocks, BS, H, D, dtype=LAYOUT.dtype, device="cuda") for _ in range(L)]
    if kind == "flashinfer_hnd":
        return [torch.empty(blocks, 2, H, BS, D, dtype=LAYOUT.dtype, device="cuda") for _ in range(L)]
    return torch.empty(L, blocks, 2, BS, H, D, dtype=LAYOUT.dtype, device="cuda")  # tierkv


def kv_layout_of(kind: str) -> str:
    return "vllm_paged" if kind.startswith("vllm_paged") else kind


def memcpy_seconds(nbytes: int, repeats: int) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[name] = min(times[1:])
    return out


def run(kind: str, blocks: int, scattered: bool, repeats: int) -> dict:
    kv = buffers(kind, 2 * blocks)
    cache = TieredKVCache(LAYOUT, CacheConfig(l2=4 * blocks * LAYOUT.bytes_per_block, write_policy="write_through"),
                          kv_caches=kv, kv_layout=kv_layout_of(kind), model="bench")
    if scattered:  # slots handed out in random order, as after churn
        for free in (cache.l1.free, cache.l2.free):
            random.Random(0).shuffle(free._stack)
    times: dict[str, list[float]] = {"save": [], "save_by_layer": [], "load": [], "load_layer0": [],
                                     "save_copy": [], "load_copy": [], "lookup": [], "load_matched": []}
    mover = cache.tiers.mover
    for r in range(repeats + 1):
        tokens = [r * 1_000_000 + i for i in range(blocks * BS + 1)]  # a new prompt each round
        for by_layer in (False, True):
            tokens[0] += 1  # and each way
            seq = cache.admit(tokens)
            # the forward wrote these blocks (contents do not matter for the copy)
            torch.cuda.synchronize()
            mover._timings.clear()  # bounded: a count of it stops growing once full
            t = time.perf_counter()
            if by_layer:
                for layer in range(L):
                    cache.save_layer(layer, [seq])
            cache.commit(seq, tokens)
            cache.synchronize()
            times["save_by_layer" if by_layer else "save"].append(time.perf_counter() - t)
            if not by_layer:
                times["save_copy"].append(copy_seconds(mover, len(mover._timings)))
            cache.free(seq)
        cache.evict("l1")  # every block of both prompts is in L2 only now
        torch.cuda.synchronize()
        t = time.perf_counter()
        found = cache.match(tokens)  # the lookup alone (hashing and walking the blocks): part of admit
        times["lookup"].append(time.perf_counter() - t)
        # as vLLM's scheduler does it: the lookup made before the step (get_num_new_matched_tokens),
        # the load timed from the allocation that starts it
        torch.cuda.synchronize()
        t = time.perf_counter()
        seq = cache.allocate(match=found)
        seq.wait()
        torch.cuda.synchronize()
        times["load_matched"].append(time.perf_counter() - t)
        cache.free(seq)
        cache.evict("l1")
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # the load's time from the admit call, lookup included
        t = time.perf_counter()
        seq = cache.admit(tokens)
        cache.wait_for_layer(0, [seq])
        first.record()
        seq.wait()
        last.record()
        torch.cuda.synchronize()
        times["load"].append(time.perf_counter() - t)
        times["load_copy"].append(copy_seconds(mover))
        assert seq.num_cached_tokens == blocks * BS, seq.num_cached_tokens
        times["load_layer0"].append(start.elapsed_time(first) / max(start.elapsed_time(last), 1e-9))
        cache.free(seq)
        cache.evict("l1")
        cache.evict("l2")
    cache.close()
    return {k: min(v[1:]) for k, v in times.items()}  # the first round compiles and warms up


def copy_seconds(mover, moves: int = 1) -> float:
    """GPU time of the mover's latest `moves` moves (a commit copies in chunks), from the first one's
    start to the last one's end, by their own CUDA events (no host work before the first in it)."""
    start, end = mover._timings[-moves][0], mover._timings[-1][1]
    return start.elapsed_time(end) / 1e3


def check_bytes(kind: str) -> bool:
    """What was timed moves the right bytes: blocks written into the engine's buffers come back
    from L2 into other slots bit for bit."""
    kv = buffers(kind, 64)
    cache = TieredKVCache(LAYOUT, CacheConfig(l2=64 * LAYOUT.bytes_per_block), kv_caches=kv,
                          kv_layout=kv_layout_of(kind), model="check")
    tokens = list(range(20 * BS + 1))
    seq = cache.admit(tokens)
    want = torch.randn(20, L, 2, BS, H, D, device="cuda").to(LAYOUT.dtype)
    cache.l1.write(seq.slots[:20], want)
    cache.commit(seq, tokens)
    cache.free(seq)
    cache.evict("l1")
    for t in (kv if isinstance(kv, list) else [kv]):
        t.zero_()
    seq = cache.admit(tokens)
    seq.wait()
    ok = torch.equal(cache.l1.read(seq.slots[:20]), want)
    cache.close()
    return ok


def host_memory(blocks: int, repeats: int) -> dict:
    """GB/s of one copy_planes of `blocks` blocks from pinned host memory into vLLM buffers, and of
    the DMA memcpy, for host memory made two ways: tierkv's HostPool (malloc'd, faulted in on all
    cores, cudaHostRegister) and torch's pinned allocator (cudaHostAlloc).
    Says whether the GPU's reads of L2 depend on how its memory was made."""
    from tierkv import kernels
    from tierkv.tiers import HostPool
    from tierkv.tiers.gpu import DevicePool, block_planes

    nbytes = blocks * LAYOUT.bytes_per_block
    l1 = DevicePool.of_buffers(LAYOUT, buffers("vllm", blocks), "vllm")

    out = {}
    pool = HostPool(LAYOUT, blocks, pin=True)
    made = {"hostpool": pool.kv.view(torch.uint8).view(-1),
            "torch_pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)}
    slots = torch.randperm(blocks, device="cuda")
    rows = torch.arange(blocks, device="cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for name, host in made.items():
        table = block_planes(host.view(LAYOUT.dtype).view(blocks, *LAYOUT.block_shape), "cuda")
        res = {}
        for what, fn in (("copy_planes_h2d", lambda: kernels.copy_planes(table, rows, l1.planes, slots)),
                         ("copy_planes_d2h", lambda: kernels.copy_planes(l1.planes, slots, table, rows)),
                         ("memcpy_h2d", lambda: dev.copy_(host, non_blocking=True)),
                         ("memcpy_d2h", lambda: host.copy_(dev, non_blocking=True))):
            best = float("inf")
            for _ in range(repeats + 1):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                best = min(best, a.elapsed_time(b) / 1e3)
            res[what] = nbytes / best / 1e9
        out[name] = res
        print(f"host memory {name:<13} " + "  ".join(f"{k} {v:.1f}" for k, v in res.items()) + " GB/s")
    try:
        out["anon_huge_pages"] = next(line.split(":")[1].strip() for line in open("/proc/meminfo")
                                      if line.startswith("AnonHugePages"))
        out["thp_enabled"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        pass
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1024, help="blocks of the prompt (2 MiB each)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layouts", default="vllm,vllm_paged_nhd,vllm_paged_hnd,flashinfer_hnd,tierkv")
    ap.add_argument("--host-memory", action="store_true", help="also compare ways of making the pinned L2")
    ap.add_argument("--compare-paths", action="store_true", help="also time staged DMA and the GPU's copy forced")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_custom_engine needs CUDA")
    nbytes = args.blocks * LAYOUT.bytes_per_block
    memcpy = memcpy_seconds(nbytes, args.repeats)
    results = {}
    print(f"{args.blocks} blocks, {nbytes / 2**30:.2f} GiB; memcpy d2h {nbytes / memcpy['d2h'] / 1e9:.1f} GB/s, "
          f"h2d {nbytes / memcpy['h2d'] / 1e9:.1f} GB/s")
    print(f"{'layout':<16}{'slots':<11}{'move':<15}{'GB/s':>7}{'of memcpy':>11}")
    default = transfer.MIN_DMA_BYTES, transfer.DMA_MOVES
    paths = {"auto": default, "dma": (0, True), "gpu_copy": (default[0], False)}
    cases = [(kind, "auto") for kind in args.layouts.split(",")]
    cases += [("vllm", "dma"), ("vllm", "gpu_copy")] if args.compare_paths else []
    for kind, path_name in cases:
        transfer.MIN_DMA_BYTES, transfer.DMA_MOVES = paths[path_name]
        for scattered in (False, True):
            s = run(kind, args.blocks, scattered, args.repeats)
            row = {"seconds": s, "GBps": {}, "ratio_to_memcpy": {}, "layer0_share_of_load": s["load_layer0"]}
            for move in ("save", "save_by_layer", "load", "load_matched", "save_copy", "load_copy"):
                base = memcpy["d2h" if move.startswith("save") else "h2d"]
                row["GBps"][move] = nbytes / s[move] / 1e9
                row["ratio_to_memcpy"][move] = base / s[move]
                print(f"{kind + ('' if path_name == 'auto' else '/' + path_name):<16}{'scattered' if scattered else 'in order':<11}{move:<15}"
                      f"{row['GBps'][move]:>7.1f}{row['ratio_to_memcpy'][move]:>11.1%}")
            print(f"{'':<27}layer 0 usable after {s['load_layer0']:.0%} of the load; "
                  f"lookup {s['lookup'] * 1e3:.2f} ms of it")
            suffix = "" if path_name == "auto" else f"-{path_name}"
            results[f"{kind}-{'scattered' if scattered else 'in_order'}{suffix}"] = row
    transfer.MIN_DMA_BYTES, transfer.DMA_MOVES = default
    checks = {kind: check_bytes(kind) for kind in args.layouts.split(",")}
    memory = host_memory(args.blocks, args.repeats) if args.host_memory else None
    print(f"bytes checked: {checks}")
    path = write_results("bench_custom_engine", {
        "target": ">= 90% of one contiguous pinned memcpy, both ways, into registered buffers",
        "blocks": args.blocks, "bytes": nbytes, "bytes_per_block": LAYOUT.bytes_per_block,
        "memcpy_seconds": memcpy, "memcpy_GBps": {k: nbytes / v / 1e9 for k, v in memcpy.items()},
        "min_dma_bytes": default[0], "dma_moves": default[1], "results": results, "bytes_checked": checks, "host_memory_GBps": memory,
        "timing": "save/save_by_layer/load/load_matched: wall clock from the API call (commit, admit, allocate) until the copy is "
                  "complete (cache.synchronize / seq.wait plus a device sync), hashing and bookkeeping included; "
                  "save_copy/load_copy: the copy's own CUDA events; best of the repeats after a warm-up round; "
                  "memcpy: wall clock around one copy_ and a device sync",
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
