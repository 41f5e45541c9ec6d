"""bench_policies: replay a request trace through tierkv's own cache and compare eviction policies.

The trace format is Mooncake's (one JSON object a line: timestamp, input_length, output_length,
hash_ids of prefix blocks). Each hash_id becomes a block of token ids (the id repeated), so the
cache's chained hashes follow the trace's prefix structure. Every request runs the block-level
path a paged engine runs: match -> allocate (pins L1 hits, loads L2 hits) -> commit -> free, in a
real TieredKVCache with a payload-free layout (1 layer, 1 head, head_dim 1, fp16). Belady's MIN
(an oracle policy plugged into the same cache) and the infinite-capacity ceiling run alongside.
The cache has an L3 now (CacheConfig.l3: disk, Redis and S3 stores), but no store evicts through
an EvictionPolicy: the disk store keeps its own LRU of multi-block chunk files, Redis keys go by
TTL and the Redis server's maxmemory policy, S3 objects by the bucket's rules; and each costs real
I/O. So the multi-tier replay keeps L3 in `L3Ledger` here: a write-through set of block hashes
ordered by the policy under test, as L1 and L2 are.
This file never measures time and never asserts; tests/test_bench_policies.py checks its figures
on hand-made traces.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine_tag, write_results  # noqa: E402
from tierkv import CacheConfig, KVLayout, TieredKVCache  # noqa: E402
from tierkv.config import EVICTION_POLICIES  # noqa: E402
from tierkv.policies import EvictionPolicy, make_policy  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared/data/mooncake/conversation_trace.jsonl"
NEVER = float("inf")


@dataclass(slots=True)
class Request:
    input_length: int
    hash_ids: list[int]


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append(Request(int(r["input_length"]), [int(h) for h in r["hash_ids"]]))
            if limit is not None and len(out) >= limit:
                break
    return out


def next_uses(trace: list[Request]) -> list[list[float]]:
    """next_uses(trace)[t][i]: the index of the next request after t that holds hash_ids[i] (inf if none)."""
    later: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in trace]
    for t in range(len(trace) - 1, -1, -1):
        ids = trace[t].hash_ids
        out[t] = [later.get(h, NEVER) for h in ids]
        for h in ids:
            later[h] = t
    return out


class Oracle:
    """What Belady's MIN knows: each block's next use and depth, set by the replay before each request."""

    def __init__(self) -> None:
        self.next: dict = {}
        self.depth: dict = {}


class BeladyPolicy(EvictionPolicy):
    """Offline optimum: evict the block used furthest in the future; among equals the deepest (chain tail).

    A lazy max-heap: every (re)entry into the eviction order pushes a fresh stamp, stale ones are
    skipped when popped. Needs the future, so it lives here and never in tierkv.policies.
    """

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self._heap: list = []
        self._stamp: dict = {}  # evictable key -> its live stamp
        self._resident: set = set()
        self._n = 0

    def _push(self, key) -> None:
        self._n += 1
        self._stamp[key] = self._n
        heapq.heappush(self._heap, (-self.oracle.next.get(key, NEVER), -self.oracle.depth.get(key, 0), self._n, key))

    def insert(self, key, *, priority=0, pinned=False):
        self._resident.add(key)
        self._stamp.pop(key, None)
        if not pinned:
            self._push(key)

    def pin(self, key):
        self._stamp.pop(key, None)

    def unpin(self, key):
        if key in self._resident:
            self._push(key)

    def touch(self, key, *, priority=0):
        if key in self._stamp:
            self._push(key)

    def evict(self):
        while self._heap:
            _, _, n, key = heapq.heappop(self._heap)
            if self._stamp.get(key) == n:
                del self._stamp[key]
                self._resident.discard(key)
                return key
        return None

    def remove(self, key):
        self._stamp.pop(key, None)
        self._resident.discard(key)

    def __len__(self):
        return len(self._stamp)


class L3Ledger:
    """A stand-in L3 whose order a policy decides (the cache's L3 stores keep their own): which
    block hashes a write-through L3 of `capacity` blocks would hold. Every committed block is written."""

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        self.capacity, self.policy, self.held = capacity, policy, set()

    def hit(self, h) -> bool:
        if h in self.held:
            self.policy.touch(h)
            return True
        return False

    def write(self, h) -> None:
        if h in self.held or self.capacity <= 0:
            return
        if len(self.held) >= self.capacity:
            self.held.discard(self.policy.evict())
        self.policy.insert(h)
        self.held.add(h)


def replay(
    trace: list[Request],
    eviction: str,
    l1_blocks: int,
    l2_blocks: int = 0,
    l3_blocks: int = 0,
    *,
    block_size: int = 512,
    write_policy: str = "write_through",
) -> dict:
    """Token hits per tier of `trace` through a TieredKVCache; eviction "belady" plugs in the oracle."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, block_size=block_size)
    bpb = layout.bytes_per_block
    belady = eviction == "belady"
    config = CacheConfig(l1=l1_blocks * bpb, l2=l2_blocks * bpb, eviction="lru" if belady else eviction,
                         write_policy=write_policy)
    cache = TieredKVCache(layout, config, device="cpu", model="replay")
    oracle = Oracle()
    if belady:
        cache.index.policies = {tier: BeladyPolicy(oracle) for tier in cache.index.policies}
        future = next_uses(trace)
    l3 = L3Ledger(l3_blocks, BeladyPolicy(oracle) if belady else make_policy(eviction)) if l3_blocks else None
    hits = {"l1": 0, "l2": 0, "l3": 0}
    total = too_long = 0
    for t, req in enumerate(trace):
        n = req.input_length
        total += n
        # [n] int32: block i of the request is hash_ids[i] repeated; the last block may be partial
        tokens = np.repeat(np.asarray(req.hash_ids, dtype=np.int32), block_size)[:n]
        m = cache.match(tokens)  # at most n - 1 tokens: the last one is always computed
        if belady:
            for i, h in enumerate(m.hashes):
                oracle.next[h], oracle.depth[h] = future[t][i], i
        for tier in ("l1", "l2"):
            hits[tier] += m.by_tier[tier]
        usable = (n - 1) // block_size
        if l3 is not None:
            # the walk continues past the L1/L2 prefix into L3 (and back into L1/L2 after it)
            k = len(m.blocks)
            while k < usable and (m.hashes[k] in cache.index.entries or l3.hit(m.hashes[k])):
                hits["l3" if m.hashes[k] not in cache.index.entries else cache.index.entries[m.hashes[k]].tier()] += block_size
                k += 1
        if not cache.can_allocate(n, m):
            too_long += 1  # a request larger than L1 runs uncached (none at the benchmark's sizes)
            continue
        seq = cache.allocate(tokens, match=m)
        cache.commit(seq, tokens)
        cache.free(seq)
        if l3 is not None:
            for h in m.hashes:
                l3.write(h)
    return {"total_tokens": total, "hit_tokens": hits, "hit_rate": sum(hits.values()) / max(total, 1),
            "by_tier": {k: v / max(total, 1) for k, v in hits.items()}, "uncached_requests": too_long}


def ceiling(trace: list[Request], block_size: int = 512) -> float:
    """Infinite capacity, computed without the cache: a block hits when its whole prefix was seen before."""
    chain: dict[tuple[int, int], int] = {}  # (id of the prefix before, hash_id) -> id of this prefix
    hit = total = 0
    for req in trace:
        total += req.input_length
        usable = (req.input_length - 1) // block_size
        full = req.input_length // block_size  # only full blocks are ever cached
        prefix, hitting = 0, True
        for i, h in enumerate(req.hash_ids[:max(usable, full)]):
            key = (prefix, h)
            if hitting and i < usable and key in chain:
                hit += block_size
            else:
                hitting = False
            if i < full:
                prefix = chain.setdefault(key, len(chain) + 1)
            elif key in chain:
                prefix = chain[key]
    return hit / max(total, 1)


def _run(job: tuple) -> tuple:
    key, trace, args, kwargs = job
    torch.set_num_threads(1)  # payload-free blocks: intra-op threads only add wake-ups (20x slower copies)
    return key, replay(trace, *args, **kwargs)


def run_all(trace, policies, capacities, tiers, workers: int) -> dict:
    """Every replay of the benchmark, spread over `workers` processes; keyed ("single", policy, cap) / ("tiers", policy)."""
    usable_blocks = sum(r.input_length // 512 + 1 for r in trace) + 1
    jobs = [(("single", p, c), trace, (p, c), {}) for p in policies for c in capacities]
    jobs += [(("tiers", p), trace, (p, *tiers), {}) for p in policies]
    jobs.append((("infinite",), trace, ("lru", usable_blocks), {}))
    if workers <= 1:
        threads = torch.get_num_threads()
        try:
            return dict(map(_run, jobs))
        finally:
            torch.set_num_threads(threads)
    with ProcessPoolExecutor(workers) as pool:
        return dict(pool.map(_run, jobs))


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = figures["capacities_blocks"]
    for p, rates in figures["hit_rate"].items():
        ax.plot(caps, [rates[str(c)] for c in caps], marker="o", label=p, ls="--" if p == "belady" else "-")
    ax.axhline(figures["ceiling"], color="k", lw=0.8, ls=":", label="ceiling (infinite)")
    ax.set_xscale("log")
    ax.set_xlabel(f"L1 capacity (blocks of {figures['block_size']} tokens)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"{figures['trace']}: hit rate vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--capacities", default="1000,4000,16000,64000", help="L1 blocks, comma-separated")
    ap.add_argument("--policies", default="lru,lfu,s3fifo,arc,belady")
    ap.add_argument("--tiers", default="500000,4000000,32000000", help="L1,L2,L3 tokens of the multi-tier replay")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    bs = 512  # the trace's block size: hash_ids name 512-token blocks
    trace = load_trace(args.trace, args.limit)
    policies = args.policies.split(",")
    assert all(p in EVICTION_POLICIES or p == "belady" for p in policies), policies
    caps = [int(c) for c in args.capacities.split(",")]
    tiers = [int(t) // bs for t in args.tiers.split(",")]
    t0 = time.perf_counter()
    res = run_all(trace, policies, caps, tiers, args.workers)
    seconds = time.perf_counter() - t0
    ceil = ceiling(trace, bs)
    default = CacheConfig().eviction
    hit = {p: {str(c): res[("single", p, c)]["hit_rate"] for c in caps} for p in policies}
    fig = {
        "trace": Path(args.trace).name, "requests": len(trace), "block_size": bs, "capacities_blocks": caps,
        "ceiling": ceil, "ceiling_via_cache": res[("infinite",)]["hit_rate"], "default_policy": default,
        "hit_rate": hit,
        "ratio_to_belady": {p: {c: v / hit["belady"][c] if hit.get("belady", {}).get(c) else None
                                for c, v in r.items()} for p, r in hit.items()} if "belady" in hit else {},
        "ratio_to_lru": {p: {c: v / hit["lru"][c] if hit.get("lru", {}).get(c) else None
                             for c, v in r.items()} for p, r in hit.items()} if "lru" in hit else {},
        "multi_tier": {"tokens": [int(t) for t in args.tiers.split(",")], "blocks": tiers,
                       "l3": "L3Ledger in this script (write-through, same policy), not yet the cache's L3",
                       **{p: {**res[("tiers", p)]["by_tier"], "hit_rate": res[("tiers", p)]["hit_rate"],
                              "of_ceiling": res[("tiers", p)]["hit_rate"] / ceil if ceil else None}
                          for p in policies}},
        "replay_seconds_all": seconds, "replays": len(res), "workers": args.workers,
    }
    print(f"{fig['trace']}: {len(trace)} requests, ceiling {ceil:.3f} (via cache {fig['ceiling_via_cache']:.3f}), "
          f"{len(res)} replays in {seconds:.1f} s on {args.workers} workers")
    print("policy    " + "".join(f"{c:>22}" for c in caps))
    for p in policies:
        cells = []
        for c in map(str, caps):
            rb = fig["ratio_to_belady"].get(p, {}).get(c)
            rl = fig["ratio_to_lru"].get(p, {}).get(c)
            cells.append(f"{hit[p][c]:.3f} {rb or 0:.2f}xB {rl or 0:.2f}xL")
        print(f"{p:<10}" + "".join(f"{x:>22}" for x in cells))
    print(f"multi-tier L1/L2/L3 = {'/'.join(args.tiers.split(','))} tokens (hit rate, l1/l2/l3, of ceiling):")
    for p in policies:
        m = fig["multi_tier"][p]
        print(f"  {p:<8} {m['hit_rate']:.3f}  {m['l1']:.3f}/{m['l2']:.3f}/{m['l3']:.3f}  {m['of_ceiling']:.1%}")
    out = write_results("bench_policies", fig, args.out)
    plot(fig, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return fig


if __name__ == "__main__":
    main()
