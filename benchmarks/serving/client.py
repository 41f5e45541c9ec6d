"""The benchmark's HTTP client: one streamed /v1/completions request timed token by token (TTFT
from the request's arrival, inter-token gaps, usage.cached_tokens), the /v1/cache/stats counters
and the engine's time series of /metrics. It only speaks the public HTTP API and never decides
what to send or when.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass(slots=True)
class Result:
    prompt_tokens: int
    max_tokens: int
    arrival: float = 0.0  # perf_counter() when the request arrived; TTFT and e2e count from here
    wait: float = 0.0  # arrival -> sent (a multi-round arrival waiting for an idle conversation)
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_ids: list[int] | None = None
    error: str | None = None


@dataclass(slots=True)
class Http:
    client: httpx.AsyncClient
    url: str
    headers: dict
    model: str
    vocab: int


def tokens_in(choice: dict) -> list[str]:
    """The tokens one streamed choice carries: its logprobs' token strings (ids as decimal strings
    on a server without a tokenizer), or its text as one piece from a server that sends no logprobs."""
    named = (choice.get("logprobs") or {}).get("tokens")
    return named or ([choice["text"]] if choice.get("text") else [])


async def send(h: Http, prompt: list[int], max_tokens: int, res: Result | None = None) -> Result:
    """One streamed completion, filling `res` as it goes (so a caller that cancels it keeps what
    arrived), timed from `res.arrival` (default: now). logprobs=0 puts each sampled token in its
    own event, as its id when the server has no tokenizer (then the answer can join a multi-round
    history exactly)."""
    body = {"model": h.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    now = time.perf_counter()
    if res is None:
        res = Result(len(prompt), max_tokens, arrival=now)
    res.prompt_tokens, res.max_tokens, res.wait = len(prompt), max_tokens, now - res.arrival
    pieces, start, last = [], res.arrival, None
    try:
        async with h.client.stream("POST", h.url + "/v1/completions", json=body, headers=h.headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, ev = time.perf_counter(), json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"].get("message", ev["error"]))[:200]
                if ev.get("usage"):  # after the last token: its count is the server's
                    res.completion_tokens = ev["usage"]["completion_tokens"]
                    res.cached_tokens = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for choice in ev.get("choices") or ():
                    tokens = tokens_in(choice)
                    if not tokens:
                        continue
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    pieces += tokens
                    res.completion_tokens = len(pieces)
    except httpx.HTTPError as err:
        res.error = f"{type(err).__name__}: {err}"[:200]
    res.e2e = time.perf_counter() - start
    if all(p.isdigit() and int(p) < h.vocab for p in pieces) and pieces:
        res.output_ids = [int(p) for p in pieces]
    if res.error is None and (res.ttft is None or res.completion_tokens != max_tokens):
        res.error = f"{res.completion_tokens} of {max_tokens} tokens"
    return res


async def profile_server(h: Http, seconds: float, after: float = 0.0) -> Path | str:
    """The server's torch profiler (/start_profile, /stop_profile) on for `seconds`, from `after`
    seconds on: the trace's path as the server answers it, or what went wrong."""
    await asyncio.sleep(after)
    r = await h.client.post(h.url + "/start_profile", headers=h.headers)
    if r.status_code != 200:
        return f"/start_profile answered {r.status_code}: {r.text[:300]}"
    await asyncio.sleep(seconds)
    r = await h.client.post(h.url + "/stop_profile", headers=h.headers)
    if r.status_code != 200:
        return f"/stop_profile answered {r.status_code}: {r.text[:300]}"
    return Path(r.json()["trace"])


async def cache_stats(h: Http) -> dict | None:
    """The server's /v1/cache/stats (None where the server has no such route)."""
    try:
        r = await h.client.get(h.url + "/v1/cache/stats", headers=h.headers)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


# /metrics samples of where the engine thread's time goes (tierkv/server/metrics.py), by label
ENGINE_TIME = {"tierkv_engine_step_batch_size_count": ("kind",), "tierkv_engine_step_batch_size_sum": ("kind",),
               "tierkv_engine_step_batch_size_bucket": ("kind", "le"),
               "tierkv_engine_host_seconds_total": ("phase",), "tierkv_engine_idle_seconds_total": (),
               "tierkv_engine_gpu_seconds_total": ("kind",), "tierkv_engine_load_wait_steps_total": (),
               "tierkv_engine_load_wait_gpu_seconds_total": (), "tierkv_engine_kernel_compiles_total": (),
               "tierkv_engine_kernel_compile_seconds_total": ()}


async def engine_time(h: Http) -> dict | None:
    """{sample name, then ":" and each of its labels' values: value} of the engine-time series on
    /metrics (None where the server exports none)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await h.client.get(h.url + "/metrics", headers=h.headers)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name in ENGINE_TIME:
                out[":".join([s.name, *(s.labels[label] for label in ENGINE_TIME[s.name])])] = s.value
    return out or None


def engine_time_delta(before: dict | None, after: dict | None) -> dict | None:
    """Between two engine_time() readings: steps by kind, their mean batch, how many steps of each
    kind ran each batch size ({kind: {size: steps}}; past 8 a size stands for the sizes up to it
    from the one before), the seconds of steps that launched nothing (idle), the GPU's seconds on
    the steps by kind, the steps launched with loads in flight and their GPU seconds, the Triton
    compiles after start-up and their seconds, and the engine thread's seconds by phase."""
    if not before or not after:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    def by(prefix: str) -> dict[str, float]:
        return {k[len(prefix):]: v for k, v in d.items() if k.startswith(prefix)}

    steps = {kind: int(v) for kind, v in by("tierkv_engine_step_batch_size_count:").items()}
    total = sum(steps.values())
    batches = {}
    for kind in steps:  # the cumulative buckets' deltas, back to steps per bucket
        buckets = by(f"tierkv_engine_step_batch_size_bucket:{kind}:")
        cumulative = sorted((float(le), int(v)) for le, v in buckets.items())
        below = 0
        batches[kind] = {}
        for le, n in cumulative:
            if n > below:
                batches[kind]["inf" if le == float("inf") else str(int(le))] = n - below
            below = n
    return dict(steps=steps, batches=batches,
                mean_batch=sum(by("tierkv_engine_step_batch_size_sum:").values()) / total if total else 0.0,
                idle_s=d["tierkv_engine_idle_seconds_total"], gpu_s=by("tierkv_engine_gpu_seconds_total:"),
                load_wait_steps=int(d.get("tierkv_engine_load_wait_steps_total", 0)),
                load_wait_gpu_s=d.get("tierkv_engine_load_wait_gpu_seconds_total", 0.0),
                kernel_compiles=int(d.get("tierkv_engine_kernel_compiles_total", 0)),
                kernel_compile_s=d.get("tierkv_engine_kernel_compile_seconds_total", 0.0),
                host_s=by("tierkv_engine_host_seconds_total:"))


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """Per tier, what happened between two stats snapshots: hit tokens (the cache counts every
    lookup, and a request waiting for room is looked up again each step, so these are good as
    fractions, not per request), bytes read out (L2: loads into L1 over PCIe; L3: disk reads) and
    bytes written in; under "l3", "reads": its reads' count, abandoned ones and actual/estimate."""
    if before is None or after is None:
        return None
    out = {t: {k: after["tiers"][t][k] - before["tiers"][t][k] for k in ("hit_tokens", "bytes_out", "bytes_in")}
           for t in ("l1", "l2", "l3")}
    reads, was = after.get("l3_reads"), before.get("l3_reads")
    if reads and was:  # the point's L3 reads against their estimates, and the recompute cost they were weighed with
        out["l3"]["reads"] = {"timed": reads["timed"] - was["timed"], "abandoned": reads["abandoned"] - was["abandoned"],
                              "mean_actual_over_estimate": reads["mean_actual_over_estimate"],
                              "recent": reads["recent"][-8:],
                              "recompute_seconds_per_token": after.get("recompute_seconds_per_token")}
    return out
