"""One configuration's client session: warm-up, isolated probes, then each workload's trace replayed
at its arrival times under its concurrency limit and a deadline. It drives a server that is already
up (started here or external) and never starts or stops one.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
from limits import drop_page_cache

from .client import Http, Result, cache_stats, hits_between, send
from .figures import summarize
from .probes import probes, warm_up
from .report import fmt
from .workloads import Planned, User, Workload

UNIQUE_CONFIGS = ("off", "l1", "external")  # all-miss trace: only caching on vs off is the question


async def run_requests(h: Http, w: Workload, deadline: float) -> list[Result]:
    """A fixed trace: each request at its arrival time or when one of `concurrency` slots frees
    (in trace order); none starts after `deadline`."""
    slots, t0, out = asyncio.Semaphore(w.concurrency), time.perf_counter(), []

    async def one(p: Planned) -> None:
        await asyncio.sleep(max(0.0, p.arrival - (time.perf_counter() - t0)))
        async with slots:
            if time.perf_counter() < deadline:
                out.append(await send(h, p.prompt, p.max_tokens))

    await asyncio.gather(*(one(p) for p in w.requests))
    return out


async def run_multi_round(h: Http, w: Workload, deadline: float, answers: dict) -> list[Result]:
    """Users arrive at their times and wait for one of the active-user slots; each round's prompt
    is the history so far + the question, and the answer as returned joins the history."""
    slots, t0, out = asyncio.Semaphore(w.concurrency), time.perf_counter(), []

    async def user(u: User) -> None:
        await asyncio.sleep(max(0.0, u.arrival - (time.perf_counter() - t0)))
        async with slots:
            history = u.context
            for r, question in enumerate(u.questions):
                if r:
                    await asyncio.sleep(u.think[r - 1])
                if time.perf_counter() >= deadline:
                    return
                prompt = history + question
                res = await send(h, prompt, len(u.stand_in[r]))
                out.append(res)
                returned = res.output_ids is not None and len(res.output_ids) == len(u.stand_in[r])
                answers["returned" if returned else "stand_in"] += 1
                history = prompt + (res.output_ids if returned else u.stand_in[r])

    await asyncio.gather(*(user(u) for u in w.users))
    return out


async def bench_config(h: Http, a, config: str, workloads: list[Workload], kvb: int, max_len: int) -> tuple[dict, dict]:
    """Warm-up, probes, then every workload's trace; returns the figures and the raw results."""
    g = np.random.default_rng([a.seed, 1000])  # probes and warm-up: the same prompts in every config
    await warm_up(h, min(a.warm_tokens, max_len // 2), g)
    out = dict(probes=await probes(h, a, config, g, kvb, max_len), workloads={}, page_cache_dropped={})
    raw, config_deadline = {}, time.perf_counter() + a.config_seconds
    for w in workloads:
        if w.name == "unique" and config not in UNIQUE_CONFIGS:
            continue
        if "disk" in config:  # O_DIRECT already bypasses it; this also clears what others cached
            out["page_cache_dropped"][w.name] = ("skipped (--no-drop-caches or --smoke)" if a.no_drop_caches
                                                 else "dropped" if drop_page_cache() else "not permitted")
        answers = {"returned": 0, "stand_in": 0}
        before, t = await cache_stats(h), time.perf_counter()
        deadline = min(t + a.max_seconds, config_deadline)  # run lengths bounded by time as well as by counts
        if w.users:
            results = await run_multi_round(h, w, deadline, answers)
        else:
            results = await run_requests(h, w, deadline)
        duration = time.perf_counter() - t
        s = summarize(w, results, duration, hits_between(before, await cache_stats(h)))
        if w.users:
            s["answers"] = answers  # joined the history as returned, or the seeded stand-in
        out["workloads"][w.name], raw[w.name] = s, results
        print(f"  {w.name:14s} {s['requests']:4d}/{w.planned} requests in {duration:6.1f} s, "
              f"{s['errors']} errors, TTFT p50 {fmt(s['ttft_ms']['p50'])} ms", flush=True)
    final = await cache_stats(h)
    out["l3_stores"] = final.get("l3_stores") if final else None  # direct I/O in effect, evictions, errors
    return out, raw


async def run_one(a, config: str, url: str, workloads, kvb: int, max_len: int, vocab: int) -> tuple[dict, dict]:
    """One config against the server at `url`: a client with room for every request in flight, the
    model name from /v1/models unless --served-model-name gives it."""
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits_http = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=a.timeout, limits=limits_http) as client:
        name = a.served_model_name if a.url else None  # servers started here serve whatever /v1/models says
        if name is None:
            models = (await client.get(url + "/v1/models", headers=headers)).json()["data"]
            name, max_len = models[0]["id"], models[0].get("max_model_len", max_len)
        return await bench_config(Http(client, url, headers, name, vocab), a, config, workloads, kvb, max_len)
