"""Counters the cache keeps about itself, reported by `TieredKVCache.stats()`.

Plain integers updated in place on the hot path (no locks, no allocation); the server layer
turns them into Prometheus metrics. This file must never import anything above it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


# The per-tier counters as metrics, named once for every place that exports them (tierkv-serve's
# /metrics, the vLLM connector's Prometheus metrics): name -> (TierCounters field, help text)
TIER_COUNTER_METRICS = {
    "tierkv_prefix_cache_hit_tokens": ("hit_tokens", "prefix tokens taken from the cache, by the tier each came from"),
    "tierkv_tier_bytes_in": ("bytes_in", "bytes written into a tier"),
    "tierkv_tier_bytes_out": ("bytes_out", "bytes read out of a tier"),
    "tierkv_tier_blocks_in": ("blocks_in", "blocks written into a tier"),
    "tierkv_tier_blocks_out": ("blocks_out", "blocks read out of a tier"),
    "tierkv_tier_evictions": ("evictions", "blocks a tier gave up (demoted or dropped)"),
    "tierkv_tier_drops": ("drops", "evictions that left no copy in any tier"),
    "tierkv_tier_errors": ("errors", "failed reads/writes of a tier (L3 errors), counted as misses"),
}


@dataclass(slots=True)
class TierCounters:
    hit_tokens: int = 0  # prefix tokens taken from this tier (allocate, adopt, retrieve)
    blocks_in: int = 0  # blocks written into this tier
    blocks_out: int = 0  # blocks read out of this tier (loads to a faster tier, retrieve)
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0  # blocks this tier gave up, demoted or not
    drops: int = 0  # evictions that left no copy in any tier
    errors: int = 0  # failed reads/writes (L3), counted, never raised


@dataclass(slots=True)
class CacheCounters:
    queries: int = 0  # prefix lookups used: allocate (admit), retrieve
    query_tokens: int = 0  # tokens those lookups could have hit (the limit of each)
    hit_tokens: int = 0  # tokens they hit, all tiers together (and what adopt added)
    stored_blocks: int = 0  # new blocks entered into the index (store or commit)
    warmed_blocks: int = 0  # L2 blocks loaded into L1 ahead of their request (Admission.warm)
    warmed_unused: int = 0  # of those, evicted from L1 before a sequence took them: loads for nothing
    # L1 slots the compute stream took while a copy was still at them, so that it waited for the
    # copy (take_l1): a save still reading the evicted block, or a load still writing it
    slot_waits_on_saves: int = 0
    slot_waits_on_loads: int = 0
    tiers: dict[str, TierCounters] = field(default_factory=lambda: {t: TierCounters() for t in ("l1", "l2", "l3")})

    def as_dict(self) -> dict:
        out = asdict(self)
        out["hit_rate"] = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        return out
