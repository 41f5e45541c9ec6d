"""Routers over replicas of tierkv-serve that share one Redis L3: the prefix-hit fraction and
request rate of a multi-round chat workload through vllm-router's kv_aware (fed by tierkv's
KV-cache events), cache_aware and round_robin, beside one replica that holds every conversation
(the most any router can get). Writes benchmarks/results/routers-<machine>.json.

    python benchmarks/bench_routers.py            # CPU: 3 replicas of the bundled model, about a minute

Hit fraction = cached prompt tokens / prompt tokens, summed over the responses' usage
(`prompt_tokens_details.cached_tokens`): what the user saves, blocks read from the shared L3
included. Of it, the L3 fraction is what the replicas read out of the L3 (their
tierkv_tier_blocks_out_total{tier="l3"}), and the local fraction the rest: the prefix the replica
that served the request held itself, in L1 or L2. The local fraction is what a router decides;
the shared L3 gives a badly routed request most of its prefix back, at the price of the read.
Each policy starts from empty caches (every replica's /flush_cache, the L3's FLUSHALL) and a new
router. tests/test_routers.py runs the same fleet and asserts on it. Nothing here reads a
server's state but through HTTP and Redis.

The fleet on one GPU (--gpu; issue 40 item 5): --replicas (4) tierkv-serve processes of a
random-weight Qwen3-0.6B-shaped model (made here, saved outside the tree; no tokenizer, so the
workload is in token ids) share the GPU, each with its own L1 and pinned L2 (GPU_REPLICA_ARGS;
the replicas' kernels are time-sliced on the GPU, not run side by side: no MPS), one Redis L3
and their KV-cache events, behind vllm-router: kv_aware against round_robin on TokenWorkload, a
closed-loop multi-round chat (32 users at once, each sending its next round when its answer has
arrived; 8K tokens each by the last round), sized so that the conversations' KV (~27 GiB)
overflows one replica (L1 8 GiB, L2 10 GiB, which holds a copy of L1's blocks) and fits the
fleet's four. Per policy: requests/s,
output tok/s, p50/p90 TTFT (all rounds, and the hit rounds, 1 on, alone: round 0 is cold under
any router) and the hit fractions as above; the kv_aware / round_robin ratios (the anchor: llm-d's
event-fed routing published 2x the throughput of random routing, p90 TTFT 0.54 s against 92.6 s;
a TTFT of 92.6 s is queueing, which this closed loop, one request per user at a time, bounds). Writes
routers_fleet-<machine>.json and a PNG beside it.

    # here, once: redis-server, the router's and the server's wheels into .fleet/ (~32 MB)
    bash scripts/device_fleet.sh
    # device (run tool, carry [".fleet"], one call, ~6-8 min):
    TIERKV_COMMIT=<sha> bash scripts/gpu_check.sh fleet
    # the same code path on a CPU: a tiny random Qwen3, 2 replicas, a few requests (~1 min;
    # its JSON goes to a temporary folder unless --out names one)
    python benchmarks/bench_routers.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the server and Redis launchers the tests use
from common import write_results  # noqa: E402
from serving.client import Http, send  # noqa: E402
from serving.figures import pct  # noqa: E402
from serving.workloads import random_ids  # noqa: E402
from server_helpers import ServerProcess, free_port, metric  # noqa: E402
from services import RedisServer  # noqa: E402

BLOCK_SIZE = 16  # tierkv-serve's default, and what the router hashes prompts by
# L1 holds every conversation of the workload below on one replica (the ideal needs no eviction);
# an L2 is what L3 blocks are staged through
REPLICA_ARGS = ("--l1", "160MiB", "--l2", "64MiB", "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE))
POLICIES = ("kv_aware", "cache_aware", "round_robin")
# --gpu: each replica's share of the H200 (weights ~1.2 GB; L1 8 GiB = 75K tokens of the model's
# 112 KiB a token, room to run 9 of TokenWorkload's 8K conversations at once) and of host memory
# (pinned L2 10 GiB: write-through copies every full L1 block there, so a replica holds about what
# its L2 holds); the Redis L3 (the whole workload, ~27 GiB) takes the rest of the 128 GiB
GPU_REPLICA_ARGS = ("--l1", "8GiB", "--l2", "10GiB", "--max-model-len", "8192", "--block-size", str(BLOCK_SIZE))
GPU_POLICIES = ("kv_aware", "round_robin")
# --smoke: the --gpu code path on a CPU, with bench_throughput's tiny Qwen3 (512 B a token)
TINY_VOCAB = 512  # bench_throughput.TINY_QWEN3's
SMOKE_REPLICA_ARGS = ("--l1", "4MiB", "--l2", "4MiB", "--max-model-len", "512", "--block-size", str(BLOCK_SIZE),
                      "--device", "cpu")
# vllm-router's debug line for each kv_aware choice: the prefix tokens it credited the chosen replica with
CREDITED = re.compile(r"KV prefix decision .*?credited_prefix_tokens=(\d+)")
READY_TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------------------ fleet

@dataclass(frozen=True)
class Ports:
    """Where a replica serves HTTP, publishes its KV-cache events and answers replays."""

    http: int
    events: int
    replay: int

    @classmethod
    def free(cls) -> Ports:
        return cls(free_port(), free_port(), free_port())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    @property
    def sources(self) -> tuple[str, str]:
        """The event and replay sockets, as a router connects to them."""
        return f"tcp://127.0.0.1:{self.events}", f"tcp://127.0.0.1:{self.replay}"


class Replica(ServerProcess):
    """tierkv-serve (`args`: REPLICA_ARGS, the bundled model) writing every block through to the
    shared L3 and publishing its KV-cache events, with a replay socket, on ports of its own
    (`ports`: given ones)."""

    def __init__(self, log_path: Path, l3: str, ports: Ports | None = None, extra: tuple[str, ...] = (),
                 args: tuple[str, ...] = REPLICA_ARGS) -> None:
        ports = ports or Ports.free()
        # '*' binds the server's host; a named host would make the publisher connect there (vLLM's rule)
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{ports.events}",
                  "replay_endpoint": f"tcp://*:{ports.replay}"}
        self.sources = ports.sources  # (events, replay) as a router connects to them
        super().__init__(["--l3", l3, "--write-policy", "write_through", "--kv-events-config", json.dumps(events),
                          *args, *extra], log_path, port=ports.http)

    def counters(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {"l3_read": metric(text, "tierkv_tier_blocks_out_total", 'tier="l3"'),
                "l3_written": metric(text, "tierkv_tier_blocks_in_total", 'tier="l3"'),
                "requests": sum(metric(text, "tierkv_requests_total", f'route="{route}",status="200"')
                                for route in ("/v1/chat/completions", "/v1/completions"))}

    def flush(self) -> None:
        r = httpx.post(self.url + "/flush_cache", timeout=30)
        assert r.status_code == 200, f"{self.url}/flush_cache: {r.status_code} {r.text}"


class Fleet:
    """A Redis L3 and `n` replicas over it, started together; `add()` starts one more. `args`: each
    replica's model and sizes (REPLICA_ARGS); `extra`: flags besides them (a test's shutdown
    settings); `work`: what each replica is warmed up with, one conversation of two rounds (the
    second a hit, from its own L1 or, after the first replica, the shared L3)."""

    def __init__(self, workdir: Path, n: int = 3, extra: tuple[str, ...] = (), args: tuple[str, ...] = REPLICA_ARGS,
                 work: Workload | TokenWorkload | None = None) -> None:
        self.workdir, self.extra, self.args = workdir, extra, args
        self.redis = RedisServer(workdir)
        if self.redis.binary is None or not self.redis.start():
            raise RuntimeError("redis-server did not start (apt-get install -y redis-server)")
        self.replicas: list[Replica] = []
        try:
            for _ in range(n):
                self.add(wait=False)
            for r in self.replicas:
                r.wait_ready()
            self.model = httpx.get(self.replicas[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
            warm = replace(work or Workload(), conversations=1, rounds=2)
            for r in self.replicas:  # a first request pays one-time costs that no policy should
                warm.play(r.url, self.model)
        except BaseException:
            self.stop()
            raise

    def add(self, wait: bool = True, ports: Ports | None = None) -> Replica:
        r = Replica(self.workdir / f"replica{len(self.replicas)}.log", self.redis.url, ports, self.extra, self.args)
        self.replicas.append(r)
        if wait:
            r.wait_ready()
        return r

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.proc.poll() is None]

    def counters(self) -> list[dict[str, float]]:
        return [r.counters() for r in self.live]

    def settle(self, quiet_s: float = 0.5, timeout: float = 120.0) -> None:
        """Wait until the write-through to L3 has stopped (no replica wrote a block for `quiet_s`;
        on a GPU, tens of GiB can still be on their way to Redis when the last answer arrives)."""
        end, last = time.monotonic() + timeout, None
        while time.monotonic() < end:
            now = sum(c["l3_written"] for c in self.counters())
            if now == last:
                return
            last = now
            time.sleep(quiet_s)

    def reset(self) -> None:
        """Every cache empty: L1 and L2 of each replica (/flush_cache), then the shared L3."""
        self.settle()
        for r in self.live:
            r.flush()
        self.redis.client().flushall()

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        self.redis.kill()


class Router:
    """vllm-router (`kind="vllm"`) or sglang-router (`kind="sglang"`) over `workers`, on a free
    loopback port, its log in a file. kv_aware subscribes to each replica's events and replay
    socket, named on its command line: vllm-router 0.1.17 subscribes to nothing it discovers
    through /kv_event_sources, and without the replay it skips every block whose parent was
    published before it subscribed (`unknown parent; skipping unanchored store`)."""

    def __init__(self, kind: str, policy: str, workers: list[Replica | Ports], model: str, log_path: Path,
                 extra: tuple[str, ...] = ()) -> None:
        self.port, self.log_path, self.kind, self.n = free_port(), log_path, kind, len(workers)
        self.url = f"http://127.0.0.1:{self.port}"
        # a worker is a running replica, or the ports of one that may start later (listed all the same)
        urls = [w.url for w in workers]
        common = ["--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "debug",
                  *extra]
        if kind == "vllm":
            cmd = [sys.executable, "-m", "vllm_router.launch_router", *common]
            if policy == "kv_aware":
                cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]
                for w in workers:
                    events, replay = w.sources
                    cmd += ["--kv-event-source", f"{w.url}={events}", "--kv-event-replay-source", f"{w.url}={replay}"]
        else:
            cmd = [sys.executable, "-m", "sglang_router.launch_router", *common]
        with open(log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))  # without its colours

    def credited(self) -> list[int]:
        """Per kv_aware decision so far, the cached prefix tokens it credited the chosen replica with."""
        return [int(n) for n in CREDITED.findall(self.log())]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the router serves through all its workers (sglang-router adds them in the background)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited with {self.proc.returncode}:\n{self.log()}")
            if self.workers() == self.n:
                return
            time.sleep(0.2)
        raise TimeoutError(f"the router did not list {self.n} workers in {timeout} s:\n{self.log()}")

    def workers(self) -> int:
        """How many workers the router lists now."""
        try:
            r = httpx.get(self.url + ("/list_workers" if self.kind == "vllm" else "/workers"), timeout=2)
        except httpx.HTTPError:
            return -1
        if r.status_code != 200:
            return -1
        body = r.json()
        return len(body["urls"] if self.kind == "vllm" else body["workers"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Router:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------ workload

WORDS = ("cache", "block", "token", "prefix", "router", "replica", "memory", "tier", "host", "disk", "request",
         "latency", "model", "layer", "attention", "batch", "queue", "server", "client", "stream", "policy",
         "eviction", "hash", "chain", "index", "shard", "cluster", "bandwidth", "kernel", "decode", "prefill",
         "context", "window", "history", "question", "answer", "summary", "detail", "reason", "example")


@dataclass(slots=True)
class Turn:
    conversation: int
    round: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None
    ttft: float | None = None  # streamed requests only (TokenWorkload)
    completion_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    """`conversations` chats of `rounds` rounds; each round's prompt is the previous one, the
    model's answer and a new question (`first_words` long, then `next_words`). Conversation c
    starts `stagger_s` x c seconds in, as users do, rather than all in the same instant."""

    conversations: int = 6
    rounds: int = 4
    first_words: int = 100
    next_words: int = 30
    max_tokens: int = 4
    stagger_s: float = 0.5
    seed: int = 0

    def question(self, c: int, k: int) -> str:
        rng = random.Random(f"{self.seed}/{c}/{k}")  # the same question in every run and policy
        words = " ".join(rng.choice(WORDS) for _ in range(self.first_words if k == 0 else self.next_words))
        return f"Conversation {c}: {words}?" if k == 0 else f"And {words}?"

    def play(self, url: str, model: str, deadline: float = float("inf")) -> list[Turn]:
        return converse(url, model, self, deadline=deadline)


@dataclass(frozen=True)
class TokenWorkload:
    """Multi-round chat in token ids, for a model without a tokenizer (--gpu, --smoke), closed loop:
    `conversations` users at once, each starting `stagger_s` x its number in, and sending its next
    round as soon as its answer has arrived. Every conversation opens with one shared system prompt
    and a context of its own; a round adds a question, and the answer (`answer_tokens`, greedy, EOS
    ignored) joins the history as a seeded stand-in for what the model said: the prompts are then
    the same, token for token, under every policy (a returned answer may differ with the batch it
    ran in), and a round's cached prefix ends where the previous prompt did. Ids are drawn from
    [FIRST_ID, vocab), seeded per conversation. Histories are whole blocks (system + context, and
    question + answer, are multiples of the block size): a round's prompt is the last history's
    blocks and its question."""

    conversations: int = 32
    rounds: int = 4
    system_tokens: int = 256
    context_tokens: int = 7168  # with 4 rounds, 8064 tokens at the end: issue 40's 32 users x 8K
    question_tokens: int = 128
    answer_tokens: int = 32
    stagger_s: float = 0.05
    seed: int = 0
    vocab: int = 151936  # Qwen3's

    def __post_init__(self) -> None:
        first, per_round = self.system_tokens + self.context_tokens, self.question_tokens + self.answer_tokens
        if first % BLOCK_SIZE or per_round % BLOCK_SIZE:
            raise ValueError(f"system + context ({first}) and question + answer ({per_round}) tokens must be "
                             f"multiples of the block size, {BLOCK_SIZE}")

    def prompts(self, c: int) -> list[list[int]]:
        """Conversation c's prompt of each round."""
        system = random_ids(np.random.default_rng([self.seed]), self.system_tokens, self.vocab)
        g = np.random.default_rng([self.seed, 1 + c])
        history, out = system + random_ids(g, self.context_tokens, self.vocab), []
        for _ in range(self.rounds):
            out.append(history + random_ids(g, self.question_tokens, self.vocab))
            history = out[-1] + random_ids(g, self.answer_tokens, self.vocab)
        return out

    def kv_tokens(self) -> int:
        """Tokens of KV the whole workload leaves behind (the system prompt's blocks once)."""
        per = self.context_tokens + self.rounds * (self.question_tokens + self.answer_tokens)
        return self.system_tokens + self.conversations * per

    def play(self, url: str, model: str, deadline: float = float("inf")) -> list[Turn]:
        """Every conversation through `url`, each request streamed (serving.client.send: TTFT from
        the request's sending); a round not begun by `deadline` (time.monotonic()) is not sent."""

        async def run() -> list[Turn]:
            limits = httpx.Limits(max_connections=self.conversations + 4, max_keepalive_connections=self.conversations)
            async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
                h = Http(client, url, {}, model, self.vocab)

                async def user(c: int) -> list[Turn]:
                    turns = []
                    await asyncio.sleep(c * self.stagger_s)
                    for k, prompt in enumerate(self.prompts(c)):
                        if time.monotonic() > deadline:
                            break
                        r = await send(h, prompt, self.answer_tokens)
                        turns.append(Turn(c, k, r.prompt_tokens, r.cached_tokens, r.e2e, r.error, r.ttft,
                                          r.completion_tokens))
                    return turns

                return [t for turns in await asyncio.gather(*map(user, range(self.conversations))) for t in turns]

        return asyncio.run(run())


def converse(url: str, model: str, work: Workload, rounds: range | None = None,
             histories: dict[int, list[dict]] | None = None, stop: threading.Event | None = None,
             deadline: float = float("inf")) -> list[Turn]:
    """Every conversation in a thread of its own, round after round through `url` (the real openai
    client, without retries of its own: a failure the router lets through is counted), until
    `rounds` are played, `stop` is set or `deadline` (time.monotonic()) has passed. `histories`
    carries conversations on from earlier rounds."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    histories = {} if histories is None else histories
    rounds = range(work.rounds) if rounds is None else rounds

    def chat(c: int) -> list[Turn]:
        turns, messages = [], histories.setdefault(c, [])
        time.sleep(c * work.stagger_s)
        for k in rounds:
            if (stop is not None and stop.is_set()) or time.monotonic() > deadline:
                break
            messages.append({"role": "user", "content": work.question(c, k)})
            turn, t0 = Turn(c, k), time.perf_counter()
            try:
                out = client.chat.completions.create(model=model, messages=messages, max_tokens=work.max_tokens,
                                                     temperature=0)
                turn.prompt_tokens = out.usage.prompt_tokens
                turn.cached_tokens = out.usage.prompt_tokens_details.cached_tokens
                messages.append({"role": "assistant", "content": out.choices[0].message.content})
            except openai.APIError as err:
                turn.error = f"{type(err).__name__}: {err}"
                messages.pop()
            turn.seconds = time.perf_counter() - t0
            turns.append(turn)
        return turns

    with ThreadPoolExecutor(work.conversations) as pool:
        return [t for turns in pool.map(chat, range(work.conversations)) for t in turns]


def summary(turns: list[Turn], wall_s: float, before: list[dict], after: list[dict]) -> dict:
    """Hit fractions of the prompt tokens: all cached ones (`hit_fraction`, what the usage says),
    those read from the shared L3 (`l3_fraction`: blocks the replicas read out of it) and the rest,
    which the replica that served the request held itself (`local_fraction`, L1 or L2)."""
    ok = [t for t in turns if t.error is None]
    prompt, cached = sum(t.prompt_tokens for t in ok), sum(t.cached_tokens for t in ok)
    delta = [{k: a[k] - b[k] for k in a} for b, a in zip(before, after)]
    from_l3 = BLOCK_SIZE * sum(d["l3_read"] for d in delta)
    frac = (lambda n: n / prompt) if prompt else (lambda n: 0.0)
    return {
        "requests": len(turns), "failed": len(turns) - len(ok), "errors": sorted({t.error for t in turns if t.error}),
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_fraction": frac(cached),
        "local_fraction": frac(cached - from_l3), "l3_fraction": frac(from_l3),
        "wall_s": wall_s, "requests_per_s": len(ok) / wall_s, "prompt_tokens_per_s": prompt / wall_s,
        "mean_latency_s": sum(t.seconds for t in ok) / len(ok) if ok else None,
        "per_replica_requests": [int(d["requests"]) for d in delta],
        **streamed(ok, wall_s),
    }


def streamed(ok: list[Turn], wall_s: float) -> dict:
    """What streamed requests add (TokenWorkload): output tokens/s, TTFT percentiles in seconds over
    every round and over the hit rounds alone (round 0 is cold under any router); {} otherwise."""
    if not any(t.ttft is not None for t in ok):
        return {}
    return {"output_tokens_per_s": sum(t.completion_tokens for t in ok) / wall_s,
            "ttft_s": pct([t.ttft for t in ok], scale=1.0),
            "ttft_hit_rounds_s": pct([t.ttft for t in ok if t.round > 0], scale=1.0)}


def measure(fleet: Fleet, url: str, work: Workload | TokenWorkload, budget_s: float = float("inf")) -> dict:
    """The workload from empty caches through `url`, summarised; rounds not begun within `budget_s`
    are not sent (`complete` says whether every round was)."""
    fleet.reset()
    # 0 unless a write from the last run reached Redis after the flush (it would hand this one hits)
    left = fleet.redis.client().dbsize()
    before = fleet.counters()
    t0 = time.perf_counter()
    turns = work.play(url, fleet.model, deadline=time.monotonic() + budget_s)
    wall = time.perf_counter() - t0
    fleet.settle()
    out = summary(turns, wall, before, fleet.counters())
    out["complete"], out["l3_keys_at_start"] = len(turns) == work.conversations * work.rounds, left
    return out


def compare(fleet: Fleet, work: Workload | TokenWorkload, workdir: Path, policies=POLICIES, one_server: bool = True,
            budget_s: float = float("inf"), done: Callable[[dict], object] | None = None) -> dict:
    """Each vllm-router policy over the whole fleet, and one replica alone (`one_server`), each given
    `budget_s` seconds for its rounds; `done` gets the results so far after each."""
    out = {}
    for policy in policies:
        with Router("vllm", policy, fleet.live, fleet.model, workdir / f"router-{policy}.log") as router:
            out[policy] = measure(fleet, router.url, work, budget_s)
            if policy == "kv_aware":  # what the events told it the chosen replicas held
                out[policy]["router_credited_tokens"] = sum(router.credited())
        if done:
            done(out)
    if one_server:
        out["one_server"] = measure(fleet, fleet.live[0].url, work, budget_s)
        if done:
            done(out)
    return out


def table(results: dict) -> str:
    rows = [f"{'':12} {'hit':>6} {'local':>6} {'L3':>6} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>8} {'p90':>6} "
            f"{'hit p90':>7} {'failed':>6}  requests per replica"]
    for name, r in results.items():
        ttft, hit = r.get("ttft_s") or {}, r.get("ttft_hit_rounds_s") or {}
        cells = [r.get("output_tokens_per_s"), ttft.get("p50"), ttft.get("p90"), hit.get("p90")]
        tok, p50, p90, hp90 = (f"{v:.2f}" if v is not None else "-" for v in cells)
        rows.append(f"{name:12} {r['hit_fraction']:6.3f} {r['local_fraction']:6.3f} {r['l3_fraction']:6.3f} "
                    f"{r['requests_per_s']:6.2f} {tok:>7} {p50:>8} {p90:>6} {hp90:>7} {r['failed']:6d}  "
                    f"{r['per_replica_requests']}")
    return "\n".join(rows)


def make_model(tmp: Path, smoke: bool) -> Path:
    """A random-weight Qwen3 saved under `tmp` (outside the tree): the 0.6B shape in bf16, built on
    the GPU, or bench_throughput's tiny one in fp32 on the CPU for --smoke. No tokenizer."""
    import torch
    from transformers import Qwen3Config

    from bench_throughput import QWEN3_06B, TINY_QWEN3, release_memory, save_random_model

    shape = TINY_QWEN3 if smoke else dict(QWEN3_06B, max_position_embeddings=8192)
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("--gpu serves replicas of a Qwen3-0.6B shape on a GPU; use --smoke on a CPU")
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    path = tmp / ("qwen3-tiny-random" if smoke else "qwen3-0.6b-random")
    model, _ = save_random_model(Qwen3Config(**shape), path, torch.device(device), dtype)
    del model
    release_memory()
    return path


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--gpu", action="store_true", help="the fleet on one GPU: a Qwen3-0.6B shape, TokenWorkload")
    mode.add_argument("--smoke", action="store_true", help="--gpu's code path on a CPU: a tiny model, a few requests")
    p.add_argument("--replicas", type=int, default=None, help="default 3; --gpu 4; --smoke 2")
    p.add_argument("--conversations", type=int, default=None, help="users (default: the workload's)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--context-tokens", type=int, default=None, help="--gpu: each conversation's own context")
    p.add_argument("--policies", default=None, help="comma-separated vllm-router policies (default: all three; "
                   "--gpu and --smoke: kv_aware,round_robin)")
    p.add_argument("--l1", default=None, help="--gpu: each replica's L1 (default 8GiB)")
    p.add_argument("--l2", default=None, help="--gpu: each replica's pinned L2 (default 10GiB)")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="seconds each policy may spend starting rounds (default: no limit; gpu_check.sh: 150)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    fleet_mode = a.gpu or a.smoke
    if a.smoke and a.out is None:  # a smoke run's figures are no results
        a.out = Path(tempfile.gettempdir()) / "bench_routers-smoke"
    if fleet_mode:
        work = TokenWorkload(conversations=4, rounds=2, system_tokens=32, context_tokens=64, question_tokens=12,
                             answer_tokens=4, vocab=TINY_VOCAB) if a.smoke else TokenWorkload()
        args = list(SMOKE_REPLICA_ARGS if a.smoke else GPU_REPLICA_ARGS)
        for flag, value in (("--l1", a.l1), ("--l2", a.l2)):
            if value is not None:
                args[args.index(flag) + 1] = value
        policies = GPU_POLICIES
    else:
        if a.context_tokens or a.l1 or a.l2:
            p.error("--context-tokens, --l1 and --l2 are --gpu's (the CPU fleet runs REPLICA_ARGS)")
        work, args, policies = Workload(), list(REPLICA_ARGS), POLICIES
    work = replace(work, **{k: v for k, v in (("conversations", a.conversations), ("rounds", a.rounds),
                                              ("context_tokens", a.context_tokens)) if v is not None})
    policies = tuple(a.policies.split(",")) if a.policies else policies
    replicas = a.replicas or (2 if a.smoke else 4 if a.gpu else 3)
    with tempfile.TemporaryDirectory(prefix="bench_routers-") as tmp:
        if fleet_mode:
            t0 = time.perf_counter()
            args = ["--model", str(make_model(Path(tmp), a.smoke)), *args]
            print(f"model made in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        fleet = Fleet(Path(tmp), replicas, args=tuple(args), work=work)
        print(f"{replicas} replicas up and warm in {time.perf_counter() - t0:.1f} s", flush=True)
        name = "routers_fleet" if fleet_mode else "routers"
        written = []  # the JSON after each policy: a run cut short keeps what it measured
        try:
            compare(fleet, work, Path(tmp), policies, one_server=not fleet_mode, budget_s=a.budget_s,
                    done=lambda results: written.append(report(results, work, replicas, a.out, args, name)))
        finally:
            fleet.stop()
    return written[-1]


def report(results: dict, work: Workload | TokenWorkload, replicas: int, out: Path | None = None,
           replica_args=REPLICA_ARGS, name: str = "routers") -> Path:
    """Print the table and write the JSON (benchmarks/results/<name>-<machine>.json by default);
    with streamed figures, a PNG of them beside it."""
    print(table(results), flush=True)
    figures = {"replicas": replicas, "workload": asdict(work), "replica_args": list(replica_args),
               "router": "vllm-router " + version("vllm-router"), "results": results}
    if isinstance(work, TokenWorkload):
        figures["workload_kv_tokens"] = work.kv_tokens()
        kv, rr = results.get("kv_aware"), results.get("round_robin")
        if kv and rr:  # the ratios the issue asks for: above 1 for throughput, below 1 for TTFT favour kv_aware
            figures["kv_aware_vs_round_robin"] = {
                "throughput": ratio(kv["requests_per_s"], rr["requests_per_s"]),
                "output_tokens_per_s": ratio(kv.get("output_tokens_per_s"), rr.get("output_tokens_per_s")),
                "p90_ttft": ratio(kv["ttft_s"]["p90"], rr["ttft_s"]["p90"]),
                "p90_ttft_hit_rounds": ratio(kv["ttft_hit_rounds_s"]["p90"], rr["ttft_hit_rounds_s"]["p90"])}
    path = write_results(name, figures, out)
    if isinstance(work, TokenWorkload):
        plot(results, path.with_suffix(".png"))
    return path


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where a side has no figure."""
    return a / b if a is not None and b else None


def plot(results: dict, path: Path) -> None:
    """Throughput and TTFT (p50 and p90, all rounds) per policy, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(names, [results[n]["output_tokens_per_s"] for n in names], color="tab:blue")
    left.set_ylabel("output tokens / s")
    x = np.arange(len(names))
    for i, q in enumerate(("p50", "p90")):
        right.bar(x + (i - 0.5) * 0.4, [results[n]["ttft_s"][q] or 0 for n in names], 0.4, label=f"TTFT {q}")
    right.set_xticks(x, names)
    right.set_ylabel("seconds")
    right.legend()
    fig.suptitle("tierkv-serve replicas behind vllm-router")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    print(main())
