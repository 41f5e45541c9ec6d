"""The open-loop sweep: requests at Poisson arrival times at one offered rate for a fixed time (a
point), and the search over rates (double while the SLO holds, halve while it does not, then
bisect between the highest pass and the lowest fail). It sends what a workload source hands it
and never starts or resets a server.

State between points is carried over, as in a server whose load changes: the cache keeps what
the last point left, multi-round conversations go on where they were. A point ends when its
arrivals are over and what they sent has finished, or --drain-seconds later: what is still in
flight then is cancelled (the server aborts it on disconnect) and counts as missing the SLO.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from .client import Http, Result, cache_stats, send, stats_delta
from .workloads import Source


def next_rate(tried: list[tuple[float, bool]], start: float, bisections: int) -> float | None:
    """The next offered rate from the (rate, SLO held) points so far; None when the search is done:
    doubling from `start` up to the first fail (or halving down to the first pass), then
    `bisections` midpoints between the highest pass and the lowest fail above it."""
    if not tried:
        return start
    ok = [r for r, held in tried if held]
    bad = [r for r, held in tried if not held]
    if not bad:
        return 2 * max(ok)
    if not ok:
        return min(bad) / 2
    lo = max(ok)
    above = [r for r in bad if r > lo]
    if not above:  # a fail below a pass (noise): keep climbing from the pass
        return 2 * lo
    bracketed = next(i for i in range(len(tried)) if any(h for _, h in tried[:i + 1])
                     and any(not h for _, h in tried[:i + 1]))
    if len(tried) - 1 - bracketed >= bisections:
        return None
    return (lo + min(above)) / 2


async def run_point(h: Http, src: Source, rate: float, seconds: float, drain: float,
                    g: np.random.Generator) -> tuple[list[Result], dict | None, float, float]:
    """Poisson arrivals at `rate` for `seconds`; returns the results (cut ones included), the cache
    stats' change over the point, its span (first arrival to last finish) and the client's worst
    lateness in sending an arrival on time."""
    before = await cache_stats(h)
    t0 = time.perf_counter()
    times = np.cumsum(g.exponential(1.0 / rate, int(rate * seconds * 2 + 20)))
    times = times[times < seconds]
    results: list[Result] = []
    tasks: list[asyncio.Task] = []
    late = 0.0

    async def one(res: Result) -> None:
        ask = None
        try:
            ask = await src.take()
            await send(h, ask.prompt, ask.max_tokens, res)
        except asyncio.CancelledError:
            res.error = res.error or f"cut {drain:g} s after the last arrival"
        finally:
            if ask is not None:
                src.done(ask, res.output_ids, res.error is None)

    for t in times:
        await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
        late = max(late, time.perf_counter() - (t0 + t))
        results.append(Result(0, 0, arrival=t0 + t))
        tasks.append(asyncio.create_task(one(results[-1])))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + seconds + drain - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    ends = [r.arrival + r.e2e for r in results if r.error is None]
    span = max(ends + [t0 + seconds]) - t0
    return results, stats_delta(before, await cache_stats(h)), span, late
