"""Physical floors: the bounds measured in the same run (host->device copy, raw disk read, cold
prefill per token) and each hit's best possible TTFT from them. The measuring itself is
benchmarks/limits.py's; this file adds the CPU fallback and the 'kind' strings the JSON records,
and never talks to a server.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from limits import disk_read_bandwidth as raw_disk_read_bandwidth
from limits import h2d_bandwidth as pinned_h2d_bandwidth

from .client import Result
from .figures import pct
from .presets import GiB

DISK_CHUNK = 8 << 20  # the raw read's request size; the probe reads whole chunks only


def h2d_bandwidth(nbytes: int) -> tuple[float, str]:
    """The L2 -> L1 bound: one pinned host -> GPU copy; on a CPU, a memcpy."""
    import torch

    if torch.cuda.is_available():
        bw = pinned_h2d_bandwidth(nbytes)
        torch.cuda.empty_cache()  # the servers need that device memory more than this process does
        return bw, f"pinned host->device copy of {nbytes / GiB:.2f} GiB"
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * nbytes / (time.perf_counter() - t), f"host memcpy of {nbytes / 2**20:.0f} MiB (no CUDA)"


def disk_read_bandwidth(directory: Path, nbytes: int) -> tuple[float, str]:
    """The disk tier's bound: a sequential read of an nbytes file in `directory` (where the L3
    lives), from the disk itself (O_DIRECT, or buffered after evicting it from the page cache)."""
    return raw_disk_read_bandwidth(directory, nbytes, chunk=DISK_CHUNK)


def probe_floor(hit: dict, limits: dict, kvb: int, cold_s_per_token: float) -> dict:
    """The physical floor of one isolated hit, from its tier split (fractions of the stats' lookup
    counts applied to usage.cached_tokens: a request waiting for an L3 prefetch is looked up twice)."""
    by_tier = hit.get("hit_tokens") or {"l1": 1, "l2": 0, "l3": 0}
    total = sum(by_tier.values()) or 1
    loaded = {t: hit["cached_tokens"] * n / total * kvb for t, n in by_tier.items()}
    floor = (loaded["l2"] / limits["h2d_bytes_per_s"] + loaded["l3"] / limits["disk_read_bytes_per_s"]
             + (hit["tokens"] - hit["cached_tokens"]) * cold_s_per_token)
    return dict(floor_ms=floor * 1e3, loaded_bytes=loaded,
                ttft_over_floor=hit["ttft_ms"] / 1e3 / floor if hit["ttft_ms"] and floor > 0 else None)


def trace_floors(s: dict, results: list[Result], limits: dict, kvb: int, cold_s_per_token: float) -> dict:
    """Each hit's floor, its cached tokens split by the workload's aggregate tier fractions."""
    hits = s["hit_tokens"] or {"l1": 1, "l2": 0, "l3": 0}
    total = sum(hits.values()) or 1
    per_token = (hits["l2"] / total * kvb / limits["h2d_bytes_per_s"]
                 + hits["l3"] / total * kvb / limits["disk_read_bytes_per_s"])
    floors, ratios = [], []
    for r in results:
        f = r.cached_tokens * per_token + (r.prompt_tokens - r.cached_tokens) * cold_s_per_token
        if r.error is None and r.cached_tokens and f > 0:
            floors.append(f)
            ratios.append(r.ttft / f)
    return dict(hit_requests=len(floors), floor_ms=pct(floors), ttft_over_floor=pct(ratios, scale=1.0),
                tier_split="estimated: each request's cached tokens split by the workload's aggregate "
                           "per-tier hit fractions from /v1/cache/stats")


def cold_per_token(configs: dict, probe: str) -> tuple[float, str]:
    """The cold prefill cost per token: the off config's isolated cold probe, else the median of all."""
    def of(c):
        return ((configs[c]["probes"].get(probe) or {}).get("cold") or {}).get("s_per_token")

    if "off" in configs and of("off"):
        return of("off"), f"off config, isolated cold {probe} probe: TTFT / prompt tokens"
    values = [v for c in configs if (v := of(c))]
    return (statistics.median(values) if values else 0.0), f"median over configs of the isolated cold {probe} probe"


def add_floors(out: dict, raw: dict, kvb: int, probe: str) -> None:
    limits, configs = out["limits"], out["configs"]
    cold, source = cold_per_token(configs, probe)
    limits["cold_prefill_s_per_token"], limits["cold_prefill_source"] = cold, source
    for c, figures in configs.items():
        for name, p in figures["probes"].items():
            for kind in ("l1_hit", "l2_hit"):
                if kind in p and p[kind]["error"] is None:
                    own = p["cold"].get("s_per_token") or cold
                    p[kind].update(probe_floor(p[kind], limits, kvb, own))
        for w, s in figures["workloads"].items():
            s["floor"] = trace_floors(s, raw[c][w], limits, kvb, cold)
