"""steps_summary: a bench_rounds step log (tierkv/engine/step_log.py), part by part.

Parts are told apart by a pause of more than --gap seconds between steps: in bench_rounds' log,
its probes, then round 0 (cold), then the hit rounds. Per part: its wall time and steps, the
mean batch, and the host-bound steps: those whose engine found the previous step already
finished when it came to wait for it (`waited` below --idle), so the GPU idled for part of their
schedule and launch. Their count, the seconds from each to the next step, and their schedule()
time show whether admission's host work keeps the GPU waiting (docs/serving.md, issue 40 item
3). Reads .jsonl or .jsonl.gz; prints a table, measures nothing itself.

    python benchmarks/steps_summary.py benchmarks/results/bench_rounds-h100-acbb6f8-ab-1-with-steps.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def rounds(path: Path, gap: float) -> list[list[dict]]:
    """The log's step lines, split into parts where the engine paused longer than `gap` seconds."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        steps = [s for s in map(json.loads, f) if s["ev"] == "step"]
    out: list[list[dict]] = []
    for s in steps:
        if not out or s["t0"] - out[-1][-1]["t4"] > gap:
            out.append([])
        out[-1].append(s)
    return out


def summary(steps: list[dict], idle: float) -> dict:
    bound = [i for i, s in enumerate(steps[:-1]) if s["waited"] < idle]
    return dict(
        wall_s=steps[-1]["t4"] - steps[0]["t0"],
        steps=len(steps),
        mean_batch=statistics.mean(len(s["run"]) for s in steps),
        admitted=sum(len(s["admitted"]) for s in steps),
        schedule_s=sum(s["t2"] - s["t1"] for s in steps),
        host_bound_steps=len(bound),
        host_bound_s=sum(steps[i + 1]["t0"] - steps[i]["t0"] for i in bound),
        host_bound_schedule_s=sum(steps[i]["t2"] - steps[i]["t1"] for i in bound),
        longest_schedule_ms=max((s["t2"] - s["t1"]) * 1e3 for s in steps),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--gap", type=float, default=0.3, help="seconds between steps that start a new round (0.3)")
    p.add_argument("--idle", type=float, default=3e-4,
                   help="a step that waited less than this for the previous one's tokens is host-bound (0.3 ms)")
    a = p.parse_args()
    head = (f"{'part':>5} {'wall s':>7} {'steps':>5} {'batch':>5} {'admit':>5} {'sched s':>7} "
            f"{'host-bound':>10} {'their s':>7} {'their sched s':>13} {'max sched ms':>12}")
    for path in a.logs:
        print(path.name)
        print(head)
        for n, steps in enumerate(rounds(path, a.gap)):
            r = summary(steps, a.idle)
            print(f"{n:>5} {r['wall_s']:>7.2f} {r['steps']:>5} {r['mean_batch']:>5.2f} {r['admitted']:>5} "
                  f"{r['schedule_s']:>7.3f} {r['host_bound_steps']:>10} {r['host_bound_s']:>7.3f} "
                  f"{r['host_bound_schedule_s']:>13.3f} {r['longest_schedule_ms']:>12.1f}")


if __name__ == "__main__":
    main()
