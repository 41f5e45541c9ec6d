"""A fleet of tierkv-serve replicas over one Redis L3 (Fleet, Replica, Ports) and the router in front
of it (Router: vllm-router or sglang-router), as processes of their own with their logs in files.
This file starts, waits for, flushes and stops them; it never decides what requests to send.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from server_helpers import ServerProcess, free_port, metric
from services import RedisServer

from .workloads import BLOCK_SIZE, TokenWorkload, Workload

# L1 holds every conversation of the workload below on one replica (the ideal needs no eviction);
# an L2 is what L3 blocks are staged through
REPLICA_ARGS = ("--l1", "160MiB", "--l2", "64MiB", "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE))
# vllm-router's debug line for each kv_aware choice: the prefix tokens it credited the chosen replica with
CREDITED = re.compile(r"KV prefix decision .*?credited_prefix_tokens=(\d+)")
READY_TIMEOUT_S = 60.0


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
