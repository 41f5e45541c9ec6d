"""deploy/grafana/tierkv.json queries only what tierkv-serve exports.

A real server (tiny model, L1 + L2) is scraped once; every metric name that any PromQL
expression of the dashboard references (panels and template variables) must be a series on
/metrics, and every `label="value"` matcher must match a series. Names are compared as
Prometheus stores them: counters with _total, histograms as _bucket, _sum and _count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from load_helpers import tiny_model  # noqa: F401  (module fixture: a tiny Llama with a tokenizer)
from server_helpers import ServerProcess

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tierkv.json"
TARGET_LABELS = {"instance", "job"}  # added by Prometheus when it scrapes, not by the server

# What issue 17 asks the dashboard to show, as the series that carry it.
REQUIRED = {
    "per-tier hit tokens": "tierkv_prefix_cache_hit_tokens_total",
    "bytes moved into tiers": "tierkv_tier_bytes_in_total",
    "bytes moved out of tiers": "tierkv_tier_bytes_out_total",
    "evictions": "tierkv_tier_evictions_total",
    "TTFT percentiles": "tierkv_time_to_first_token_seconds_bucket",
    "TPOT percentiles": "tierkv_time_per_output_token_seconds_bucket",
    "queue length (waiting)": "tierkv_requests_waiting",
    "queue length (running)": "tierkv_requests_running",
    "L3 errors": "tierkv_tier_errors_total",
    "pinned memory": "tierkv_pinned_host_bytes",
    # issue 37: the scheduling series vLLM users read
    "preemptions": "tierkv_preemptions_total",
    "inter-token latency percentiles": "tierkv_inter_token_latency_seconds_bucket",
    "time waiting for admission": "tierkv_request_queue_time_seconds_bucket",
    "prefill time": "tierkv_request_prefill_time_seconds_bucket",
    "decode time": "tierkv_request_decode_time_seconds_bucket",
    "tokens per step": "tierkv_iteration_tokens_bucket",
    # write-through falling behind its L3 (new L1 blocks waiting for room in L2)
    "L3 write backlog": "tierkv_l3_write_backlog_blocks",
}

# strings, {matchers}, [ranges], numbers and durations (0.9, 5m), identifiers, single characters
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\{[^}]*\}|\[[^\]]*\]|\d[\w.]*|[A-Za-z_:][\w:]*|\S')
_IDENT = re.compile(r"[A-Za-z_:][\w:]*")
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}  # followed by (label, ...)
_KEYWORDS = {"bool", "and", "or", "unless", "offset"}


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """The metric selectors of a PromQL expression: (name, its label="value" matchers). A name
    is an identifier that is not a function or aggregation (those are followed by "(", or by
    by/without), not a keyword, and not in a by/without/on/ignoring label list; strings,
    {matchers} and [ranges] are single tokens, so nothing inside them is taken for a name."""
    template = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)\s*", expr)
    if template:  # Grafana's template-variable query: label_values(metric, label)
        return [(template.group(1), {})]
    tokens = _TOKEN.findall(expr)
    out = []
    i = 0
    while i < len(tokens):
        tok, nxt = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in _LABEL_LISTS and nxt == "(":
            i = tokens.index(")", i) + 1
            continue
        # "sum by (le) (...)": an aggregation's by/without may come before its "("
        if _IDENT.fullmatch(tok) and tok not in _KEYWORDS | _LABEL_LISTS and nxt not in ("(", "by", "without"):
            matchers = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', nxt)) if nxt.startswith("{") else {}
            out.append((tok, matchers))
        i += 1
    return out


def dashboard_exprs(dash: dict) -> list[str]:
    def walk(panels):
        for p in panels:
            yield from (t["expr"] for t in p.get("targets", []) if t.get("expr"))
            yield from walk(p.get("panels", []))  # collapsed rows hold their panels

    exprs = list(walk(dash["panels"]))
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def test_selector_parser():
    expr = ('histogram_quantile(0.9, sum by (le) (rate(a_seconds_bucket{tier="l3", instance=~"$x"}'
            '[$__rate_interval]))) / on(instance) group_left b_total offset 5m + sum without (tier) (c)')
    assert selectors(expr) == [("a_seconds_bucket", {"tier": "l3"}), ("b_total", {}), ("c", {})]
    assert selectors("label_values(tierkv_requests_running, instance)") == [("tierkv_requests_running", {})]


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory) -> dict[str, list[dict[str, str]]]:  # noqa: F811
    """Every series name on /metrics of a real server, with each series' labels."""
    log = tmp_path_factory.mktemp("grafana") / "serve.log"
    srv = ServerProcess(["--model", str(tiny_model), "--l1", "4MiB", "--l2", "4MiB", "--log-level", "warning"],
                        log, env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_ready()
        text = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()
    series: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(sample.labels)
    return series


def test_every_dashboard_query_uses_exported_metrics(exported):
    dash = json.loads(DASHBOARD.read_text())
    used = [(expr, name, matchers) for expr in dashboard_exprs(dash) for name, matchers in selectors(expr)]
    assert len({name for _, name, _ in used}) >= len(REQUIRED)
    missing = sorted({name for _, name, _ in used if name not in exported})
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
    for expr, name, matchers in used:
        for label, value in matchers.items():
            if label in TARGET_LABELS:
                continue
            assert any(s.get(label) == value for s in exported[name]), \
                f'{name}{{{label}="{value}"}} matches no exported series (in {expr})'
    names = {name for _, name, _ in used}
    absent = {what: name for what, name in REQUIRED.items() if name not in names}
    assert not absent, f"the dashboard does not show {absent}"


def test_dashboard_is_importable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "tierkv" and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and "datasource" in variables
        for t in p["targets"]:
            assert 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])  # the server picker applies
