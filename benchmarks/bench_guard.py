"""bench_guard: what the cache's lock (tierkv/guard.py) costs the engine's step.

Every public call of a TieredKVCache holds one re-entrant lock, so that threads may share a cache.
The engine makes those calls from its scheduler every step (can_append/append per running request,
commit per filled block, plan/allocate per admission). This counts the lock's acquisitions per
step while tierkv's engine decodes a batch (the bundled SmolLM2 on CPU: the scheduler's calls are
the same on any device), measures what one guarded call costs over the same call unguarded, in
the same run, and sets their product against the decode step time of the committed H200
bench_throughput result (nano-vllm workload, ~139 sequences a step).
Writes benchmarks/results/bench_guard-<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import RESULTS, write_results

import tierkv
from tierkv.paged import PagedCache


class CountingLock:
    """The guard's RLock, counting acquisitions (re-entries too: each one costs)."""

    def __init__(self, lock) -> None:
        self.lock, self.count = lock, 0

    def acquire(self, *args):
        self.count += 1
        return self.lock.acquire(*args)

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def per_call_overhead(cache, repeats: int) -> float:
    """Seconds a guarded call costs over the same method called unguarded (best of 5)."""
    seq = cache.allocate(list(range(40)))
    unguarded = PagedCache.can_append.__wrapped__
    best = []
    for fn in (lambda: cache.can_append(seq, 1), lambda: unguarded(cache, seq, 1)):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(repeats):
                fn()
            times.append((time.perf_counter() - t) / repeats)
        best.append(min(times))
    cache.free(seq)
    return best[0] - best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=100_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = tierkv.LLM(l2="256MiB", max_num_seqs=256)
    cache = llm.engine.cache
    counting = CountingLock(cache._guard.lock)
    cache._guard.lock = counting
    sched = llm.engine.scheduler
    schedule, steps = sched.schedule, []

    def counted_schedule():
        step = schedule()
        if len(step):
            steps.append((len(step), step.is_decode, counting.count))
        return step

    sched.schedule = counted_schedule
    prompts = [f"Question {i}: name a colour and a number between 1 and {i + 2}." for i in range(args.prompts)]
    llm.generate(prompts, tierkv.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                 use_tqdm=False)
    cache._guard.lock = counting.lock
    marks = [c for _, _, c in steps] + [counting.count]
    decode = [(n, marks[i + 1] - marks[i]) for i, (n, is_decode, _) in enumerate(steps) if is_decode]
    per_step = sum(c for _, c in decode) / len(decode)
    per_seq = sum(c for _, c in decode) / sum(n for n, _ in decode)
    overhead = per_call_overhead(cache, args.repeats)
    h200 = json.loads((Path(RESULTS) / "bench_throughput-h200.json").read_text())
    run = h200["tierkv"][0]
    h200_step = run["decode_seconds"] / run["decode_steps"]
    batch = run["mean_decode_batch"]
    cost = per_seq * batch * overhead
    print(f"{len(decode)} decode steps of {sum(n for n, _ in decode) / len(decode):.0f} sequences: "
          f"{per_step:.1f} lock acquisitions a step, {per_seq:.2f} a sequence")
    print(f"one guarded call costs {overhead * 1e9:.0f} ns more than unguarded (this machine)")
    print(f"at the H200 run's {batch:.0f} sequences a step: {cost * 1e6:.1f} us of its {h200_step * 1e3:.2f} ms "
          f"decode step = {cost / h200_step:.2%}")
    path = write_results("bench_guard", {
        "decode_steps": len(decode), "acquisitions_per_decode_step": per_step,
        "acquisitions_per_sequence_step": per_seq, "guarded_call_overhead_s": overhead,
        "h200_decode_step_s": h200_step, "h200_mean_decode_batch": batch,
        "h200_result_commit": h200["environment"].get("git_commit"),
        "lock_cost_per_h200_step_s": cost, "lock_share_of_h200_step": cost / h200_step,
        "note": "host-side cost: calls per sequence-step measured here (CPU, bundled SmolLM2) times the "
                "guarded-call overhead measured here, against the decode step of the committed H200 "
                "bench_throughput run; the H200 host is faster than this VM, so the share there is lower",
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
