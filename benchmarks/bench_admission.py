"""bench_admission: what admitting a request whose history lies in L2 costs the host, by phase.

bench_rounds' step log shows each hit-round admission holding the engine thread 7-18 ms (H100,
Llama-3.1-8B, 8K-token histories) while a decode step takes the GPU ~8 ms: the GPU waits for the
host at every turnover. This replays that admission on the cache alone, without a server: --users
histories of --context-tokens ids are committed, L1 holds a few of them, and each is admitted in
turn with --question-tokens new ids, then freed, as the server does when it finishes. As the
scheduler admits it while others compute (engine/scheduler.py): looked up (plan), and while more
than --slice-blocks of its blocks are still in L2, a slice of them warmed into L1 and looked up
again; then allocated (the rest loads into L1 slots taken from the others' cached blocks).
--slice-blocks 0: one plan and one allocate, the path before slices. Per phase it reports the
host's milliseconds per admission (median over --rounds x --users admissions; plan and warm summed
over the admission's steps) and the seconds until the loads land; a cProfile of the last round
goes to OUT/profiles/. --smoke: a tiny layout on the CPU.
Writes OUT/bench_admission-<machine>.json. No target (BENCHMARKS.md, issue 40 item 3).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, machine_tag, write_results
from shapes import LLAMA_3_1_8B  # bench_rounds' model
from tierkv import CacheConfig, KVLayout, TieredKVCache, transfer
from tierkv.engine.scheduler import LOAD_SLICE_BLOCKS

SMOKE_SHAPE = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--smoke", action="store_true", help="a tiny layout on the CPU (checks that everything runs)")
    add("--users", type=int, default=12, help="histories admitted in turn (default 12)")
    add("--l1-histories", type=int, default=6, help="histories L1 holds (default 6: bench_rounds' 6 GiB)")
    add("--context-tokens", type=int, default=8000)
    add("--question-tokens", type=int, default=100)
    add("--rounds", type=int, default=4)
    add("--recompute-us-per-token", type=float, default=60.0,
        help="the engine's measured prefill cost, for load-or-recompute (default 60 us: ~Llama-8B, H100)")
    add("--block-size", type=int, default=16)
    add("--slice-blocks", type=int, default=LOAD_SLICE_BLOCKS, help=f"L2 blocks warmed a step before "
        f"admission (default the scheduler's {LOAD_SLICE_BLOCKS}; 0: admitted whole)")
    add("--keep", type=int, default=5, help="L1 room a warm leaves to others, in blocks (the scheduler: its "
        "running requests; default 5)")
    add("--staging-mib", type=int, help=f"the staging buffer of L2 <-> L1 DMAs, MiB (default tierkv's "
        f"{transfer.STAGING_BYTES >> 20}): a load goes through it in chunks of half of it")
    add("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    if a.staging_mib:
        transfer.STAGING_BYTES = a.staging_mib << 20
    device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    shape = SMOKE_SHAPE if a.smoke else LLAMA_3_1_8B
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    layout = dataclasses.replace(shape, dtype=dtype, block_size=a.block_size)
    blocks = -(-(a.context_tokens + a.question_tokens) // a.block_size)
    l1 = a.l1_histories * blocks * layout.bytes_per_block
    l2 = int(a.users * blocks * 1.25) * layout.bytes_per_block
    cache = TieredKVCache(layout, CacheConfig(l1=l1, l2=l2), device=device, model="bench-admission")
    rng = random.Random(0)
    histories = [[rng.randrange(1, 32000) for _ in range(a.context_tokens)] for _ in range(a.users)]
    for h in histories:  # commit each; L1 keeps the last few, the rest live in L2 only
        seq = cache.allocate(h)
        cache.commit(seq, h)
        cache.free(seq)
    cache.synchronize()

    phases: dict[str, list[float]] = {"plan": [], "warm": [], "allocate": [], "loads_land": [], "free": []}
    steps: list[int] = []  # lookups an admission took: 1 + its slices warmed
    tiers: list[dict] = []
    profile = cProfile.Profile()
    for r in range(a.rounds):
        last = r == a.rounds - 1
        for h in histories:
            prompt = h + [rng.randrange(1, 32000) for _ in range(a.question_tokens)]
            if last:
                profile.enable()
            plan_s = warm_s = 0.0
            lookups = 0
            while True:  # a step each, in the server
                lookups += 1
                t0 = time.perf_counter()
                plan = cache.plan(prompt, None, budget=8192,
                                  recompute_seconds_per_token=a.recompute_us_per_token * 1e-6)
                t1 = time.perf_counter()
                plan_s += t1 - t0
                if not a.slice_blocks or plan.l2_tokens <= a.slice_blocks * a.block_size:
                    break
                warmed = cache.warm(plan.match, keep=a.keep, limit=a.slice_blocks)
                warm_s += time.perf_counter() - t1
                if not warmed:
                    break  # no room to warm into: admitted with the rest, as the scheduler does
            steps.append(lookups)
            t1 = time.perf_counter()
            seq = cache.allocate(None, None, match=plan.match, stream=plan.stream, reserve=plan.reserve)
            t2 = time.perf_counter()
            if last:
                profile.disable()
            seq.wait()
            if device == "cuda":
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            if last:
                profile.enable()
            cache.free(seq)
            t4 = time.perf_counter()
            if last:
                profile.disable()
            for name, seconds in zip(phases, (plan_s, warm_s, t2 - t1, t3 - t2, t4 - t3)):
                phases[name].append(seconds)
            tiers.append(dict(seq.cached_by_tier))
    ms = {name: round(statistics.median(v) * 1e3, 3) for name, v in phases.items()}
    loaded = statistics.median(t.get("l2", 0) for t in tiers)
    print(f"{device} {machine_tag()}: {a.users} histories of {a.context_tokens} tokens, L1 holds {a.l1_histories}; "
          f"median per admission (ms): {ms}; lookups {statistics.median(steps)}; tokens from L2 (warmed or "
          f"loaded): {loaded}")

    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    text.write(f"bench_admission, the last round ({a.users} admissions: plans, warms and allocate, then free; "
               f"slices of {a.slice_blocks} blocks), cProfile\n")
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(45)
    out = Path(a.out)
    (out / "profiles").mkdir(parents=True, exist_ok=True)
    prof_path = out / "profiles" / f"bench_admission-{machine_tag()}.txt"
    prof_path.write_text(text.getvalue())
    path = write_results("bench_admission", dict(
        argv=sys.argv[1:], device=device,
        layout=dict(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                    block_size=a.block_size, dtype=str(dtype)),
        staging_mib=transfer.STAGING_BYTES >> 20, users=a.users, l1_histories=a.l1_histories,
        context_tokens=a.context_tokens, question_tokens=a.question_tokens, rounds=a.rounds,
        slice_blocks=a.slice_blocks, keep=a.keep, median_ms=ms, median_lookups=statistics.median(steps),
        l2_tokens_loaded=loaded,
        seconds={name: [round(s, 6) for s in v] for name, v in phases.items()}, profile=prof_path.name), out)
    print(f"wrote {path} and {prof_path}")


if __name__ == "__main__":
    main()
