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
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the server and Redis launchers the tests use
from common import write_results  # noqa: E402
from server_helpers import ServerProcess, free_port, metric  # noqa: E402
from services import RedisServer  # noqa: E402

BLOCK_SIZE = 16  # tierkv-serve's default, and what the router hashes prompts by
# L1 holds every conversation of the workload below on one replica (the ideal needs no eviction);
# an L2 is what L3 blocks are staged through
REPLICA_ARGS = ("--l1", "160MiB", "--l2", "64MiB", "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE))
POLICIES = ("kv_aware", "cache_aware", "round_robin")
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
    """tierkv-serve (the bundled model) writing every block through to the shared L3 and
    publishing its KV-cache events, with a replay socket, on ports of its own (`ports`: given ones)."""

    def __init__(self, log_path: Path, l3: str, ports: Ports | None = None, extra: tuple[str, ...] = ()) -> None:
        ports = ports or Ports.free()
        # '*' binds the server's host; a named host would make the publisher connect there (vLLM's rule)
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{ports.events}",
                  "replay_endpoint": f"tcp://*:{ports.replay}"}
        self.sources = ports.sources  # (events, replay) as a router connects to them
        super().__init__(["--l3", l3, "--write-policy", "write_through", "--kv-events-config", json.dumps(events),
                          *REPLICA_ARGS, *extra], log_path, port=ports.http)

    def counters(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {"l3_read": metric(text, "tierkv_tier_blocks_out_total", 'tier="l3"'),
                "l3_written": metric(text, "tierkv_tier_blocks_in_total", 'tier="l3"'),
                "requests": metric(text, "tierkv_requests_total", 'route="/v1/chat/completions",status="200"')}

    def flush(self) -> None:
        r = httpx.post(self.url + "/flush_cache", timeout=30)
        assert r.status_code == 200, f"{self.url}/flush_cache: {r.status_code} {r.text}"


class Fleet:
    """A Redis L3 and `n` replicas over it, started together; `add()` starts one more. `extra`: flags
    every replica takes besides REPLICA_ARGS (a test's shutdown settings)."""

    def __init__(self, workdir: Path, n: int = 3, extra: tuple[str, ...] = ()) -> None:
        self.workdir, self.extra = workdir, extra
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
            for r in self.replicas:  # a first request pays one-time costs that no policy should
                converse(r.url, self.model, Workload(conversations=1, rounds=1))
        except BaseException:
            self.stop()
            raise

    def add(self, wait: bool = True, ports: Ports | None = None) -> Replica:
        r = Replica(self.workdir / f"replica{len(self.replicas)}.log", self.redis.url, ports, self.extra)
        self.replicas.append(r)
        if wait:
            r.wait_ready()
        return r

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.proc.poll() is None]

    def counters(self) -> list[dict[str, float]]:
        return [r.counters() for r in self.live]

    def settle(self, quiet_s: float = 0.5, timeout: float = 30.0) -> None:
        """Wait until the write-through to L3 has stopped (no replica wrote a block for `quiet_s`)."""
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


def converse(url: str, model: str, work: Workload, rounds: range | None = None,
             histories: dict[int, list[dict]] | None = None, stop: threading.Event | None = None) -> list[Turn]:
    """Every conversation in a thread of its own, round after round through `url` (the real openai
    client, without retries of its own: a failure the router lets through is counted), until
    `rounds` are played or `stop` is set. `histories` carries conversations on from earlier rounds."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    histories = {} if histories is None else histories
    rounds = range(work.rounds) if rounds is None else rounds

    def chat(c: int) -> list[Turn]:
        turns, messages = [], histories.setdefault(c, [])
        time.sleep(c * work.stagger_s)
        for k in rounds:
            if stop is not None and stop.is_set():
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
    }


def measure(fleet: Fleet, url: str, work: Workload) -> dict:
    """The workload from empty caches through `url`, summarised."""
    fleet.reset()
    before = fleet.counters()
    t0 = time.perf_counter()
    turns = converse(url, fleet.model, work)
    wall = time.perf_counter() - t0
    fleet.settle()
    return summary(turns, wall, before, fleet.counters())


def compare(fleet: Fleet, work: Workload, workdir: Path, policies=POLICIES) -> dict:
    """Each vllm-router policy over the whole fleet, and one replica alone (`one_server`)."""
    out = {}
    for policy in policies:
        with Router("vllm", policy, fleet.live, fleet.model, workdir / f"router-{policy}.log") as router:
            out[policy] = measure(fleet, router.url, work)
            if policy == "kv_aware":  # what the events told it the chosen replicas held
                out[policy]["router_credited_tokens"] = sum(router.credited())
    out["one_server"] = measure(fleet, fleet.live[0].url, work)
    return out


def table(results: dict) -> str:
    rows = [f"{'':12} {'hit':>6} {'local':>6} {'L3':>6} {'req/s':>6} {'failed':>6}  requests per replica"]
    for name, r in results.items():
        rows.append(f"{name:12} {r['hit_fraction']:6.3f} {r['local_fraction']:6.3f} {r['l3_fraction']:6.3f} "
                    f"{r['requests_per_s']:6.2f} {r['failed']:6d}  {r['per_replica_requests']}")
    return "\n".join(rows)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=Workload.conversations)
    p.add_argument("--rounds", type=int, default=Workload.rounds)
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    work = Workload(conversations=a.conversations, rounds=a.rounds)
    with tempfile.TemporaryDirectory(prefix="bench_routers-") as tmp:
        fleet = Fleet(Path(tmp), a.replicas)
        try:
            results = compare(fleet, work, Path(tmp))
        finally:
            fleet.stop()
    return report(results, work, a.replicas, a.out)


def report(results: dict, work: Workload, replicas: int, out: Path | None = None) -> Path:
    """Print the table and write the JSON (benchmarks/results/routers-<machine>.json by default)."""
    print(table(results))
    return write_results("routers", {"replicas": replicas, "workload": asdict(work), "replica_args": list(REPLICA_ARGS),
                                     "router": "vllm-router " + version("vllm-router"), "results": results}, out)


if __name__ == "__main__":
    print(main())
