"""Prometheus metrics of tierkv-serve: request counts and latencies, queue depths, cache counters.

Request metrics are observed by app.py as requests finish. Queue depths and the cache's own
counters (`Engine.cache_stats()`; per rank too under tensor parallelism) are read at scrape time from the snapshot the engine thread
keeps, so a scrape never touches the engine. Each server has its own registry (no globals).
This file never reads request bodies or headers (no secrets can reach a metric).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Buckets fit both a GPU (ms) and a loaded CPU (seconds).
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
TIERS = ("l1", "l2", "l3")


class ServerMetrics:
    def __init__(self, engine, kv_events=None) -> None:
        """`engine`: the AsyncEngine whose queue depths and stats snapshot are exported;
        `kv_events`: the KVEventPublisher, when KV-cache events are published."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tierkv_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("tierkv_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("tierkv_time_per_output_token_seconds",
                              "mean time between output tokens after the first", buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("tierkv_e2e_request_latency_seconds", "arrival to last token",
                             buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("tierkv_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("tierkv_cached_prompt_tokens", "prompt tokens served from the cache",
                                     registry=r)
        self.generation_tokens = Counter("tierkv_generation_tokens", "output tokens", registry=r)
        self.aborted = Counter("tierkv_requests_aborted", "requests cut short (client gone, shutdown)",
                               registry=r)
        self.closed = Counter("tierkv_http_connections_closed", "connections closed by a limit: header, body, "
                              "send or idle timeout, or the connection cap", ["reason"], registry=r)
        self.open_connections = Gauge("tierkv_http_connections_open", "open HTTP connections", registry=r)
        r.register(_EngineCollector(engine))
        if kv_events is not None:
            r.register(_KVEventsCollector(kv_events))

    def observe(self, *, ttft: float | None, e2e: float, prompt_tokens: int, cached_tokens: int,
                completion_tokens: int) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (completion_tokens - 1))
        self.e2e.observe(e2e)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the engine thread's snapshot at scrape time."""

    def __init__(self, engine) -> None:
        self.engine = engine
        # L2 is pinned (page-locked) or not once, when it is allocated; read here, not per scrape
        l2 = engine.engine.cache.l2
        self.l2_pinned = l2 is not None and l2.pinned

    def describe(self):
        return []  # computed at collect time; an empty describe skips the registration-time collect

    def collect(self):
        eng = self.engine
        yield GaugeMetricFamily("tierkv_requests_running", "requests holding L1 blocks", value=eng.num_running)
        yield GaugeMetricFamily("tierkv_requests_waiting", "requests queued for admission", value=eng.num_waiting)
        s = eng.stats or {}
        tiers = s.get("tiers", {})
        yield CounterMetricFamily("tierkv_prefix_cache_queries", "prefix lookups (match calls)",
                                  value=s.get("queries", 0))
        yield CounterMetricFamily("tierkv_prefix_cache_query_tokens", "tokens those lookups could have hit",
                                  value=s.get("query_tokens", 0))
        per_tier = {
            "tierkv_prefix_cache_hit_tokens": ("hit_tokens", "prefix tokens found, by tier"),
            "tierkv_tier_bytes_in": ("bytes_in", "bytes written into a tier"),
            "tierkv_tier_bytes_out": ("bytes_out", "bytes read out of a tier"),
            "tierkv_tier_blocks_in": ("blocks_in", "blocks written into a tier"),
            "tierkv_tier_blocks_out": ("blocks_out", "blocks read out of a tier"),
            "tierkv_tier_evictions": ("evictions", "blocks a tier gave up (demoted or dropped)"),
            "tierkv_tier_drops": ("drops", "evictions that left no copy in any tier"),
            "tierkv_tier_errors": ("errors", "failed reads/writes of a tier (L3 errors), counted as misses"),
        }
        for name, (key, doc) in per_tier.items():
            fam = CounterMetricFamily(name, doc, labels=["tier"])
            for t in TIERS:
                fam.add_metric([t], tiers.get(t, {}).get(key, 0))
            yield fam
        for name, key, doc in (("tierkv_tier_used_blocks", "used_blocks", "blocks in use"),
                               ("tierkv_tier_capacity_blocks", "capacity_blocks", "blocks a tier holds"),
                               ("tierkv_tier_used_bytes", "used_bytes", "bytes of the blocks in use"),
                               ("tierkv_tier_capacity_bytes", "capacity_bytes", "bytes of a tier's pool")):
            fam = GaugeMetricFamily(name, doc, labels=["tier"])
            for t in ("l1", "l2"):
                fam.add_metric([t], tiers.get(t, {}).get(key, 0))
            yield fam
        # tensor parallel: the families above hold all ranks together; these, each rank's own
        # bytes (the L1/L2 moves a worker repeated, so a rank out of step shows here)
        for name, key, doc in (("tierkv_rank_tier_bytes_in", "bytes_in", "bytes a rank wrote into a tier"),
                               ("tierkv_rank_tier_bytes_out", "bytes_out", "bytes a rank read out of a tier")):
            if s.get("ranks"):
                fam = CounterMetricFamily(name, doc, labels=["rank", "tier"])
                for rank in s["ranks"]:
                    for t in ("l1", "l2"):
                        fam.add_metric([str(rank["rank"]), t], rank["tiers"].get(t, {}).get(key, 0))
                yield fam
        # the whole L2 pool is page-locked at start when it is pinned, used or not
        yield GaugeMetricFamily("tierkv_pinned_host_bytes", "page-locked host memory of the L2 pool",
                                value=tiers.get("l2", {}).get("capacity_bytes", 0) if self.l2_pinned else 0)


class _KVEventsCollector:
    """The KV-event publisher's counters, read at scrape time."""

    def __init__(self, publisher) -> None:
        self.publisher = publisher

    def describe(self):
        return []

    def collect(self):
        p = self.publisher
        yield CounterMetricFamily("tierkv_kv_events_batches", "KV-event batches published (one ZMQ message each)",
                                  value=p.published)
        yield CounterMetricFamily("tierkv_kv_events_dropped", "block events dropped unpublished: the queue "
                                  "(max_queue_size) was full, so routers miss those changes", value=p.events.dropped)
