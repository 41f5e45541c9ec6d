"""bench_serving: what L1, L2 and a disk L3 buy tierkv-serve on the field's serving workloads.

How: one `tierkv-serve` process per configuration, each replaying the same seeded trace over HTTP:
  off (prefix caching disabled) | l1 | l1+l2 | l1+l2+disk (file L3 with direct=1: O_DIRECT, so disk
  reads bypass the page cache; the page cache is also dropped before each workload where allowed).
Requests are token-id prompts (random ids in [100, vocab), seeded) on /v1/completions, streamed,
greedy, ignore_eos, fixed max_tokens, with logprobs=0: that makes every token its own SSE event
(a model without a tokenizer streams no text; the cost, a log-softmax per step, is the same in every
config), so TTFT is the first token's arrival and ITL the gaps. Each config first gets a warm-up
(kernels compile outside the timings); run lengths are bounded by request counts and by
--max-seconds per workload and --config-seconds per config.
Workloads (each sized by flags; H200 defaults, --smoke for a CPU):
  multi_round    LMCache's multi-round QA: users arrive as a Poisson process, at most
                 --mr-max-active-users at once (new users take finished ones' places); each sends
                 rounds of shared system prompt + own context + growing history + a question, the
                 next round a think time after the answer, which joins the history as returned.
  long_doc       LMCache's long-document QA: documents of ~20K tokens, each asked several short
                 questions, in seeded random order, under a concurrency limit.
  shared_prefix  SGLang's generated shared prefix: groups of questions behind a long system prompt,
                 in random order, under a rate and a concurrency limit.
  unique         random prompts that never share a block: caching on (l1) vs off when every lookup
                 misses (runs in the off and l1 configs only).
Each workload's KV (its distinct tokens x bytes per token from the model config) is made
--kv-over-l1 (4) times L1 (L1 is raised if the largest request needs it); L2 = --l2-over-l1 x L1.

Reported per workload x config: TTFT/ITL/TPOT percentiles, request and token throughput, errors,
hit tokens per tier (GET /v1/cache/stats before and after), usage.cached_tokens, and each hit's
physical floor = L2 bytes / pinned host->device bandwidth + disk bytes / raw disk read bandwidth +
uncached tokens x cold prefill time per token. Those three are measured in the same run (a 4 GiB
pinned copy; an O_DIRECT read of a 2 GiB file in the temp dir; an isolated cold 12K-token request).
The HTTP response does not say which tier served a request's hit, so trace floors split each
request's cached tokens by the workload's aggregate per-tier hit fractions; the isolated probes
(before each trace: cold, then the same prompt from L1, then from L2 after other prompts pushed it
out of L1) get their exact split by diffing /v1/cache/stats around one request.
Writes bench_serving-<machine>.json (after every config, so a timeout keeps what finished) and a
PNG of TTFT CDFs per workload.

    python benchmarks/bench_serving.py --make-model llama-3.1-8b          # the H200 run (~8 min)
    python benchmarks/bench_serving.py --smoke --make-model tiny --out /tmp/bs   # CPU, ~1 min
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --smoke   # one external server

It measures from the client side only and must never read server state beyond the public HTTP
API (/health, /v1/models, /v1/completions, /v1/cache/stats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import mmap
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the server launcher the tests use
from common import RESULTS, write_results  # noqa: E402
from server_helpers import ServerProcess  # noqa: E402

from tierkv.config import parse_size  # noqa: E402

CONFIGS = ("off", "l1", "l1+l2", "l1+l2+disk")
WORKLOADS = ("multi_round", "long_doc", "shared_prefix", "unique")
UNIQUE_CONFIGS = ("off", "l1", "external")  # all-miss trace: only caching on vs off is the question
FIRST_ID = 100  # random prompt ids start here, clear of the special tokens real vocabularies begin with
SERVED_NAME = "bench"
GiB = 2**30

# Defaults sized for Llama-3.1-8B on one H200 (128 KiB of KV a token): KV 85-102K tokens per workload,
# so L1 ~25K tokens (3.1 GiB, one 20K document); the off config (everything cold, ~1M prefill
# tokens) then takes about a minute, and four configs with their server starts ~6-8 minutes.
# Multi-round users arrive fast (16/s) so that the active-user limit, not the arrival process, sets
# the load: its throughput then measures the server.
H200 = dict(
    mr_users=32, mr_rounds=3, mr_system_tokens=1000, mr_context_tokens=2000, mr_question_tokens=150,
    mr_answer_tokens=64, mr_rate=16.0, mr_think_time=0.5, mr_max_active_users=12,
    ld_docs=5, ld_doc_tokens=20000, ld_questions=3, ld_question_tokens=100, ld_answer_tokens=32, ld_concurrency=2,
    sp_groups=16, sp_system_tokens=5000, sp_questions=4, sp_question_tokens=128, sp_answer_tokens=64,
    sp_rate=math.inf, sp_concurrency=16,
    uq_prompts=64, uq_prompt_tokens=1024, uq_answer_tokens=128, uq_concurrency=64,
    probe_tokens=12000, max_seconds=60.0, config_seconds=120.0, disk_probe_bytes=2 * GiB, h2d_bytes=4 * GiB,
)
# A tiny Llama on a CPU: every figure is meaningless, the point is that every path runs.
SMOKE = dict(
    mr_users=6, mr_rounds=2, mr_system_tokens=64, mr_context_tokens=96, mr_question_tokens=16,
    mr_answer_tokens=4, mr_rate=50.0, mr_think_time=0.01, mr_max_active_users=3,
    ld_docs=4, ld_doc_tokens=192, ld_questions=2, ld_question_tokens=16, ld_answer_tokens=4, ld_concurrency=2,
    sp_groups=4, sp_system_tokens=160, sp_questions=3, sp_question_tokens=16, sp_answer_tokens=4,
    sp_rate=math.inf, sp_concurrency=4,
    uq_prompts=8, uq_prompt_tokens=64, uq_answer_tokens=4, uq_concurrency=8,
    probe_tokens=192, max_seconds=60.0, config_seconds=120.0, disk_probe_bytes=32 * 2**20, h2d_bytes=64 * 2**20,
)


# ---------------------------------------------------------------------------- the model


@dataclass(slots=True)
class ModelInfo:
    source: str  # "made: llama-3.1-8b", "dir", "bundled", "external"
    path: Path | None  # the directory servers load (None: the bundled default)
    vocab_size: int
    max_position_embeddings: int
    shape: dict  # layers, kv heads, head dim
    kv_bytes_per_token: int  # 2 (K and V) x layers x kv_heads x head_dim x dtype bytes


def kv_dtype_bytes() -> int:
    """The KV pool takes the model's dtype; tierkv-serve's 'auto' is bf16 on a GPU, fp32 on a CPU."""
    import torch

    return 2 if torch.cuda.is_available() else 4


def describe(config: dict, source: str, path: Path | None) -> ModelInfo:
    layers, kv_heads = config["num_hidden_layers"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return ModelInfo(source, path, config["vocab_size"], config.get("max_position_embeddings", 0),
                     dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim),
                     2 * layers * kv_heads * head_dim * kv_dtype_bytes())


def make_model(name: str, tmp: Path) -> tuple[ModelInfo, float]:
    """A random-weight Llama saved as a HF safetensors directory under `tmp` (outside the repo): the
    8B shape built in bf16 on the GPU when there is one, or the tiny one; bench_latency's shapes."""
    import torch
    from bench_latency import llama_setup
    from bench_throughput import release_memory, save_random_model

    if name != "tiny" and not torch.cuda.is_available():
        raise SystemExit(f"--make-model {name} builds and serves 16 GB of bf16 weights: it needs a GPU; "
                         "use --make-model tiny on a CPU")
    config, device, dtype = llama_setup(smoke=(name == "tiny"))
    t = time.perf_counter()
    path = tmp / name
    model, _ = save_random_model(config, path, device, dtype)
    del model
    release_memory()
    return describe(config.to_dict(), f"made: {name}", path), time.perf_counter() - t


def model_info(a, tmp: Path) -> tuple[ModelInfo, float | None]:
    if a.make_model:
        return make_model(a.make_model, tmp)
    if a.server_model:
        path = Path(a.server_model)
        return describe(json.loads((path / "config.json").read_text()), "dir", path), None
    # the bundled SmolLM2: its converted directory in the user's cache (what tierkv-serve loads)
    from tierkv.engine.loader import bundled_model_dir

    config = json.loads((bundled_model_dir() / "config.json").read_text())
    return describe(config, "bundled" if not a.url else "external (shape of the bundled model)", None), None


# ---------------------------------------------------------------------------- physical limits


def h2d_bandwidth(nbytes: int) -> tuple[float, str]:
    """The L2 -> L1 bound: one pinned host -> GPU copy (bench_long_context's); on a CPU, a memcpy."""
    import torch

    if torch.cuda.is_available():
        from bench_long_context import h2d_bandwidth as pinned_h2d
        from bench_throughput import release_memory

        bw = pinned_h2d(nbytes)
        release_memory()  # the servers need that device memory more than this process does
        return bw, f"pinned host->device copy of {nbytes / GiB:.2f} GiB"
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * nbytes / (time.perf_counter() - t), f"host memcpy of {nbytes / 2**20:.0f} MiB (no CUDA)"


def disk_read_bandwidth(directory: Path, nbytes: int) -> tuple[float, str]:
    """The disk tier's bound: a sequential read of an nbytes file in `directory` (where the L3 lives),
    with O_DIRECT so the page cache can hide nothing; where O_DIRECT is refused, buffered after
    posix_fadvise(DONTNEED)."""
    chunk = 8 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))
    path = directory / "raw-read-probe.bin"
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        except OSError:
            direct, fd = 0, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for _ in range(nbytes // chunk):
            os.write(fd, buf)
        os.fsync(fd)
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | direct)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t, done = time.perf_counter(), 0
        while (n := os.readv(fd, [buf])) > 0:
            done += n
        seconds = time.perf_counter() - t
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return done / seconds, f"{'O_DIRECT' if direct else 'fadvise(DONTNEED), buffered'} read of {done / 2**20:.0f} MiB"


def drop_page_cache() -> bool:
    """echo 3 > /proc/sys/vm/drop_caches (root only); False where the process may not."""
    from bench_long_context import drop_page_cache as drop

    return drop()


# ---------------------------------------------------------------------------- the traces


@dataclass(slots=True)
class Planned:
    """One request of a fixed trace."""
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after the workload starts; sent then or when a slot frees


@dataclass(slots=True)
class User:
    """One multi-round user: its rounds' prompts depend on the answers it gets."""
    arrival: float
    context: list[int]  # the shared system prompt + this user's own context
    questions: list[list[int]]
    think: list[float]  # seconds between an answer and the next round
    stand_in: list[list[int]]  # answers to use where the server returns no token ids (it has a tokenizer)


@dataclass(slots=True)
class Workload:
    name: str
    shape: dict  # the sizes it was built from, for the JSON
    concurrency: int  # requests (or multi-round users) in flight at once
    kv_tokens: int  # distinct tokens the trace makes KV for: its footprint in a cache
    largest_request: int  # prompt + answer tokens of its longest request
    requests: list[Planned] = field(default_factory=list)
    users: list[User] = field(default_factory=list)

    @property
    def planned(self) -> int:
        return len(self.requests) + sum(len(u.questions) for u in self.users)


def rng_for(seed: int, name: str) -> np.random.Generator:
    """One generator per workload, so each workload's trace is the same whatever else is selected."""
    return np.random.default_rng([seed, WORKLOADS.index(name)])


def random_ids(g: np.random.Generator, n: int, vocab: int) -> list[int]:
    return g.integers(FIRST_ID, vocab, n).tolist()


def arrivals(g: np.random.Generator, n: int, rate: float) -> list[float]:
    """Poisson arrival times at `rate` per second (all at 0 for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * n
    return np.cumsum(g.exponential(1.0 / rate, n)).tolist()


def flags(a, prefix: str) -> dict:
    """The workload's sizing flags, for the JSON (which has no infinity: an unlimited rate is 'inf')."""
    return {k[len(prefix):]: ("inf" if v == math.inf else v) for k, v in vars(a).items() if k.startswith(prefix)}


def build_multi_round(a, vocab: int) -> Workload:
    """Users with Poisson arrivals, each a context behind the shared system prompt and R questions."""
    g, R, A = rng_for(a.seed, "multi_round"), a.mr_rounds, a.mr_answer_tokens
    system = random_ids(g, a.mr_system_tokens, vocab)
    users = [User(t, system + random_ids(g, a.mr_context_tokens, vocab),
                  [random_ids(g, a.mr_question_tokens, vocab) for _ in range(R)],
                  g.exponential(a.mr_think_time, R - 1).tolist() if a.mr_think_time > 0 else [0.0] * (R - 1),
                  [random_ids(g, A, vocab) for _ in range(R)])
             for t in arrivals(g, a.mr_users, a.mr_rate)]
    per_user = a.mr_context_tokens + R * (a.mr_question_tokens + A)
    # KV: the shared system prompt once, and each user's context and rounds (question + answer)
    return Workload("multi_round", flags(a, "mr_"), a.mr_max_active_users, a.mr_system_tokens + a.mr_users * per_user,
                    a.mr_system_tokens + per_user, users=users)


def build_long_doc(a, vocab: int) -> Workload:
    """Every document asked --ld-questions times, all the asks shuffled together."""
    g, A = rng_for(a.seed, "long_doc"), a.ld_answer_tokens
    docs = [random_ids(g, a.ld_doc_tokens, vocab) for _ in range(a.ld_docs)]
    order = [d for d in range(a.ld_docs) for _ in range(a.ld_questions)]
    g.shuffle(order)
    requests = [Planned(docs[d] + random_ids(g, a.ld_question_tokens, vocab), A) for d in order]
    return Workload("long_doc", flags(a, "ld_"), a.ld_concurrency,
                    a.ld_docs * a.ld_doc_tokens + len(order) * (a.ld_question_tokens + A),
                    a.ld_doc_tokens + a.ld_question_tokens + A, requests=requests)


def build_shared_prefix(a, vocab: int) -> Workload:
    """Groups of questions behind one system prompt each, shuffled, arriving at --sp-rate."""
    g, A = rng_for(a.seed, "shared_prefix"), a.sp_answer_tokens
    systems = [random_ids(g, a.sp_system_tokens, vocab) for _ in range(a.sp_groups)]
    order = [s for s in range(a.sp_groups) for _ in range(a.sp_questions)]
    g.shuffle(order)
    times = arrivals(g, len(order), a.sp_rate)
    requests = [Planned(systems[s] + random_ids(g, a.sp_question_tokens, vocab), A, t) for s, t in zip(order, times)]
    return Workload("shared_prefix", flags(a, "sp_"), a.sp_concurrency,
                    a.sp_groups * a.sp_system_tokens + len(order) * (a.sp_question_tokens + A),
                    a.sp_system_tokens + a.sp_question_tokens + A, requests=requests)


def build_unique(a, vocab: int) -> Workload:
    """Random prompts: two share a 16-token block with probability ~vocab^-16, i.e. never."""
    g, A = rng_for(a.seed, "unique"), a.uq_answer_tokens
    requests = [Planned(random_ids(g, a.uq_prompt_tokens, vocab), A) for _ in range(a.uq_prompts)]
    return Workload("unique", flags(a, "uq_"), a.uq_concurrency, a.uq_prompts * (a.uq_prompt_tokens + A),
                    a.uq_prompt_tokens + A, requests=requests)


BUILDERS = {"multi_round": build_multi_round, "long_doc": build_long_doc,
            "shared_prefix": build_shared_prefix, "unique": build_unique}


# ---------------------------------------------------------------------------- sizes


def tier_sizes(a, workloads: list[Workload], kvb: int) -> dict:
    """L1 = the median KV of the workloads that can hit / --kv-over-l1, but never below 1.25x the
    largest request (which must fit L1 to run unstreamed); L2 = --l2-over-l1 x L1; the disk holds
    twice the largest workload. --l1, --l2, --l3-size override."""
    block = 16 * kvb
    reusable = [w.kv_tokens for w in workloads if w.name != "unique"] or [w.kv_tokens for w in workloads]
    wanted = statistics.median(reusable) * kvb / a.kv_over_l1
    least = 1.25 * max(w.largest_request for w in workloads) * kvb
    l1 = parse_size(a.l1) if a.l1 else math.ceil(max(wanted, least) / block) * block
    l2 = parse_size(a.l2) if a.l2 else math.ceil(a.l2_over_l1 * l1 / block) * block
    l3 = parse_size(a.l3_size) if a.l3_size else int(2 * max(w.kv_tokens for w in workloads) * kvb)
    return dict(l1_bytes=l1, l2_bytes=l2, l3_bytes=l3, l1_raised_for_largest_request=least > wanted and not a.l1,
                kv_over_l1_target=a.kv_over_l1, kv_over_l1={w.name: w.kv_tokens * kvb / l1 for w in workloads})


def external_sizes(a, workloads: list[Workload], kvb: int) -> dict:
    """An external server's tiers are what they are: read them, to report the KV / L1 ratios."""
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    r = httpx.get(a.url + "/v1/cache/stats", headers=headers, timeout=60)
    tiers = r.json()["tiers"] if r.status_code == 200 else {}
    l1, l2 = (tiers.get(t, {}).get("capacity_bytes", 0) for t in ("l1", "l2"))
    return dict(l1_bytes=l1, l2_bytes=l2, l3_bytes=None, l1_raised_for_largest_request=False,
                kv_over_l1_target=None, kv_over_l1={w.name: w.kv_tokens * kvb / l1 if l1 else None for w in workloads})


# ---------------------------------------------------------------------------- the client


@dataclass(slots=True)
class Result:
    prompt_tokens: int
    max_tokens: int
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


async def send(h: Http, prompt: list[int], max_tokens: int) -> Result:
    """One streamed completion. logprobs=0 puts each sampled token in its own event, as its id
    when the server has no tokenizer (then the answer can join a multi-round history exactly)."""
    body = {"model": h.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    res, pieces, start, last, usage = Result(len(prompt), max_tokens), [], time.perf_counter(), None, False
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
                if ev.get("usage"):
                    usage = True
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
    except httpx.HTTPError as err:
        res.error = f"{type(err).__name__}: {err}"[:200]
    res.e2e = time.perf_counter() - start
    if not usage:  # a server that ignores include_usage: count what arrived
        res.completion_tokens = len(pieces)
    if all(p.isdigit() and int(p) < h.vocab for p in pieces) and pieces:
        res.output_ids = [int(p) for p in pieces]
    if res.error is None and (res.ttft is None or res.completion_tokens != max_tokens):
        res.error = f"{res.completion_tokens} of {max_tokens} tokens"
    return res


async def cache_stats(h: Http) -> dict | None:
    """The server's /v1/cache/stats (None where the server has no such route)."""
    try:
        r = await h.client.get(h.url + "/v1/cache/stats", headers=h.headers)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def hits_between(before: dict | None, after: dict | None) -> dict | None:
    """Hit tokens per tier between two stats snapshots. The cache counts every lookup, and a request
    waiting for room is looked up again each step, so these are good as fractions, not per request."""
    if before is None or after is None:
        return None
    return {t: after["tiers"][t]["hit_tokens"] - before["tiers"][t]["hit_tokens"] for t in ("l1", "l2", "l3")}


# ---------------------------------------------------------------------------- the drivers


async def run_requests(h: Http, w: Workload, deadline: float) -> list[Result]:
    """A fixed trace: each request at its arrival time or when one of `concurrency` slots frees
    (in trace order); none starts after `deadline`."""
    slots, t0, out = asyncio.Semaphore(w.concurrency), time.perf_counter(), []

    async def one(p: Planned) -> None:
        await asyncio.sleep(max(0.0, p.arrival - (time.perf_counter() - t0)))
        async with slots:
            if time.perf_counter() < deadline:
                out.append(await send(h, p.prompt, p.max_tokens))

    await asyncio.gather(*(one(p) for p in w.requests))
    return out


async def run_multi_round(h: Http, w: Workload, deadline: float, answers: dict) -> list[Result]:
    """Users arrive at their times and wait for one of the active-user slots; each round's prompt
    is the history so far + the question, and the answer as returned joins the history."""
    slots, t0, out = asyncio.Semaphore(w.concurrency), time.perf_counter(), []

    async def user(u: User) -> None:
        await asyncio.sleep(max(0.0, u.arrival - (time.perf_counter() - t0)))
        async with slots:
            history = u.context
            for r, question in enumerate(u.questions):
                if r:
                    await asyncio.sleep(u.think[r - 1])
                if time.perf_counter() >= deadline:
                    return
                prompt = history + question
                res = await send(h, prompt, len(u.stand_in[r]))
                out.append(res)
                returned = res.output_ids is not None and len(res.output_ids) == len(u.stand_in[r])
                answers["returned" if returned else "stand_in"] += 1
                history = prompt + (res.output_ids if returned else u.stand_in[r])

    await asyncio.gather(*(user(u) for u in w.users))
    return out


# ---------------------------------------------------------------------------- probes


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


# ---------------------------------------------------------------------------- one configuration


async def bench_config(h: Http, a, config: str, workloads: list[Workload], kvb: int, max_len: int) -> tuple[dict, dict]:
    """Warm-up, probes, then every workload's trace; returns the figures and the raw results."""
    g = np.random.default_rng([a.seed, 1000])  # probes and warm-up: the same prompts in every config
    await warm_up(h, min(a.warm_tokens, max_len // 2), g)
    out = dict(probes=await probes(h, a, config, g, kvb, max_len), workloads={}, page_cache_dropped={})
    raw, config_deadline = {}, time.perf_counter() + a.config_seconds
    for w in workloads:
        if w.name == "unique" and config not in UNIQUE_CONFIGS:
            continue
        if "disk" in config:  # O_DIRECT already bypasses it; this also clears what others cached
            out["page_cache_dropped"][w.name] = ("skipped (--no-drop-caches or --smoke)" if a.no_drop_caches
                                                 else "dropped" if drop_page_cache() else "not permitted")
        answers = {"returned": 0, "stand_in": 0}
        before, t = await cache_stats(h), time.perf_counter()
        deadline = min(t + a.max_seconds, config_deadline)  # run lengths bounded by time as well as by counts
        if w.users:
            results = await run_multi_round(h, w, deadline, answers)
        else:
            results = await run_requests(h, w, deadline)
        duration = time.perf_counter() - t
        s = summarize(w, results, duration, hits_between(before, await cache_stats(h)))
        if w.users:
            s["answers"] = answers  # joined the history as returned, or the seeded stand-in
        out["workloads"][w.name], raw[w.name] = s, results
        print(f"  {w.name:14s} {s['requests']:4d}/{w.planned} requests in {duration:6.1f} s, "
              f"{s['errors']} errors, TTFT p50 {fmt(s['ttft_ms']['p50'])} ms", flush=True)
    final = await cache_stats(h)
    out["l3_stores"] = final.get("l3_stores") if final else None  # direct I/O in effect, evictions, errors
    return out, raw


def pct(values, scale: float = 1e3) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = np.asarray(values, dtype=float) * scale
    return {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99)), "mean": float(v.mean())}


def summarize(w: Workload, results: list[Result], duration: float, hits: dict | None) -> dict:
    ok = [r for r in results if r.error is None]
    out_tokens, prompt = sum(r.completion_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    return {
        "planned": w.planned, "requests": len(results), "time_capped": len(results) < w.planned,
        "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:3], "duration_s": duration,
        "throughput": {"requests_per_s": len(ok) / duration, "output_tokens_per_s": out_tokens / duration,
                       "total_tokens_per_s": (prompt + out_tokens) / duration},
        "ttft_ms": pct([r.ttft for r in ok]), "itl_ms": pct([x for r in ok for x in r.itl]),
        "tpot_ms": pct(tpot), "e2e_ms": pct([r.e2e for r in ok]),
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_fraction": cached / prompt if prompt else 0.0,
        "hit_tokens": hits,
        "ttft_samples_ms": [round(r.ttft * 1e3, 2) for r in ok],
    }


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


# ---------------------------------------------------------------------------- servers


def server_args(a, config: str, model: ModelInfo, sizes: dict, max_len: int, l3_dir: Path) -> list[str]:
    args = ["--served-model-name", SERVED_NAME, "--l1", str(sizes["l1_bytes"]), "--max-model-len", str(max_len),
            "--max-num-seqs", str(a.max_num_seqs), "--max-waiting", "100000", "--log-level", "warning",
            # stop fast: nothing in flight is worth waiting for, nor queued disk writes worth keeping
            "--grace-period", "5", "--flush-timeout", "1"]
    if model.path is not None:
        args += ["--model", str(model.path)]
    if config == "off":
        args.append("--no-enable-prefix-caching")
    if "l2" in config:
        args += ["--l2", str(sizes["l2_bytes"])]
    if "disk" in config:
        args += ["--l3", f"file://{l3_dir}?size={sizes['l3_bytes']}&direct=1"]
    if a.enforce_eager:
        args.append("--enforce-eager")
    return args + a.server_args.split()


async def run_one(a, config: str, url: str, workloads, kvb: int, max_len: int, vocab: int) -> tuple[dict, dict]:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits_http = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=a.timeout, limits=limits_http) as client:
        name = a.served_model_name if a.url else None  # servers started here serve whatever /v1/models says
        if name is None:
            models = (await client.get(url + "/v1/models", headers=headers)).json()["data"]
            name, max_len = models[0]["id"], models[0].get("max_model_len", max_len)
        return await bench_config(Http(client, url, headers, name, vocab), a, config, workloads, kvb, max_len)


def run_server_config(a, config: str, model: ModelInfo, sizes: dict, max_len: int, workloads, tmp: Path):
    l3_dir = tmp / f"l3-{config.replace('+', '_')}"
    srv = ServerProcess(server_args(a, config, model, sizes, max_len, l3_dir), tmp / f"server-{config}.log")
    try:
        t = time.perf_counter()
        srv.wait_ready(a.timeout)
        start_s = time.perf_counter() - t
        print(f"{config}: server up in {start_s:.1f} s", flush=True)
        figures, raw = asyncio.run(run_one(a, config, srv.url, workloads, model.kv_bytes_per_token, max_len,
                                           model.vocab_size))
        figures["server"] = dict(start_s=start_s, args=srv.proc.args[3:])
        return figures, raw
    finally:
        code = srv.stop()
        if code != 0:
            print(f"{config}: server exited with {code}; log tail:\n{srv.log_path.read_text()[-1500:]}", flush=True)
        shutil.rmtree(l3_dir, ignore_errors=True)


# ---------------------------------------------------------------------------- analysis and output


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


def ratio(x, y):
    return x / y if x is not None and y not in (None, 0) else None


def compare(s_new: dict, s_base: dict) -> dict:
    return {"throughput": ratio(s_new["throughput"]["requests_per_s"], s_base["throughput"]["requests_per_s"]),
            "p50_ttft_ratio": ratio(s_new["ttft_ms"]["p50"], s_base["ttft_ms"]["p50"]),
            "p99_ttft_ratio": ratio(s_new["ttft_ms"]["p99"], s_base["ttft_ms"]["p99"])}


HEADLINE = {"multi_round": ("l1+l2", "l1"), "long_doc": ("l1+l2+disk", "l1"), "shared_prefix": ("l1+l2", "l1")}


def ratios(out: dict, probe: str) -> dict:
    """The issue's key numbers, and every config against l1 and against off."""
    configs, r = out["configs"], {"all_pairs": {}}
    names = {w for c in configs.values() for w in c["workloads"]}
    for w in sorted(names):
        have = {c: configs[c]["workloads"][w] for c in configs if w in configs[c]["workloads"]}
        r["all_pairs"][w] = {f"{c}_vs_{b}": compare(have[c], have[b]) for b in ("l1", "off") if b in have
                             for c in have if c != b}
        new, base = HEADLINE.get(w, ("", ""))
        if new in have and base in have:
            cmp = compare(have[new], have[base])
            r[w] = {f"{new}_vs_{base}_throughput": cmp["throughput"], "p50_ttft_ratio": cmp["p50_ttft_ratio"],
                    "p99_ttft_ratio": cmp["p99_ttft_ratio"]}
    if "unique" in names and {"l1", "off"} <= set(configs) and "unique" in configs["off"]["workloads"]:
        on_vs_off = compare(configs["l1"]["workloads"]["unique"], configs["off"]["workloads"]["unique"])["throughput"]
        r["unique"] = {"on_vs_off": on_vs_off, "on_slower_by": 1 - on_vs_off if on_vs_off else None}
    for name in (probe, "100k"):
        for c in ("l1+l2", "l1+l2+disk", "external"):
            p = (configs.get(c) or {}).get("probes", {}).get(name) or {}
            hit, l1_hit = p.get("l2_hit") or {}, p.get("l1_hit") or {}
            if not hit.get("ttft_over_floor"):
                continue
            suffix = "" if name == probe else "_100k"
            r[f"l2_hit_ttft_over_floor{suffix}"] = hit["ttft_over_floor"]
            # what the L2 hit costs beyond an L1 hit of the same prompt, against the PCIe time of its bytes
            pcie_ms = hit["loaded_bytes"]["l2"] / out["limits"]["h2d_bytes_per_s"] * 1e3
            extra = hit["ttft_ms"] - l1_hit["ttft_ms"] if l1_hit.get("ttft_ms") else None
            r[f"l2_hit_probe{suffix}"] = dict(config=c, tokens=hit["tokens"], ttft_ms=hit["ttft_ms"],
                                              floor_ms=hit["floor_ms"], l1_hit_ttft_ms=l1_hit.get("ttft_ms"),
                                              over_l1_hit_vs_pcie_time=ratio(extra, pcie_ms))
            break
    return r


TARGETS = {"l2_hit_ttft_over_floor": "<= 1.5 (12K tokens)",
           "multi_round": "l1+l2 >= 3x l1 throughput at p99 TTFT ratio <= 1, p50 TTFT ratio <= 0.25",
           "unique": "on_vs_off >= 0.98 (caching costs <= 2% when every lookup misses)"}


def human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def fmt(v, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(out: dict) -> None:
    print(f"\n{'workload':14s} {'config':11s} {'req/s':>7s} {'out tok/s':>9s} {'TTFT p50/p90/p99 ms':>22s} "
          f"{'ITL p50/p99':>12s} {'TPOT':>6s} {'cached':>6s} {'hit l1/l2/l3':>13s} {'x floor':>7s} {'err':>4s}")
    for c, figures in out["configs"].items():
        for w, s in figures["workloads"].items():
            t, i, hits = s["ttft_ms"], s["itl_ms"], s["hit_tokens"]
            total = sum(hits.values()) if hits else 0
            split = "/".join(f"{hits[k] / total:.0%}" for k in ("l1", "l2", "l3")) if total else "-"
            print(f"{w:14s} {c:11s} {s['throughput']['requests_per_s']:7.2f} "
                  f"{s['throughput']['output_tokens_per_s']:9.0f} "
                  f"{fmt(t['p50']):>6s}/{fmt(t['p90']):>6s}/{fmt(t['p99']):>7s} "
                  f"{fmt(i['p50'], '.1f'):>5s}/{fmt(i['p99'], '.1f'):>6s} {fmt(s['tpot_ms']['p50'], '.1f'):>6s} "
                  f"{s['cached_fraction']:6.0%} {split:>13s} "
                  f"{fmt((s.get('floor') or {}).get('ttft_over_floor', {}).get('p50'), '.1f'):>7s} {s['errors']:4d}")
    for c, figures in out["configs"].items():
        for name, p in figures["probes"].items():
            if "skipped" in p:
                print(f"probe {name} in {c}: skipped ({p['skipped']})")
                continue
            line = f"probe {name:>4s} {c:11s} cold {fmt(p['cold']['ttft_ms'])} ms"
            for kind in ("l1_hit", "l2_hit"):
                if kind in p:
                    q = p[kind]
                    line += (f" | {kind} {fmt(q['ttft_ms'], '.1f')} ms (floor {fmt(q.get('floor_ms'), '.1f')} ms, "
                             f"{fmt(q.get('ttft_over_floor'), '.2f')}x; hit {q['hit_tokens']})")
            print(line)
    for k, v in out["ratios"].items():
        if k != "all_pairs":
            print(f"ratio {k}: {json.dumps(rounded(v))}")
    for config, err in out["failed_configs"].items():
        print(f"config {config} failed: {err}")


def rounded(v):
    if isinstance(v, float):
        return round(v, 3)
    return {k: rounded(x) for k, x in v.items()} if isinstance(v, dict) else v


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w for w in WORKLOADS if any(w in c["workloads"] for c in out["configs"].values())]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    for ax, w in zip(axes[0], names):
        for c, figures in out["configs"].items():
            xs = np.sort(figures["workloads"].get(w, {}).get("ttft_samples_ms", []))
            if len(xs):
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=c)
        ax.set_xscale("log")
        ax.set_title(f"{w} (KV {out['sizes']['kv_over_l1'].get(w, 0):.1f}x L1)")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=8)
    fig.suptitle(f"bench_serving: TTFT CDF per config ({out['model']['source']}, {out['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(out: dict, raw: dict, kvb: int, a) -> Path:
    add_floors(out, raw, kvb, probe_name(a.probe_tokens))
    out["ratios"] = ratios(out, probe_name(a.probe_tokens))
    path = write_results("bench_serving", out, a.out)
    if not a.no_plot:
        plot(out, path.with_suffix(".png"))
    return path


def probe_name(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 else str(n)


# ---------------------------------------------------------------------------- main


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--url", help="an already running OpenAI-compatible server: one config, 'external'")
    add("--api-key")
    add("--served-model-name", help="'model' in requests to --url (default: the first of its /v1/models)")
    add("--make-model", choices=("llama-3.1-8b", "tiny"), help="build a random-weight Llama and serve it")
    add("--server-model", help="a ready HF model directory for the servers (default: the bundled SmolLM2)")
    add("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    # unique first: its on-vs-off figure is the one a time cap must never cut
    add("--workload", default="unique,multi_round,long_doc,shared_prefix", help="comma list of " + ", ".join(WORKLOADS))
    add("--smoke", action="store_true", help="tiny sizes for a CPU (checks that everything runs)")
    add("--kv-over-l1", type=float, default=4.0, help="L1 = median workload KV / this (default 4)")
    add("--l1", help="L1 bytes (e.g. 4GiB), overriding --kv-over-l1")
    add("--l2-over-l1", type=float, default=2.0, help="L2 = this x L1 (default 2: L1+L2 holds ~3/4 of the KV)")
    add("--l2", help="L2 bytes, overriding --l2-over-l1")
    add("--l3-size", help="disk L3 budget (default 2x the largest workload's KV)")
    add("--max-num-seqs", type=int, default=64, help="server flag; fewer CUDA graphs to capture at start")
    add("--enforce-eager", action="store_true", help="server flag: no CUDA graphs (faster start)")
    add("--server-args", default="", help="more tierkv-serve flags, space separated")
    add("--max-seconds", type=float, help="per workload and config: no request starts after this (H200 60)")
    add("--config-seconds", type=float, help="per config, all workloads together (H200 120)")
    add("--probe-tokens", type=int, help="isolated probe prompt length (H200 12000)")
    add("--probe-100k", action="store_true", help="also probe a 100K-token prompt (needs L2 to hold it)")
    add("--warm-tokens", type=int, help="warm-up prompt length (default 9000; smoke 128)")
    add("--disk-probe-bytes", type=int, help="raw disk read probe file size (H200 2 GiB)")
    add("--h2d-bytes", type=int, help="pinned host->device copy size (H200 4 GiB)")
    add("--no-drop-caches", action="store_true", help="never write /proc/sys/vm/drop_caches (implied by --smoke)")
    add("--tmp", type=Path, help="directory for the model, the disk L3 and the probe file (default: system temp)")
    for prefix, keys in (("mr", "users rounds system_tokens context_tokens question_tokens answer_tokens rate "
                                "think_time max_active_users"),
                         ("ld", "docs doc_tokens questions question_tokens answer_tokens concurrency"),
                         ("sp", "groups system_tokens questions question_tokens answer_tokens rate concurrency"),
                         ("uq", "prompts prompt_tokens answer_tokens concurrency")):
        for k in keys.split():
            dest = f"{prefix}_{k}"
            add(f"--{dest.replace('_', '-')}", type=float if isinstance(H200[dest], float) else int,
                help=f"H200 {H200[dest]}, smoke {SMOKE[dest]}")
    add("--seed", type=int, default=0)
    add("--timeout", type=float, default=900.0, help="seconds for one request, and for a server to start")
    add("--label", default="", help="free text stored with the results")
    add("--out", type=Path, default=RESULTS)
    add("--no-plot", action="store_true")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if "--api-key" in a.argv[:-1]:  # the JSON gets the command line, never the key
        a.argv[a.argv.index("--api-key") + 1] = "***"
    preset = SMOKE if a.smoke else H200
    for k, v in preset.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.warm_tokens is None:
        a.warm_tokens = 128 if a.smoke else 9000
    a.no_drop_caches = a.no_drop_caches or a.smoke
    if a.make_model and a.server_model:
        p.error("give --make-model or --server-model, not both")
    bad = [c for c in a.configs.split(",") if c not in CONFIGS]
    bad += [w for w in a.workload.split(",") if w not in WORKLOADS]
    if bad:
        p.error(f"unknown config or workload: {bad}")
    return a


def main(argv=None) -> Path:
    a = parse(argv)
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-", dir=a.tmp))
    try:
        return run(a, tmp, "cuda" if torch.cuda.is_available() else "cpu")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(a, tmp: Path, device: str) -> Path:
    model, build_s = model_info(a, tmp)
    kvb = model.kv_bytes_per_token
    workloads = [BUILDERS[w](a, model.vocab_size) for w in a.workload.split(",")]
    sizes = external_sizes(a, workloads, kvb) if a.url else tier_sizes(a, workloads, kvb)
    need = max(w.largest_request for w in workloads)
    max_len = 256 * math.ceil((max(need, a.probe_tokens + 1, 100_064 if a.probe_100k else 0) + 64) / 256)
    if model.max_position_embeddings and max_len > model.max_position_embeddings:
        print(f"warning: requests need {max_len} positions, beyond the model's {model.max_position_embeddings}")
    if not a.url and not a.l3_size:  # the disk is shared with the model files: leave it room
        sizes["l3_bytes"] = min(sizes["l3_bytes"], int(0.6 * shutil.disk_usage(tmp).free))
    print(f"model {model.source}: {model.shape}, {kvb} KV bytes a token; L1 {human(sizes['l1_bytes'])}, "
          f"L2 {human(sizes['l2_bytes'])}, disk {human(sizes['l3_bytes'])}; KV/L1 "
          + ", ".join(f"{w} {fmt(r, '.1f')}x" for w, r in sizes["kv_over_l1"].items()), flush=True)
    for w, r in sizes["kv_over_l1"].items():
        if w != "unique" and r is not None and not 3 <= r <= 5:
            print(f"warning: {w}'s KV is {r:.1f}x L1 (3-5x intended); resize it or set --l1")
    h2d, h2d_kind = h2d_bandwidth(a.h2d_bytes)
    disk, disk_kind = disk_read_bandwidth(tmp, a.disk_probe_bytes)
    print(f"limits: host->device {h2d / 1e9:.1f} GB/s ({h2d_kind}); disk read {disk / 1e9:.2f} GB/s ({disk_kind})",
          flush=True)
    out = dict(
        device=device, label=a.label, argv=a.argv,
        model=dict(source=model.source, **model.shape, vocab_size=model.vocab_size, kv_bytes_per_token=kvb,
                   build_and_save_s=build_s),
        limits=dict(h2d_bytes_per_s=h2d, h2d_kind=h2d_kind, disk_read_bytes_per_s=disk, disk_read_kind=disk_kind),
        sizes=sizes, max_model_len=max_len,
        workloads={w.name: dict(w.shape, kv_tokens=w.kv_tokens, kv_bytes=w.kv_tokens * kvb, planned=w.planned,
                                largest_request=w.largest_request) for w in workloads},
        method=dict(requests="/v1/completions, token-id prompts, stream, ignore_eos, temperature 0, logprobs 0",
                    ttft="first streamed token", hits="/v1/cache/stats hit_tokens diffed around each workload",
                    floor="l2 bytes / h2d + disk bytes / disk read + uncached tokens x cold prefill s/token"),
        targets=TARGETS, configs={}, failed_configs={},
    )
    raw: dict = {}
    configs = ["external"] if a.url else a.configs.split(",")
    for config in configs:
        print(f"{config}: {', '.join(f'{w.name} {w.planned}' for w in workloads)} requests", flush=True)
        if a.url:
            figures, raw[config] = asyncio.run(run_one(a, config, a.url, workloads, kvb, max_len, model.vocab_size))
        else:
            try:
                figures, raw[config] = run_server_config(a, config, model, sizes, max_len, workloads, tmp)
            except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as err:  # the next config may still run
                out["failed_configs"][config] = f"{type(err).__name__}: {err}"[-3000:]
                print(f"{config} failed: {out['failed_configs'][config]}", flush=True)
                continue
        out["configs"][config] = figures
        save(out, raw, kvb, a)  # after every config: a run cut short keeps what finished
    path = save(out, raw, kvb, a)
    print_table(out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    # `timeout` sends SIGTERM: leave through the finally blocks, so the servers are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
