"""bench_index: what prefix lookup costs on the CPU, per block, for a 128K-token prompt.

Measures, for 16-token blocks: converting the token list, chained hashing, `match` of a prompt
that misses entirely, `match` of one that hits every block, and committing the prompt's blocks
to the index (`store` with a one-element KV layout, so the payload copy is negligible).
Writes benchmarks/results/bench_index-<machine>.json. No target yet (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common import write_results
from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.hashing import hash_blocks, token_bytes


def best_of(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls (machines here are shared and noisy)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128 * 1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()

    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(args.tokens)]
    other = [rng.randrange(128_000) for _ in range(args.tokens)]
    blocks = args.tokens // args.block_size
    # One element per token and layer: the index is what is measured, not the payload copy.
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, block_size=args.block_size)
    cache = TieredKVCache(layout, CacheConfig(l1=(blocks + 1) * layout.bytes_per_block), device="cpu", model="bench")
    kv = torch.zeros(layout.kv_shape(args.tokens), dtype=layout.dtype)
    ns = cache.namespace()
    tb = token_bytes(tokens)

    seconds = {
        "token_bytes": best_of(lambda: token_bytes(tokens), args.repeats),
        "hash": best_of(lambda: hash_blocks(tb, args.block_size, ns), args.repeats),
        "match_miss": best_of(lambda: cache.match(other), args.repeats),
    }
    t = time.perf_counter()
    cache.store(tokens, kv)
    seconds["store_first"] = time.perf_counter() - t
    seconds["match_hit"] = best_of(lambda: cache.match(tokens), args.repeats)
    assert cache.match(tokens).tokens == (args.tokens - 1) // args.block_size * args.block_size

    us_per_block = {k: v / blocks * 1e6 for k, v in seconds.items()}
    print(f"{args.tokens} tokens, {blocks} blocks of {args.block_size}")
    print(f"{'step':<14}{'ms total':>10}{'us/block':>10}")
    for k, v in seconds.items():
        print(f"{k:<14}{v * 1e3:>10.2f}{us_per_block[k]:>10.3f}")
    path = write_results("bench_index", {"tokens": args.tokens, "block_size": args.block_size, "blocks": blocks,
                                         "seconds": seconds, "us_per_block": us_per_block}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
