"""Isolated probes of one server: a warm-up outside the timings, then one prompt cold, as an L1 hit
and as an L2 hit (after other prompts pushed it out of L1), each split exactly by tier by diffing
/v1/cache/stats around the one request. It must never run while a trace is in flight.
"""

from __future__ import annotations

import asyncio

import numpy as np

from .client import Http, cache_stats, hits_between, send
from .workloads import random_ids


async def warm_up(h: Http, tokens: int, g: np.random.Generator) -> None:
    """Compile what the trace will run (Triton kernels JIT on first use) outside the timings: a
    chunked prefill, the same prompt as a cache hit, and a batch of decodes (of 15 tokens in all,
    less than a block: they leave nothing in the cache for the probes to push out of L2)."""
    prompt = random_ids(g, tokens, h.vocab)
    await send(h, prompt, 8)
    await send(h, prompt + random_ids(g, 16, h.vocab), 8)
    await asyncio.gather(*(send(h, random_ids(g, 8, h.vocab), 7) for _ in range(8)))


async def timed(h: Http, prompt: list[int]) -> dict:
    """One isolated request (one output token): its TTFT and the exact per-tier split of its hit."""
    before = await cache_stats(h)
    r = await send(h, prompt, 1)
    return dict(tokens=len(prompt), ttft_ms=r.ttft * 1e3 if r.ttft else None, cached_tokens=r.cached_tokens,
                hit_tokens=hits_between(before, await cache_stats(h)), error=r.error)


async def push_out_of_l1(h: Http, stats: dict, chunk: int, g: np.random.Generator, kvb: int) -> int:
    """There is no HTTP route to evict: fill L1 with other prompts instead. L1 evicts its least
    recently used blocks first, the probe's, which write-through already copied to L2."""
    l1 = stats["tiers"]["l1"]
    l1_tokens = l1["capacity_bytes"] // kvb
    block_tokens = l1["capacity_bytes"] // max(l1["capacity_blocks"], 1) // kvb
    total = l1_tokens + 4 * block_tokens  # L2 must hold warm-up + probe + this: no more than needed
    sent = 0
    while sent < total:
        n = min(chunk, total - sent)
        await send(h, random_ids(g, n, h.vocab), 1)
        sent += n
    return sent


async def probes(h: Http, a, config: str, g: np.random.Generator, kvb: int, max_len: int) -> dict:
    """Cold, L1-hit and L2-hit TTFT of one --probe-tokens prompt (and of 100K tokens with --probe-100k)."""
    out, stats = {}, await cache_stats(h)
    has_l2 = bool(stats and stats["tiers"]["l2"]["capacity_blocks"])
    l1_tokens = stats["tiers"]["l1"]["capacity_bytes"] // kvb if stats else 0
    l2_tokens = stats["tiers"]["l2"]["capacity_bytes"] // kvb if stats else 0
    for n in [a.probe_tokens] + ([100_000] if a.probe_100k else []):
        name = probe_name(n)
        if n + 2 > max_len:
            out[name] = dict(skipped=f"the server's context is {max_len} tokens")
            continue
        # the engine refuses a prompt that neither fits L1 nor streams (half of L1 + all of L2)
        if stats and n + 1 > l1_tokens and n + 1 > l1_tokens // 2 + l2_tokens:
            out[name] = dict(skipped=f"neither L1 nor half of L1 + L2 holds {n} tokens: pass a larger --l2")
            continue
        prompt, opener = random_ids(g, n, h.vocab), random_ids(g, max(n // 8, 32), h.vocab)
        if has_l2:
            await send(h, opener, 1)
        p = out[name] = dict(cold=await timed(h, prompt))
        if p["cold"]["ttft_ms"]:
            p["cold"]["s_per_token"] = p["cold"]["ttft_ms"] / 1e3 / n
        if config != "off":
            p["l1_hit"] = await timed(h, prompt)
        if has_l2:
            p["filler_tokens"] = await push_out_of_l1(h, stats, min(n, max(l1_tokens // 2, 16)), g, kvb)
            # a first load from L2 (the opener's) runs the L2 -> L1 path's first-use costs (kernel
            # compilation) outside the measured hit
            p["l2_first_load"] = await timed(h, opener)
            p["l2_hit"] = await timed(h, prompt)
    return out


def probe_name(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 else str(n)
