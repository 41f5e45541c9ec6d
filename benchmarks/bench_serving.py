"""bench_serving: how much do L2 and a disk L3 help a server under multi-turn chat load?

An HTTP load generator for tierkv-serve (or any OpenAI-compatible server given with --url).
The trace: conversations start as a Poisson process; each picks one of a few shared system
prompts and sends --turns user turns, each turn re-sending the whole history (so prefixes grow);
a turn is sent at its scheduled time or when the previous reply is in, whichever is later.
The same seed gives the same trace for every configuration. Replies use ignore_eos and a fixed
max_tokens, so every configuration generates the same number of tokens.

Reports TTFT, TPOT, ITL and end-to-end latency (p50/p90/p99), throughput, and the prefix-hit rate
per tier (from /v1/cache/stats before and after). With --configs it starts one server per
configuration (l1, l1+l2, l1+l2+disk) on the same trace and writes
benchmarks/results/bench_serving-<machine>.json (and a PNG of TTFT distributions with --plot).

    python benchmarks/bench_serving.py --configs l1,l1+l2,l1+l2+disk --l1 24MiB --l2 128MiB
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct

It measures from the client side only and never reads server internals beyond the public API.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_results

WORDS = ["cache", "tier", "block", "prefix", "token", "memory", "disk", "host", "device", "pool", "evict", "load", "store", "hash", "chain", "request", "server", "model", "batch", "decode", "prefill", "latency", "throughput", "queue", "stream", "policy", "write", "read", "flush", "page", "layer", "head", "attention", "value", "key", "context", "session", "user", "answer", "question"]


# ---------------------------------------------------------------------------- the trace


@dataclass(slots=True)
class Conversation:
    start: float  # seconds after the run starts
    system: str
    turns: list[str]
    gaps: list[float]  # think time before each turn after the first


def make_trace(a) -> list[Conversation]:
    rng = random.Random(a.seed)
    systems = [f"You are assistant #{i}. " + " ".join(rng.choice(WORDS) for _ in range(a.system_words))
               for i in range(a.system_prompts)]
    t, convs = 0.0, []
    for _ in range(a.conversations):
        t += rng.expovariate(a.rate)  # Poisson arrivals of conversations
        turns = [" ".join(rng.choice(WORDS) for _ in range(a.user_words)) + "?" for _ in range(a.turns)]
        gaps = [rng.expovariate(1.0 / a.think_time) for _ in range(a.turns - 1)]
        convs.append(Conversation(t, rng.choice(systems), turns, gaps))
    return convs


# ---------------------------------------------------------------------------- the client


@dataclass(slots=True)
class Result:
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def one_turn(c: httpx.AsyncClient, a, messages: list[dict]) -> tuple[Result, str]:
    body = {"model": a.model, "messages": messages, "max_tokens": a.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res, text, start, last = Result(), "", time.perf_counter(), None
    try:
        async with c.stream("POST", a.url + "/v1/chat/completions", json=body, headers=a.headers) as r:
            if r.status_code != 200:
                res.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
                return res, text
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = ev["error"]["message"]
                    continue
                now = time.perf_counter()
                if ev.get("usage"):
                    u = ev["usage"]
                    res.prompt_tokens, res.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for ch in ev.get("choices", []):
                    piece = (ch.get("delta") or {}).get("content") or ""
                    if piece:
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last, text = now, text + piece
    except httpx.HTTPError as err:
        res.error = type(err).__name__
    res.e2e = time.perf_counter() - start
    return res, text


async def run_trace(a, trace: list[Conversation]) -> tuple[list[Result], float]:
    results: list[Result] = []
    t0 = time.perf_counter()

    async def conversation(c, conv: Conversation):
        await asyncio.sleep(max(0.0, conv.start - (time.perf_counter() - t0)))
        messages = [{"role": "system", "content": conv.system}]
        for i, turn in enumerate(conv.turns):
            if i:
                await asyncio.sleep(conv.gaps[i - 1])
            messages.append({"role": "user", "content": turn})
            res, reply = await one_turn(c, a, messages)
            results.append(res)
            messages.append({"role": "assistant", "content": reply})

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=a.timeout, limits=limits) as c:
        await asyncio.gather(*(conversation(c, conv) for conv in trace))
    return results, time.perf_counter() - t0


def pct(values, scale=1000.0) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = np.asarray(values) * scale
    return {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99)), "mean": float(v.mean())}


def summarize(results: list[Result], duration: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r.error is None and r.completion_tokens]
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    q = after["query_tokens"] - before["query_tokens"]
    per_tier = {t: after["tiers"][t]["hit_tokens"] - before["tiers"][t]["hit_tokens"] for t in ("l1", "l2", "l3")}
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:3],
        "duration_s": duration,
        "throughput": {"requests_per_s": len(ok) / duration,
                       "output_tokens_per_s": sum(r.completion_tokens for r in ok) / duration,
                       "total_tokens_per_s": (prompt + sum(r.completion_tokens for r in ok)) / duration},
        "ttft_ms": pct([r.ttft for r in ok]), "tpot_ms": pct(tpot),
        "itl_ms": pct([x for r in ok for x in r.itl]), "e2e_ms": pct([r.e2e for r in ok]),
        "prompt_tokens": prompt, "cached_tokens_reported": sum(r.cached_tokens for r in ok),
        "prefix_hit_rate": {"all": sum(per_tier.values()) / q if q else 0.0,
                            **{t: (n / q if q else 0.0) for t, n in per_tier.items()}},
        "prefix_hit_tokens": per_tier, "prefix_query_tokens": q,
        "evictions": {t: after["tiers"][t]["evictions"] - before["tiers"][t]["evictions"] for t in ("l1", "l2", "l3")},
        "ttft_samples_ms": [r.ttft * 1000 for r in ok],
    }


async def stats(a) -> dict:
    async with httpx.AsyncClient(timeout=60) as c:
        return (await c.get(a.url + "/v1/cache/stats", headers=a.headers)).json()


def bench(a, trace) -> dict:
    before = asyncio.run(stats(a))
    results, duration = asyncio.run(run_trace(a, trace))
    return summarize(results, duration, before, asyncio.run(stats(a)))


# ---------------------------------------------------------------------------- servers


def start_server(a, config: str, l3_dir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "tierkv.server.cli", "--port", str(port), "--served-model-name", a.model,
            "--l1", a.l1, "--max-num-seqs", str(a.max_num_seqs), "--max-model-len", str(a.max_model_len),
            "--max-waiting", "100000", "--log-level", "warning"]
    if a.server_model:
        args += ["--model", a.server_model]
    if "l2" in config:
        args += ["--l2", a.l2]
    if "disk" in config:
        args += ["--l3", f"file://{l3_dir}?size={a.l3_size}"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 600
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {config} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise TimeoutError(f"server for {config} did not start")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in out["configs"].items():
        xs = np.sort(r["ttft_samples_ms"])
        ax.plot(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"bench_serving TTFT CDF ({out['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running server (default: start one per --configs entry)")
    p.add_argument("--configs", default="l1,l1+l2,l1+l2+disk", help="comma list of l1, l1+l2, l1+l2+disk")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name to request")
    p.add_argument("--server-model", help="--model passed to the servers this script starts (default: bundled)")
    p.add_argument("--api-key")
    p.add_argument("--l1", default="24MiB")
    p.add_argument("--l2", default="128MiB")
    p.add_argument("--l3-size", default="2GiB")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=3)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--user-words", type=int, default=25)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.5, help="conversations started per second (Poisson)")
    p.add_argument("--think-time", type=float, default=2.0, help="mean seconds between a reply and the next turn")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="free text stored with the results (e.g. 'CPU, small sizes')")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plot", action="store_true")
    a = p.parse_args(argv)
    a.headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    trace = make_trace(a)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {"device": device, "label": a.label, "trace": {k: v for k, v in vars(a).items() if k not in (
        "headers", "api_key", "out", "url")}, "trace_conversations": [asdict(c) for c in trace][:2], "configs": {}}
    if a.url:
        out["configs"]["external"] = bench(a, trace)
    else:
        for config in a.configs.split(","):
            l3_dir = Path(tempfile.mkdtemp(prefix="bench_serving_l3_"))
            proc, a.url = start_server(a, config, l3_dir)
            try:
                print(f"{config}: running {len(trace)} conversations x {a.turns} turns ...", flush=True)
                out["configs"][config] = bench(a, trace)
            finally:
                proc.terminate()
                proc.wait(120)
                shutil.rmtree(l3_dir, ignore_errors=True)
    for name, r in out["configs"].items():
        print(f"{name:12s} {r['throughput']['output_tokens_per_s']:7.1f} out tok/s  TTFT p50 {r['ttft_ms']['p50']:8.0f} "
              f"p99 {r['ttft_ms']['p99']:8.0f} ms  TPOT p50 {r['tpot_ms']['p50']:6.0f} ms  hit "
              f"{r['prefix_hit_rate']['all']:.0%} (l1 {r['prefix_hit_rate']['l1']:.0%} l2 {r['prefix_hit_rate']['l2']:.0%} "
              f"l3 {r['prefix_hit_rate']['l3']:.0%})  errors {r['errors']}")
    path = write_results("bench_serving", out, a.out)
    if a.plot:
        plot(out, path.with_suffix(".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
