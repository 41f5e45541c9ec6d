"""tierkv's counters as vLLM's connector stats and Prometheus metrics.

The scheduler side reports, each step something changed, the counters' growth since its last
report (KVConnectorStats: summed over reports, logged by vLLM as "KV Transfer metrics"); the
Prometheus counters take the same figures under tierkv-serve's names (tierkv.metrics), labelled
by tier, beside vLLM's own engine labels. Reads counters only; never changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from tierkv.metrics import TIER_COUNTER_METRICS, CacheCounters

TIERS = ("l2", "l3")  # the connector's tiers (vLLM's own blocks are L1)
FIELDS = sorted({key for key, _ in TIER_COUNTER_METRICS.values()})


def snapshot(counters: list[CacheCounters]) -> dict[str, int]:
    """The counters as a flat {"<tier>.<field>": value}, summed over the caches of vLLM's KV-cache
    groups but for the hit tokens, which are the first's (the lead group's: each group serves the
    same hit, a sliding-window group loading only part of it)."""
    return {f"{t}.{f}": sum(getattr(c.tiers[t], f) for c in (counters[:1] if f == "hit_tokens" else counters))
            for t in TIERS for f in FIELDS}


@dataclass
class TierKVStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> TierKVStats:
        merged = dict(self.data)
        for k, v in other.data.items():
            merged[k] = merged.get(k, 0) + v
        return TierKVStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsReporter:
    """The growth of the counters since the last report (None when nothing grew)."""

    def __init__(self, counters: list[CacheCounters]) -> None:
        self.counters = counters
        self.last = snapshot(counters)

    def take(self) -> TierKVStats | None:
        now = snapshot(self.counters)
        grown = {k: now[k] - self.last[k] for k in now if now[k] != self.last[k]}
        self.last = now
        return TierKVStats(grown) if grown else None


class TierKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls
        self.counters = {}  # (field, tier, engine) -> a labelled counter
        for name, (key, doc) in TIER_COUNTER_METRICS.items():
            family = counter(name=name, documentation=doc, labelnames=[*labelnames, "tier"])
            for engine, values in per_engine_labelvalues.items():
                for tier in TIERS:
                    self.counters[(key, tier, engine)] = family.labels(*values, tier)

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            tier, key = k.split(".", 1)
            c = self.counters.get((key, tier, engine_idx))
            if c is not None and v > 0:
                c.inc(v)
