"""bench_slot_runs: how long are the runs of neighbouring L2 slots that real churn leaves?

An L1<->L2 move copies each run of neighbouring L2 slots in one DMA (transfer.py), and takes the
copy engines only where a DMA averages MIN_DMA_BYTES: for a Llama-3.1-8B block (2 MiB) loaded in
4 groups of layers, runs of 2 blocks or more; shorter runs go to the GPU's own copy (~89% of a
memcpy on the H200). `bench_custom_engine`'s "scattered" case shuffles both free lists, which
leaves runs of ~1.3 blocks: the worst case. This replays the Mooncake conversation trace through
a CPU TieredKVCache (admit -> commit -> free, one request after another, as bench_policies does)
and records the L2 slots of every move, to see what tierkv's own slot allocation gives instead.

Each trace block (512 tokens) becomes 512 distinct token ids, so tierkv's 16-token blocks chain as
the trace's prefixes do. The layout carries no payload worth timing: this file never measures time.
Usage: python benchmarks/bench_slot_runs.py [--requests 3000] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from tierkv import CacheConfig, KVLayout, TieredKVCache  # noqa: E402
from tierkv.tiering import L1_TO_L2, L2_TO_L1  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared/data/mooncake/conversation_trace.jsonl"
TRACE_BLOCK = 512  # tokens a trace hash_id stands for
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=16, dtype=torch.float32)
DMA_RUN = 2  # blocks a run needs for its DMA to average MIN_DMA_BYTES (2 MiB blocks, 4 layer groups)
# (L1 blocks, L2 blocks, write policy): L1 from ~1.3 to ~10 of the trace's mean prompts, L2 8-64x L1
CONFIGS = [(1024, 65536, "write_back"), (2048, 16384, "write_back"), (2048, 16384, "write_through"),
           (8192, 65536, "write_back")]


def runs(slots: list[int]) -> int:
    """How many runs of consecutive slot numbers `slots` holds (one DMA each)."""
    s = sorted(slots)
    return 1 + sum(b != a + 1 for a, b in itertools.pairwise(s))


def summary(moves: list[list[int]]) -> dict:
    counted = [(len(m), runs(m)) for m in moves]  # (blocks, runs) of each move
    blocks = sum(n for n, _ in counted)
    n_runs = sum(r for _, r in counted)
    dma_blocks = sum(n for n, r in counted if n >= DMA_RUN * r)
    return {"moves": len(moves), "blocks": blocks, "mean_run_blocks": blocks / n_runs if n_runs else None,
            "share_of_blocks_in_dma_moves": dma_blocks / blocks if blocks else None}


def replay(requests: list[dict], l1_blocks: int, l2_blocks: int, write_policy: str) -> dict:
    bpb = LAYOUT.bytes_per_block
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=l1_blocks * bpb, l2=l2_blocks * bpb, write_policy=write_policy),
                          model="bench-slot-runs")
    moves: dict[int, list[list[int]]] = {L1_TO_L2: [], L2_TO_L1: []}
    apply = cache.tiers._apply  # the one door every L1<->L2 move goes through: record its L2 side

    def recording(kind: int, src: list[int], dst: list[int]):
        if kind in moves:
            moves[kind].append(list(dst if kind == L1_TO_L2 else src))
        return apply(kind, src, dst)

    cache.tiers._apply = recording
    skipped = 0
    for q in requests:
        tokens = [h * TRACE_BLOCK + i for h in q["hash_ids"] for i in range(TRACE_BLOCK)][: q["input_length"]]
        if cache.blocks_needed(len(tokens)) > l1_blocks:
            skipped += 1  # larger than all of L1: tierkv's engine streams those, admit refuses them
            continue
        seq = cache.admit(tokens)
        cache.commit(seq, tokens)
        cache.free(seq)
    cache.close()
    return {"l1_blocks": l1_blocks, "l2_blocks": l2_blocks, "write_policy": write_policy, "skipped": skipped,
            "saves": summary(moves[L1_TO_L2]), "loads": summary(moves[L2_TO_L1])}


def shuffled_case(blocks: int = 1024, pool: int = 4096, seed: int = 0) -> dict:
    """bench_custom_engine's scattered case: `blocks` slots taken from a shuffled free list of `pool`."""
    free = list(range(pool))
    random.Random(seed).shuffle(free)
    return summary([free[:blocks]])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--requests", type=int, default=3000, help="the trace's first N requests")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with open(args.trace) as f:
        requests = [json.loads(line) for _, line in zip(range(args.requests), f)]
    results = [replay(requests, *c) for c in CONFIGS]
    for r in results:
        for name in ("saves", "loads"):
            s = r[name]
            print(f"L1 {r['l1_blocks']:>5} L2 {r['l2_blocks']:>5} {r['write_policy']:<13} {name}: {s['moves']:>5} moves, "
                  f"{s['blocks']:>8} blocks, mean run {s['mean_run_blocks'] or 0:7.1f}, "
                  f"in DMA-length moves {100 * (s['share_of_blocks_in_dma_moves'] or 0):5.1f}%")
    shuffled = shuffled_case()
    print(f"bench_custom_engine's shuffled free lists: mean run {shuffled['mean_run_blocks']:.2f}")
    write_results("bench_slot_runs", {"trace": args.trace.name, "requests": len(requests),
                                      "block_size": LAYOUT.block_size, "dma_run_blocks": DMA_RUN,
                                      "configs": results, "shuffled_free_lists": shuffled}, args.out)


if __name__ == "__main__":
    main()
