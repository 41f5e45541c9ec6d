"""Prometheus metrics of tierkv-serve: request counts and latencies, queue depths, cache counters.

Request metrics are observed by app.py: prompt and cached tokens once a request has its first
token (so that aborted requests count as the cache's own hit counters count them), the rest as it
finishes. The cache's own counters (`Engine.cache_stats()`; per rank too under tensor
parallelism) and the engine's step and request histograms (`Engine.engine_stats()`) are read at
scrape time from the snapshots the engine thread keeps, so a scrape never waits for the engine;
the queue depths are read live (AsyncEngine.num_running). Each tierkv_* family that has a vLLM
counterpart is also exported under vLLM's name (VLLM_NAMES), read from the same measurement. Each
server has its own registry (no globals). This file never reads request bodies or headers (no
secrets can reach a metric).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from ..metrics import TIER_COUNTER_METRICS

# Buckets fit both a GPU (ms) and a loaded CPU (seconds).
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
TIERS = ("l1", "l2", "l3")

# vLLM's names (v1 engine; labels model_name and engine="0", as vLLM's one engine has) for what
# tierkv measures the same way: autoscalers, schedulers and dashboards read these. Each is the
# tierkv_* family on the right, renamed; a label vLLM's family lacks (tier) is summed over.
VLLM_NAMES = {
    "vllm:num_requests_running": ("tierkv_requests_running", "requests in the engine's running batch"),
    "vllm:num_requests_waiting": ("tierkv_requests_waiting", "requests waiting to be admitted (production-stack's "
                                  "KEDA trigger, llm-d's scheduler)"),
    "vllm:kv_cache_usage_perc": ("tierkv_kv_cache_usage", "KV-cache usage, 1 is full: the fraction of L1 blocks "
                                 "that requests hold (cached blocks no request holds can be evicted, as in vLLM)"),
    "vllm:gpu_cache_usage_perc": ("tierkv_kv_cache_usage", "the same, under vLLM's name before 0.10"),
    "vllm:prefix_cache_queries": ("tierkv_prefix_cache_query_tokens", "prefix-cache lookups, in tokens queried"),
    "vllm:prefix_cache_hits": ("tierkv_prefix_cache_hit_tokens", "prefix-cache hits, in tokens found (any tier)"),
    # vLLM's names for the same two before 0.10, and vLLM 0.x's ratio: production-stack's router reads these three
    "vllm:gpu_prefix_cache_queries": ("tierkv_prefix_cache_query_tokens", "the same as vllm:prefix_cache_queries, "
                                      "under vLLM's name before 0.10"),
    "vllm:gpu_prefix_cache_hits": ("tierkv_prefix_cache_hit_tokens", "the same as vllm:prefix_cache_hits, under "
                                   "vLLM's name before 0.10"),
    "vllm:gpu_prefix_cache_hit_rate": ("tierkv_prefix_cache_hit_rate", "prefix-cache hit tokens over queried tokens "
                                       "since the start, any tier (vLLM's name before 0.10)"),
    "vllm:num_preemptions": ("tierkv_preemptions", "requests preempted: their blocks given back, resumed later"),
    "vllm:prompt_tokens": ("tierkv_prompt_tokens", "prompt tokens of requests that got their first token"),
    "vllm:generation_tokens": ("tierkv_generation_tokens", "output tokens of finished requests"),
    "vllm:request_success": ("tierkv_requests_finished", "finished requests by finished_reason (stop, length); "
                             "requests whose client left are tierkv_requests_aborted"),
    "vllm:time_to_first_token_seconds": ("tierkv_time_to_first_token_seconds", "arrival to first token"),
    "vllm:request_time_per_output_token_seconds": ("tierkv_time_per_output_token_seconds",
                                                   "per request, the mean time between output tokens"),
    "vllm:e2e_request_latency_seconds": ("tierkv_e2e_request_latency_seconds", "arrival to last token"),
    "vllm:inter_token_latency_seconds": ("tierkv_inter_token_latency_seconds", "each gap between a request's "
                                         "consecutive tokens, at the engine"),
    "vllm:iteration_tokens_total": ("tierkv_iteration_tokens", "per step: the prompt tokens of the requests that got "
                                    "their first token, plus the tokens sampled"),
    "vllm:request_prompt_tokens": ("tierkv_request_prompt_tokens", "prompt tokens of each finished request"),
    "vllm:request_queue_time_seconds": ("tierkv_request_queue_time_seconds", "per finished request, arrival at the "
                                        "engine to its first admission (WAITING)"),
    "vllm:request_prefill_time_seconds": ("tierkv_request_prefill_time_seconds", "per finished request, first "
                                          "admission to first token (PREFILL)"),
    "vllm:request_decode_time_seconds": ("tierkv_request_decode_time_seconds", "per finished request, first token to "
                                         "last token (DECODE)"),
}
# vllm:cache_config_info, an info gauge (always 1) whose labels describe the cache, is made from
# the engine's configuration (_VLLMNames.collect).

# The engine's histograms (EngineStats, with vLLM's buckets): tierkv's name, the snapshot's key, what.
_ENGINE_HISTOGRAMS = (
    ("tierkv_iteration_tokens", "iteration_tokens", "per step: prompt tokens of the requests that got their first "
     "token (once per request), plus the tokens sampled"),
    ("tierkv_inter_token_latency_seconds", "inter_token_latency", "each gap between consecutive tokens of a request "
     "(each choice's own), at the engine"),
    ("tierkv_request_prompt_tokens", "request_prompt_tokens", "prompt tokens of each finished request"),
    ("tierkv_request_queue_time_seconds", "request_queue_time", "finished requests: arrival at the engine to first "
     "admission"),
    ("tierkv_request_prefill_time_seconds", "request_prefill_time", "finished requests: first admission to first "
     "token, preemptions included"),
    ("tierkv_request_decode_time_seconds", "request_decode_time", "finished requests: first token to last token"),
)


class ServerMetrics:
    def __init__(self, engine, model_name: str, cache_info: dict, kv_events=None) -> None:
        """`engine`: the AsyncEngine whose queue depths and stats snapshot are exported;
        `model_name`: the served name, vLLM's `model_name` label; `cache_info`: the labels of
        vllm:cache_config_info; `kv_events`: the KVEventPublisher, when KV-cache events are published."""
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
        # counted when a request gets its first token, whether or not it finishes; the cache counts
        # tierkv_prefix_cache_hit_tokens when it admits the prompt (a step before)
        self.prompt_tokens = Counter("tierkv_prompt_tokens", "prompt tokens of requests that got their first token",
                                     registry=r)
        self.cached_tokens = Counter("tierkv_cached_prompt_tokens", "prompt tokens served from the cache, of "
                                     "requests that got their first token", registry=r)
        self.generation_tokens = Counter("tierkv_generation_tokens", "output tokens of finished requests", registry=r)
        self.finished = Counter("tierkv_requests_finished", "requests finished, by finished_reason",
                                ["finished_reason"], registry=r)
        self.unknown_fields = Counter("tierkv_request_unknown_fields", "request fields no schema field takes, ignored: "
                                      "by name for fields other servers take (protocol.FOREIGN_FIELDS), else other",
                                      ["field"], registry=r)
        self.aborted = Counter("tierkv_requests_aborted", "requests cut short (client gone, shutdown)",
                               registry=r)
        self.closed = Counter("tierkv_http_connections_closed", "connections closed by a limit: header, body, "
                              "send or idle timeout, or the connection cap", ["reason"], registry=r)
        self.open_connections = Gauge("tierkv_http_connections_open", "open HTTP connections", registry=r)
        engine_collector = _EngineCollector(engine)
        r.register(engine_collector)
        if kv_events is not None:
            r.register(_KVEventsCollector(kv_events))
        sources = [engine_collector, self.prompt_tokens, self.generation_tokens, self.finished, self.ttft, self.tpot,
                   self.e2e]
        r.register(_VLLMNames(sources, {"model_name": model_name, "engine": "0"}, cache_info))

    def first_token(self, *, prompt_tokens: int, cached_tokens: int) -> None:
        """A request computed its prompt (once per request, whatever its n)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)

    def observe(self, *, ttft: float | None, e2e: float, completion_tokens: int, finished_reason: str) -> None:
        """A request finished: its latencies, output tokens (all choices) and why it ended."""
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (completion_tokens - 1))
        self.e2e.observe(e2e)
        self.generation_tokens.inc(completion_tokens)
        self.finished.labels(finished_reason).inc()

    def count_unknown_fields(self, labels: list[str]) -> None:
        for label in labels:
            self.unknown_fields.labels(label).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def l1_held_fraction(stats: dict) -> float:
    """The fraction of L1's bytes that running requests hold, from cache stats (with a cache per
    group of layers, whose blocks differ in size, over every group's)."""
    held = capacity = 0
    for part in stats.get("groups") or [stats]:
        l1 = part.get("tiers", {}).get("l1", {})
        if l1.get("capacity_blocks"):
            held += (l1["used_blocks"] - l1["evictable_blocks"]) * l1["capacity_bytes"] / l1["capacity_blocks"]
            capacity += l1["capacity_bytes"]
    return held / capacity if capacity else 0.0


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
        yield GaugeMetricFamily("tierkv_kv_cache_usage", "fraction of L1 that requests hold (the rest is free or "
                                "cached and evictable)", value=l1_held_fraction(s))
        yield CounterMetricFamily("tierkv_warmed_blocks", "L2 blocks loaded into L1 for a request waiting for room, "
                                  "before it was admitted", value=s.get("warmed_blocks", 0))
        yield CounterMetricFamily("tierkv_warmed_unused_blocks", "of those, blocks evicted from L1 again before the "
                                  "request took them (their loads were for nothing)", value=s.get("warmed_unused", 0))
        fam = CounterMetricFamily("tierkv_l1_slot_waits", "L1 slots the compute stream took while a copy was still "
                                  "at them, so that it waited for that copy: a save of the block evicted from it, or "
                                  "a load into it", labels=["copy"])
        fam.add_metric(["save"], s.get("slot_waits_on_saves", 0))
        fam.add_metric(["load"], s.get("slot_waits_on_loads", 0))
        yield fam
        yield CounterMetricFamily("tierkv_prefix_cache_queries", "prefix lookups used (sequences admitted)",
                                  value=s.get("queries", 0))
        yield CounterMetricFamily("tierkv_prefix_cache_query_tokens", "tokens those lookups could have hit",
                                  value=s.get("query_tokens", 0))
        yield GaugeMetricFamily("tierkv_prefix_cache_hit_rate", "hit tokens over query tokens since the start",
                                value=s.get("hit_rate", 0.0))
        e = eng.engine_stats or {}
        yield CounterMetricFamily("tierkv_preemptions", "requests preempted (their blocks given back; resumed later "
                                  "from what the cache still holds)", value=e.get("num_preemptions", 0))
        for name, key, doc in _ENGINE_HISTOGRAMS:
            if key in e:
                yield _histogram(name, doc, e[key])
        yield from _engine_time(e)
        for name, (key, doc) in TIER_COUNTER_METRICS.items():
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
        # one sample per L3 store, labelled as /health names it (its URL without options or credentials)
        fam = GaugeMetricFamily("tierkv_tier_healthy", "1 while a tier's store answers; 0 while it is degraded (hung, "
                                "down, or its writes fail; /health says why): its lookups miss meanwhile",
                                labels=["tier", "store"])
        for store in s.get("l3_stores", []):
            fam.add_metric(["l3", store["store"]], 1.0 if store["healthy"] else 0.0)
        yield fam
        yield GaugeMetricFamily("tierkv_l3_write_backlog_blocks", "write-through: new L1 blocks waiting for room in L2 "
                                "(its slots held by blocks on their way to L3) to go on to L3; a backlog that grows "
                                "means L3 writes are slower than new blocks come",
                                value=tiers.get("l3", {}).get("write_backlog_blocks", 0))
        # the whole L2 pool is page-locked at start when it is pinned, used or not
        yield GaugeMetricFamily("tierkv_pinned_host_bytes", "page-locked host memory of the L2 pool",
                                value=tiers.get("l2", {}).get("capacity_bytes", 0) if self.l2_pinned else 0)


def _engine_time(e: dict):
    """Where the engine thread's time goes (EngineStats): its steps, their batch, its host phases,
    the time in steps that launched nothing and the GPU's time on the steps."""
    yield _histogram("tierkv_engine_step_batch_size", "requests in each step launched, by kind: decode (every "
                     "request one token) or mixed (some computing prompt tokens); _count is the steps, _sum over "
                     "_count the mean batch", e.get("step_batch", {}), label="kind")
    yield _labelled("tierkv_engine_host_seconds", "engine-thread seconds by phase of a step: schedule, launch (the "
                    "model's kernels), wait (blocked until the GPU finished the previous step: time the host had to "
                    "spare) and postprocess (taking that step's tokens back and handing them over)", "phase",
                    e.get("host_seconds", {}))
    yield CounterMetricFamily("tierkv_engine_idle_seconds", "seconds of steps that launched nothing while requests "
                              "were unfinished (waiting for loads into L1, for L1 room or for L3 reads): the GPU "
                              "had no work of this engine", value=e.get("idle_seconds", 0.0))
    yield _labelled("tierkv_engine_gpu_seconds", "the GPU's seconds on the engine's steps by kind, each from its "
                    "first kernel to its last copy (waits for loads included; 0 on a CPU): against the wall time, "
                    "what the GPU idled", "kind", e.get("gpu_seconds", {}))
    yield CounterMetricFamily("tierkv_engine_load_wait_steps", "steps launched while loads into their requests' "
                              "blocks were in flight (the GPU may have waited for them)",
                              value=e.get("load_wait_steps", 0))
    yield CounterMetricFamily("tierkv_engine_load_wait_gpu_seconds", "the GPU's seconds on those steps, their "
                              "waits for the loads included", value=e.get("load_wait_gpu_seconds", 0.0))
    compiles = e.get("kernel_compiles", {})
    yield CounterMetricFamily("tierkv_engine_kernel_compiles", "Triton compilations after start-up: kernel variants "
                              "the warm-up missed, each stalling the steps behind it (0 is healthy)",
                              value=compiles.get("compiles", 0))
    yield CounterMetricFamily("tierkv_engine_kernel_compile_seconds", "seconds those compilations took",
                              value=compiles.get("compile_seconds", 0.0))


def _labelled(name: str, doc: str, label: str, values: dict) -> CounterMetricFamily:
    """A counter with one sample per `label` value: {label value: count}."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family

def _histogram(name: str, doc: str, snap: dict, label: str | None = None) -> HistogramMetricFamily:
    """A Histogram snapshot (tierkv/engine/stats.py: counts per bucket) as Prometheus' cumulative
    buckets; with `label`, `snap` is {label value: snapshot}, one histogram each."""
    if label is None:
        return HistogramMetricFamily(name, doc, buckets=_cumulative(snap), sum_value=snap["sum"])
    family = HistogramMetricFamily(name, doc, labels=[label])
    for key, one in snap.items():
        family.add_metric([key], _cumulative(one), one["sum"])
    return family


def _cumulative(snap: dict) -> list[tuple[str, int]]:
    buckets, total = [], 0
    for bound, n in zip((*snap["bounds"], float("inf")), snap["counts"]):
        total += n
        buckets.append((floatToGoString(bound), total))
    return buckets


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


class _VLLMNames:
    """The VLLM_NAMES families: each source family renamed, labelled, summed over the labels
    vLLM's family lacks; and vllm:cache_config_info."""

    def __init__(self, sources: list, labels: dict[str, str], cache_info: dict) -> None:
        self.sources, self.labels, self.cache_info = sources, labels, cache_info

    def describe(self):
        return []

    def collect(self):
        families = {f.name: f for source in self.sources for f in source.collect()}
        for name, (source, doc) in VLLM_NAMES.items():
            if source in families:  # the engine's histograms exist once its first snapshot does
                yield self._renamed(families[source], name, doc)
        info = GaugeMetricFamily("vllm:cache_config_info", "the KV cache's configuration (vLLM's CacheConfig: "
                                 "num_gpu_blocks is L1, num_cpu_blocks L2)", labels=[*self.cache_info, "engine"])
        info.add_metric([*map(str, self.cache_info.values()), self.labels["engine"]], 1)
        yield info

    def _renamed(self, family, name: str, doc: str):
        out = Metric(name, doc, family.type)
        kept = ("finished_reason", "le")  # the labels vLLM's families have besides ours
        sums: dict[tuple, float] = {}
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {k: v for k, v in sample.labels.items() if k in kept}
            key = (name + sample.name[len(family.name):], tuple(labels.items()))
            sums[key] = sums.get(key, 0.0) + sample.value
        for (sample_name, labels), value in sums.items():
            out.samples.append(Sample(sample_name, {**self.labels, **dict(labels)}, value))
        return out
