"""What runs on a fresh server before its sweep, outside every timing that is reported: a warm-up
that compiles what the sweep will run, one isolated cold request (the compute bound's prefill cost
per token and batch-1 decode step), and the priming of the cache with the workload's prefixes
(then the disk writes they caused are let settle). It must never run while a sweep point is in flight.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from .client import Http, cache_stats, send
from .workloads import Source, random_ids


async def warm_up(h: Http, tokens: int, g: np.random.Generator) -> None:
    """Compile what the sweep will run (Triton kernels JIT on first use): a chunked prefill, the
    same prompt as a cache hit, and a batch of decodes."""
    prompt = random_ids(g, tokens, h.vocab)
    await send(h, prompt, 8)
    await send(h, prompt + random_ids(g, 16, h.vocab), 8)
    await asyncio.gather(*(send(h, random_ids(g, 8, h.vocab), 7) for _ in range(8)))


async def cold_probe(h: Http, tokens: int, answer_tokens: int, g: np.random.Generator) -> dict:
    """One request alone on the server with a prompt no cache holds: its TTFT per prompt token is
    the cold prefill cost, its mean gap between tokens the batch-1 decode step."""
    r = await send(h, random_ids(g, tokens, h.vocab), max(answer_tokens, 2))
    if r.error:
        return dict(tokens=tokens, error=r.error)
    step = sum(r.itl) / len(r.itl)
    return dict(tokens=tokens, ttft_ms=r.ttft * 1e3, s_per_token=r.ttft / tokens, step_s=step, step_ms=step * 1e3,
                error=None)


async def prime(h: Http, src: Source, concurrency: int, settle_s: float) -> dict:
    """Send each of the workload's prefixes once (one output token), `concurrency` at a time, so the
    first point finds the cache as a running server would. The first prefix is sent again last:
    the rest pushed it out of L1 where they outgrow it, so its reload pays the lower tier's
    one-time costs (kernel compilation) here rather than in the first point. Then wait, at most
    `settle_s`, until the disk tier's written bytes stop growing (the priming's writes would
    compete with the sweep's reads)."""
    slots, t, prompts = asyncio.Semaphore(concurrency), time.perf_counter(), src.prime_prompts()

    async def one(prompt: list[int]):
        async with slots:
            return await send(h, prompt, 1)

    results = await asyncio.gather(*(one(p) for p in prompts))
    reload = await send(h, prompts[0], 1) if prompts else None
    sent_s, written, end = time.perf_counter() - t, None, time.perf_counter() + settle_s
    while time.perf_counter() < end:
        stats = await cache_stats(h)
        now = stats["tiers"]["l3"]["bytes_in"] if stats else None
        if now == written or not now:  # steady, or nothing written (no disk tier)
            break
        written = now
        await asyncio.sleep(1.0)
    return dict(prompts=len(results), tokens=sum(r.prompt_tokens for r in results),
                errors=sum(r.error is not None for r in results), seconds=sent_s,
                reload_ttft_ms=reload.ttft * 1e3 if reload and reload.ttft else None,
                settle_s=time.perf_counter() - t - sent_s, l3_bytes_written=written)
