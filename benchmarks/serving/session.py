"""One server's session for one workload: warm-up, the isolated cold probe, the priming, then the
sweep over offered rates until the search is done, --max-points ran or the time share is spent;
each point's figures with its bound, and the config's goodput. With --profile-seconds, one more
point at the goodput rate with the server's profiler on for part of it: where the time went at
saturation. It drives a server that is already up (started here or external) and never starts or
stops one.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np

from .bounds import point_bound
from .client import Http, profile_server
from .figures import summarize
from .probes import cold_probe, prime, warm_up
from .report import fmt
from .sweep import next_rate, run_point
from .trace_summary import keep_trace
from .workloads import Source, rng_for

PRIME_CONCURRENCY = 8
PROFILE_SLACK_S = 30.0


def goodput(points: list[dict]) -> dict:
    """The highest offered rate whose point held the SLO, with what was served there and its bound."""
    held = [p for p in points if p["slo_held"]]
    if not held:
        return dict(requests_per_s=0.0, point=None)
    best = max(held, key=lambda p: p["offered_rate"])
    failed_above = [p["offered_rate"] for p in points if not p["slo_held"] and p["offered_rate"] > best["offered_rate"]]
    b = best["bound"] or {}
    return dict(requests_per_s=best["offered_rate"], point=points.index(best),
                lowest_failing_rate=min(failed_above, default=None),
                served_requests_per_s=best["throughput"]["requests_per_s"], p99_ttft_ms=best["p99_ttft_ms"],
                bound_requests_per_s=b.get("requests_per_s"), binding=b.get("binding"),
                served_over_bound=b.get("served_over_bound"), served_over_pcie_bound=b.get("served_over_pcie_bound"))


def point_line(p: dict) -> str:
    hits = {t: v["hit_tokens"] for t, v in (p["cache"] or {}).items()}
    total = sum(hits.values())
    split = "/".join(f"{hits[t] / total:.0%}" for t in ("l1", "l2", "l3")) if total else "-"
    b = p["bound"] or {}
    seen = b.get("disk_read_Bps_seen")
    return (f"  {p['offered_rate']:7.2f}/s: {p['completed']:4d}/{p['arrivals']} done, p99 TTFT "
            f"{fmt(p['p99_ttft_ms'])} ms ({'held' if p['slo_held'] else 'MISSED'}), served "
            f"{p['throughput']['requests_per_s']:.2f}/s, hits l1/l2/l3 {split}, bound "
            f"{fmt(b.get('requests_per_s'), '.2f')}/s ({b.get('binding', '-')}), served/bound "
            f"{fmt(b.get('served_over_bound'), '.2f')}"
            + (f", disk read {seen / 1e9:.2f} GB/s over the point" if seen else ""))


def point_seconds(a, rate: float) -> float:
    """How long a point's arrivals last: --point-seconds, or long enough to expect
    --min-point-requests of them at `rate` (a p99 over a handful of arrivals is their slowest)."""
    return max(a.point_seconds, a.min_point_requests / rate)


async def profiled_point(a, h: Http, src: Source, rate: float, trace_to: Path) -> dict:
    """One more point at `rate`, with the server's torch profiler on for --profile-seconds from a
    third of the way in: the point's figures (the profiler slows the server: they stay apart from
    the sweep's), the trace copied to `trace_to`, and its summary (trace_summary.py)."""
    profiling = asyncio.create_task(profile_server(h, a.profile_seconds, after=a.point_seconds / 3))
    clock = rng_for(a.seed, src.name, 8)
    results, delta, span, late = await run_point(h, src, rate, a.point_seconds, a.drain_seconds, clock)
    trace = await profiling
    p = summarize(rate, a.point_seconds, results, span, late, delta, a.slo)
    out = dict(offered_rate=rate, profile_seconds=a.profile_seconds, point=p)
    kept = await asyncio.to_thread(keep_trace, trace, trace_to)
    if "error" in kept:
        print(f"  profile: {kept['error']}", flush=True)
        return dict(out, **kept)
    summary = kept["summary"]
    print(f"  profiled {rate:.2f}/s for {a.profile_seconds:g} s: GPU busy {summary['gpu_busy_fraction']:.0%}, by "
          f"stream {', '.join(f'{k} {v:.0%}' for k, v in summary['stream_busy_fraction'].items())}; trace "
          f"{trace_to.name}", flush=True)
    return dict(out, **kept)


async def session(a, h: Http, src: Source, limits: dict, max_len: int, deadline: float,
                  trace_to: Path | None = None) -> dict:
    g = np.random.default_rng([a.seed, 1000])  # warm-up and probe: the same prompts in every config
    await warm_up(h, min(a.warm_tokens, max_len - 24), g)  # long enough to be a chunked prefill
    cold_tokens = min(src.largest_request - src.answer_tokens, max_len - src.answer_tokens - 2)
    cold = await cold_probe(h, cold_tokens, src.answer_tokens, g)
    # a quarter as long: how the prefill's cost grows with length (bounds.recompute_cost)
    cold_short = await cold_probe(h, max(1, cold_tokens // 4), src.answer_tokens, g)
    primed = await prime(h, src, PRIME_CONCURRENCY, a.settle_seconds)
    # unless given: the rate at which requests that all miss, served one at a time, keep the server busy
    one_cold = cold["s_per_token"] * cold_tokens + src.answer_tokens * cold["step_s"] if not cold["error"] else 1.0
    start = a.start_rate or 1.0 / one_cold
    print(f"  cold probe {cold_tokens} tokens: TTFT {fmt(cold.get('ttft_ms'))} ms, decode step "
          f"{fmt(cold.get('step_ms'), '.1f')} ms; primed {primed['prompts']} prompts in {primed['seconds']:.1f} s "
          f"(+{primed['settle_s']:.1f} s settling); sweep from {start:.2f}/s", flush=True)
    points, stopped = [], "search done"
    while (rate := next_rate([(p["offered_rate"], p["slo_held"]) for p in points], start, a.bisections)) is not None:
        if len(points) == a.max_points:
            stopped = f"--max-points {a.max_points}"
            break
        seconds = point_seconds(a, rate)
        # writing and reading an 8B server's trace takes tens of seconds beyond the point itself
        if time.perf_counter() + seconds + a.drain_seconds + PROFILE_SLACK_S > deadline:
            stopped = "time budget"
            break
        clock = rng_for(a.seed, src.name, 7, len(points))  # arrival gaps: the same draws in every config
        results, delta, span, late = await run_point(h, src, rate, seconds, a.drain_seconds, clock)
        p = summarize(rate, seconds, results, span, late, delta, a.slo)
        p["bound"] = point_bound(p, cold, limits)
        points.append(p)
        print(point_line(p), flush=True)
    extra = {"answers": src.answers, "conversations_retired": src.retired} if src.name == "multi_round" else {}
    best = goodput(points)
    if trace_to is not None and best["point"] is not None:
        # writing and reading an 8B server's trace takes tens of seconds beyond the point itself
        if time.perf_counter() + a.point_seconds + a.drain_seconds + PROFILE_SLACK_S > deadline:
            extra["profile"] = dict(error="no time left in the budget for the profiled point")
        else:
            extra["profile"] = await profiled_point(a, h, src, best["requests_per_s"], trace_to)
    return dict(cold_probe=cold, cold_probe_short=cold_short, prime=primed, start_rate=start, points=points,
                stopped=stopped, goodput=best, **extra)


async def run_session(a, url: str, src: Source, limits: dict, max_len: int, vocab: int, deadline: float,
                      trace_to: Path | None = None) -> dict:
    """A session against the server at `url`: a client with room for every request in flight, the
    model name from /v1/models unless --served-model-name gives it. `trace_to`: profile the
    goodput rate, its trace copied there."""
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits_http = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(timeout=a.timeout, limits=limits_http) as client:
        name = a.served_model_name if a.url else None  # servers started here serve whatever /v1/models says
        if name is None:
            models = (await client.get(url + "/v1/models", headers=headers)).json()["data"]
            name, max_len = models[0]["id"], models[0].get("max_model_len", max_len)
        return await session(a, Http(client, url, headers, name, vocab), src, limits, max_len, deadline, trace_to)
