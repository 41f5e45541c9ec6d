"""Soak and faults under load: a real tierkv-serve process, a real redis-server as L3, httpx clients.

test_soak_*: closed-loop clients send a steady mix (shared prefixes that hit L1/L2/L3, unique
prompts that miss, streaming and not) for a warm-up and four measured quarters; every answer
must be complete, the server's RSS and open files must not grow, no KV block may stay held once
idle, and the median latency of the last quarter may be at most 10% above the first quarter's
(checked when the machine itself held steady between the two: see OTHER_LOAD_LIMIT).
test_redis_killed_*: one fixed workload against two servers, one whose Redis is SIGKILLed
mid-run and restarted; every answer must come, with the fault-free run's tokens.

The model is a random-weight tiny Llama (tests/models.py) with a word-level tokenizer whose
token i is the word "w{i}": prompts go as token ids, and every answer's text (streamed delta by
delta or whole) names its token ids exactly, so answers compare id by id. Tiny, so that a CPU
step costs milliseconds and the load is the server's own work, not the model's.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("redis")
from models import save_tiny_checkpoint
from server_helpers import ServerProcess, metric
from services import RedisServer, unavailable

pytestmark = pytest.mark.slow  # ~95 s for the soak, ~30-45 s for the fault runs (2-core CPU)

MODEL = "tiny"
VOCAB = 512  # tests/models.py TINY
BLOCK = 16
PREFIX_TOKENS = 4 * BLOCK  # a shared prefix: 4 full blocks
PROMPT_TOKENS = PREFIX_TOKENS + 8
MAX_TOKENS = 16  # with ignore_eos: every request prefills 72 tokens and decodes 16
# One block of the tiny model: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
# torch's OpenMP workers spin-wait; on a 2-core box shared with the clients and Redis that turns
# a 35 ms request into 0.3-3 s at random (measured). One thread makes each step cost the same
# whatever else runs, which is what a latency comparison between quarters needs.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A random-weight tiny Llama with a word-level tokenizer: token i <-> the word "w{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-soak"), seed=1)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def start_server(model: Path, log: Path, l1: int, l2: int, l3: str) -> ServerProcess:
    srv = ServerProcess(["--model", str(model), "--served-model-name", MODEL, "--l1", str(l1), "--l2", str(l2),
                         "--l3", l3, "--max-model-len", "512", "--log-level", "warning"], log, env=SERVER_ENV)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


def cap_redis(redis_server, size: int) -> None:
    """Bound the store (write-through puts every block there): an LRU Redis, as one would deploy."""
    r = redis_server.client()
    r.config_set("maxmemory", str(size))
    r.config_set("maxmemory-policy", "allkeys-lru")


def ids_of(text: str) -> list[int]:
    words = text.split()
    assert all(w[0] == "w" for w in words), text
    return [int(w[1:]) for w in words]


# ---------------------------------------------------------------------------- one request


@dataclass(slots=True)
class Answer:
    key: int  # which request: the plan's key (fault test), the client's count (soak)
    stream: bool
    start: float
    end: float
    error: str | None  # what was wrong with the answer, None when it is complete
    ids: list[int]

    @property
    def latency(self) -> float:
        return self.end - self.start


async def complete(c: httpx.AsyncClient, url: str, key: int, prompt: list[int], stream: bool) -> Answer:
    """One /v1/completions request, checked: status 200, MAX_TOKENS ids, finish_reason length, usage
    and (streaming) an event per token and [DONE] last. Never raises: a failure is the Answer's error."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    ids: list[int] = []
    try:
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise AssertionError(f"status {r.status_code}: {r.text[:300]}")
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            usage = chunks[-1]["usage"]
            deltas = [ch["choices"][0] for ch in chunks[:-1]]
            text = "".join(d["text"] for d in deltas)
            reason = deltas[-1]["finish_reason"]
            assert sum(1 for d in deltas if d["text"]) == MAX_TOKENS, deltas  # one word a token
        else:
            r = await c.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, f"status {r.status_code}: {r.text[:300]}"
            out = r.json()
            text, reason, usage = out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"]
        ids = ids_of(text)
        assert len(ids) == MAX_TOKENS and reason == "length", (len(ids), reason)
        assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] == len(prompt), usage
        error = None
    except Exception as err:  # noqa: BLE001 (reported with the others at the end)
        error = f"{type(err).__name__}: {err}"
    return Answer(key, stream, start, time.monotonic(), error, ids)


def stats(srv: ServerProcess) -> dict:
    return httpx.get(srv.url + "/v1/cache/stats", timeout=30).json()


def redis_stats(s: dict) -> dict:
    (store,) = s["l3_stores"]
    assert store["name"] == "redis"
    return store


def wait_idle_and_nothing_held(srv: ServerProcess, timeout: float = 30.0) -> dict:
    """Once no request runs, every L1 block is evictable or free (no pin left behind), and so is
    every L2 block once the background L3 writes are done (no hold left behind). `used` is
    `capacity - len(free list)`, so used == evictable also says that no slot left both the free
    list and the index (a leaked slot)."""
    end = time.monotonic() + timeout
    while True:
        m = httpx.get(srv.url + "/metrics", timeout=30).text
        s = stats(srv)
        l1, l2 = s["tiers"]["l1"], s["tiers"]["l2"]
        idle = metric(m, "tierkv_requests_running") == 0 and metric(m, "tierkv_requests_waiting") == 0
        if idle and l1["used_blocks"] == l1["evictable_blocks"] and l2["used_blocks"] == l2["evictable_blocks"]:
            break
        if time.monotonic() > end:
            raise AssertionError(f"blocks still held {timeout} s after the last answer: l1 {l1}, l2 {l2}, "
                                 f"running {metric(m, 'tierkv_requests_running')}")
        time.sleep(0.2)
    for tier in ("l1", "l2"):
        t = s["tiers"][tier]
        assert 0 <= t["used_blocks"] <= t["capacity_blocks"], t
    # each index entry sits in L1 or L2 (or both): as many entries as the slots they use, at most
    assert max(l1["used_blocks"], l2["used_blocks"]) <= s["blocks"] <= l1["used_blocks"] + l2["used_blocks"], s
    return s


def assert_clean_exit(srv: ServerProcess, code: int) -> None:
    """The server drained and exited 0 on SIGTERM, and logged no stack trace all along."""
    log = srv.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


# ---------------------------------------------------------------------------- soak

SOAK_CLIENTS = 4
SOAK_WARMUP_S = 12.0  # first requests, allocator growth, Redis filling up: not measured
SOAK_QUARTER_S = 18.0  # the measured window is four of these: ~500-900 requests each on a 2-core CPU
SOAK_PREFIXES = 16  # 64 blocks: L1 and L2 together hold 64, unique prompts push them down to L3
SOAK_L1, SOAK_L2 = 32 * BLOCK_BYTES, 32 * BLOCK_BYTES  # 4 clients need 24 L1 blocks at most
# Write-through sends every new block to Redis (~2.5 MB/s here): a small LRU Redis is full within
# the warm-up, so the measured window sees one steady regime (evicting as it stores) throughout,
# rather than a store that changes behaviour the moment it fills.
SOAK_REDIS_BYTES = 8 << 20
P50_BOUND = 0.10  # the bound: last quarter's median latency at most 10% above the first's
# Latencies of two quarters say something about the server only if the machine ran it alike in
# both, and a shared VM does not. Measured on the 2-core dev box: (1) another test run taking ~1
# core made the server's share swing by 30% within seconds and its p50 by +-40%; (2) with the box
# otherwise idle, the host's speed drifted: the CPU time of a fixed piece of Python moved between
# 2.6 and 4.3 ms from one 10 s window to the next, the server's CPU time per identical request
# followed it (17 to 27 ms) and so did its p50 (83 to 121 ms). No load shape holds 10% through
# that. So each quarter also measures (1) the CPU time used by anything but the server, Redis,
# this process and the probe, and (2) the median CPU time MACHINE_PROBE's fixed work takes (CPU
# time: waiting for a core does not count, only how fast the core runs). The latency check runs
# when, between the first and the last quarter, (1) stayed under OTHER_LOAD_LIMIT and (2) moved
# by less than PROBE_DRIFT_LIMIT; otherwise it is skipped, with the numbers, after every other
# check has run. (The server's own cost does not drift: its CPU time per request over the probe's
# stayed between 6 and 8, with no trend, over 100 s.)
OTHER_LOAD_LIMIT = 0.3  # cores
PROBE_DRIFT_LIMIT = 0.05  # half the latency bound: what is left is the server's
MACHINE_PROBE = """
import time
while True:  # every 0.1 s: the CPU time ~3 ms of fixed pure-Python work takes now
    c0 = time.thread_time()
    x = 0
    for i in range(20000):
        x += i * i % 7
    print(time.monotonic(), time.thread_time() - c0, flush=True)
    time.sleep(0.1)
"""
# RSS growth allowed from the end of the first quarter to the end. Without a leak the server's RSS
# moves by less than 1 MiB there (allocator and interpreter noise: 0.1-0.5 MiB in every run so
# far, 1,600-2,400 requests in those three quarters). 8 MiB is far above that noise and still
# catches a leak of ~5 KiB a request: less than one KV block (8 KiB here), or one request's
# prompt, outputs and bookkeeping objects left behind.
RSS_GROWTH_BOUND = 8 << 20
FD_GROWTH_BOUND = 8  # open files: sockets to Redis and clients come and go; a leak grows without end
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> tuple[int, int]:
    """(VmRSS in bytes, open file descriptors) of a process, from /proc."""
    rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


def cpu_ticks(pids: list[int]) -> tuple[float, int, int]:
    """(now, CPU ticks the whole machine spent busy, ticks `pids` spent, their threads included)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    ours = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ours += int(fields[11]) + int(fields[12])  # utime, stime
    return time.monotonic(), user + nice + system + irq + softirq + steal, ours


def other_load(samples: list[tuple[float, int, int]], start: float, end: float) -> float:
    """Cores used by other processes between `start` and `end`, from cpu_ticks samples."""
    inside = [x for x in samples if start <= x[0] <= end]
    if len(inside) < 2:
        return 0.0
    (t0, busy0, ours0), (t1, busy1, ours1) = inside[0], inside[-1]
    return max(0, (busy1 - busy0) - (ours1 - ours0)) / CLK_TCK / (t1 - t0)


KINDS = [(hit, stream) for hit in (True, False) for stream in (True, False)]


def soak_request(i: int, rng: random.Random, prefixes: list[list[int]]) -> tuple[list[int], bool]:
    """The i-th request of a client: the four kinds (a shared prefix that hits or a unique prompt
    that misses, streamed or not) in turn, so every quarter holds the same mix."""
    hit, stream = KINDS[i % len(KINDS)]
    tail = PROMPT_TOKENS - PREFIX_TOKENS if hit else PROMPT_TOKENS
    head = prefixes[rng.randrange(len(prefixes))] if hit else []
    return head + [rng.randrange(VOCAB) for _ in range(tail)], stream


@pytest.fixture(scope="module")
def soak_redis(tmp_path_factory):
    """A Redis of the soak's own, shared by the two tests that read one soak run."""
    server = RedisServer(tmp_path_factory.mktemp("soak-redis"))
    if server.binary is None or not server.start():
        server.kill()
        unavailable("redis-server is missing or did not start", "apt-get install -y redis-server")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def soak(tiny_model, soak_redis, tmp_path_factory) -> dict:
    """One soak run: the answers by quarter, what the machine did meanwhile, the server's RSS and
    open files, its stats once idle, and its exit code. The tests below judge it."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads RSS, fds and CPU time from Linux's /proc")
    redis_server, tmp_path = soak_redis, tmp_path_factory.mktemp("soak")
    cap_redis(redis_server, SOAK_REDIS_BYTES)
    srv = start_server(tiny_model, tmp_path / "server.log", SOAK_L1, SOAK_L2, redis_server.url)
    out: dict = {"srv": srv}
    try:
        rng = random.Random(0)
        prefixes = [[rng.randrange(VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(SOAK_PREFIXES)]
        answers: list[Answer] = []
        ticks: list[tuple[float, int, int]] = []
        status: dict[str, tuple[int, int]] = {}
        measure_from = time.monotonic() + SOAK_WARMUP_S
        stop_at = measure_from + 4 * SOAK_QUARTER_S

        def quarter_load(q: int) -> float:
            start = measure_from + q * SOAK_QUARTER_S
            return other_load(ticks, start, start + SOAK_QUARTER_S)

        async def client(c: httpx.AsyncClient, i: int) -> None:
            r = random.Random(1000 + i)
            n = i  # clients start at different kinds
            while time.monotonic() < stop_at:
                prompt, stream = soak_request(n, r, prefixes)
                answers.append(await complete(c, srv.url, n, prompt, stream))
                n += 1

        async def watch() -> None:
            """Sample CPU use; read RSS and fds once the first quarter is over."""
            while time.monotonic() < stop_at:
                ticks.append(cpu_ticks(pids))
                if "first" not in status and time.monotonic() >= measure_from + SOAK_QUARTER_S:
                    status["first"] = proc_status(srv.proc.pid)
                await asyncio.sleep(0.25)
            ticks.append(cpu_ticks(pids))

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=2 * SOAK_CLIENTS)) as c:
                await asyncio.gather(watch(), *(client(c, i) for i in range(SOAK_CLIENTS)))
            status["end"] = proc_status(srv.proc.pid)

        probe = subprocess.Popen([sys.executable, "-c", MACHINE_PROBE], stdout=subprocess.PIPE, text=True)
        pids = [srv.proc.pid, redis_server.proc.pid, os.getpid(), probe.pid]
        try:
            asyncio.run(run())
        finally:
            probe.kill()
            probe_out = [tuple(map(float, line.split())) for line in probe.communicate()[0].splitlines()]

        def probe_ms(q: int) -> float:
            start = measure_from + q * SOAK_QUARTER_S
            return 1e3 * statistics.median(c for t, c in probe_out if start <= t < start + SOAK_QUARTER_S)

        quarters: list[list[Answer]] = [[] for _ in range(4)]
        for a in answers:  # by start time; warm-up requests are in none
            if a.start >= measure_from:
                quarters[min(3, int((a.start - measure_from) // SOAK_QUARTER_S))].append(a)
        done = [q for q in quarters if q]
        p50 = [statistics.median(a.latency for a in q) for q in done]
        load = [quarter_load(q) for q in range(4)]
        speed = [probe_ms(q) for q in range(4)]
        (rss_first, fds_first), (rss_end, fds_end) = status["first"], status["end"]
        report = (f"{len(answers)} answers; by quarter: requests {[len(q) for q in quarters]}, "
                  f"p50 {[f'{x * 1e3:.1f} ms' for x in p50]}, other load {[f'{x:.2f}' for x in load]} cores, "
                  f"probe {[f'{x:.2f}' for x in speed]} ms; "
                  f"server RSS {rss_first / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB, fds {fds_first} -> {fds_end}")
        print("soak:", report)
        out.update(answers=answers, quarters=quarters, p50=p50, load=load, speed=speed, report=report,
                   rss=(rss_first, rss_end), fds=(fds_first, fds_end), idle=wait_idle_and_nothing_held(srv))
    finally:
        out["code"] = srv.stop()
    return out


def test_soak_every_answer_complete_no_leak_nothing_held(soak):
    bad = [a for a in soak["answers"] if a.error]
    assert not bad, f"{len(bad)} of {len(soak['answers'])} answers incomplete: {[a.error for a in bad[:5]]}"
    report = soak["report"]
    assert min(len(q) for q in soak["quarters"]) >= 100, report  # enough requests for a median to mean something
    assert soak["rss"][1] - soak["rss"][0] <= RSS_GROWTH_BOUND, report
    assert soak["fds"][1] - soak["fds"][0] <= FD_GROWTH_BOUND, report
    s = soak["idle"]  # wait_idle_and_nothing_held asserted that no block stayed held
    l3 = redis_stats(s)
    # the load really went through every tier: L2 and L3 hits, and no L3 error
    assert s["tiers"]["l2"]["hit_tokens"] > 0 and s["tiers"]["l3"]["hit_tokens"] > 0, s
    assert l3["hits"] > 0 and l3["puts"] > 0 and not any(l3["errors"].values()), l3
    assert_clean_exit(soak["srv"], soak["code"])


def test_soak_median_latency_holds_from_first_to_last_quarter(soak):
    load, speed, p50, report = soak["load"], soak["speed"], soak["p50"], soak["report"]
    assert len(p50) == 4, report
    if max(load[0], load[3]) > OTHER_LOAD_LIMIT or abs(speed[3] / speed[0] - 1) > PROBE_DRIFT_LIMIT:
        pytest.skip(f"the machine changed between the first and the last quarter (other work above {OTHER_LOAD_LIMIT} "
                    f"core, or the probe's CPU time off by more than {PROBE_DRIFT_LIMIT:.0%}), so their latencies "
                    f"say nothing about the server: {report}")
    # a slowdown is what a soak looks for; a last quarter faster than the first (seen: -12% while
    # the probe said the host sped up) is the machine, not the server wearing out
    assert p50[3] <= (1 + P50_BOUND) * p50[0], report


# ---------------------------------------------------------------------------- L3 killed mid-run

FAULT_CLIENTS = 3
FAULT_SESSIONS = 8  # per client: 288 requests in all
# Each session: a fresh prefix used by 3 requests, 3 unique prompts after each use, so that between
# two uses of a prefix ~10 requests (~50 blocks) pass through L1 + L2 (40 blocks): reuses load from L3.
FAULT_USES, FAULT_GAP = 3, 3
FAULT_L1, FAULT_L2 = 24 * BLOCK_BYTES, 16 * BLOCK_BYTES  # 3 clients need 18 L1 blocks at most
KILL_AT = 0.25  # share of the requests started when Redis is killed
RESTART_AT = 0.5  # share started before it is back: the rest wait for the restart
OUTAGE_MIN_S = 2.0  # Redis stays down at least this long


def fault_plan() -> list[list[tuple[int, list[int], bool]]]:
    """Per client, its requests in order: (key, prompt ids, stream). Every prompt is distinct."""
    rng = random.Random(7)
    plan, key = [], 0
    for _ in range(FAULT_CLIENTS):
        mine = []
        for _ in range(FAULT_SESSIONS):
            prefix = [rng.randrange(VOCAB) for _ in range(PREFIX_TOKENS)]
            for _ in range(FAULT_USES):
                prompts = [prefix + [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS - PREFIX_TOKENS)]]
                prompts += [[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(FAULT_GAP)]
                for p in prompts:
                    mine.append((key, p, key % 2 == 1))
                    key += 1
        plan.append(mine)
    return plan


def run_plan(srv: ServerProcess, plan, gate=None):
    """(answers, started, run): `await run(tasks)` has every client run its list in order, alongside
    `tasks`, appending to `answers`; `started[0]` counts the requests begun; `gate(n)` is awaited
    before the n-th request begins."""
    answers: list[Answer] = []
    started = [0]

    async def client(c: httpx.AsyncClient, mine) -> None:
        for key, prompt, stream in mine:
            n = started[0]
            started[0] += 1
            if gate is not None:
                await gate(n)
            answers.append(await complete(c, srv.url, key, prompt, stream))

    async def run(extra):
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*extra, *(client(c, mine) for mine in plan))

    return answers, started, run


def assert_all_answered(answers: list, total: int) -> None:
    bad = [a for a in answers if a.error]
    assert not bad and len(answers) == total, [a.error for a in bad[:5]]


def l3_errors(store: dict) -> int:
    return sum(store["errors"].values())


def test_redis_killed_mid_run_every_answer_comes_with_the_same_tokens(tiny_model, redis_server, tmp_path):
    plan = fault_plan()
    total = sum(len(mine) for mine in plan)

    # -- the fault-free run
    srv = start_server(tiny_model, tmp_path / "clean.log", FAULT_L1, FAULT_L2, redis_server.url)
    try:
        answers, _, run = run_plan(srv, plan)
        t0 = time.monotonic()
        asyncio.run(run([]))
        clean_s = time.monotonic() - t0
        s = wait_idle_and_nothing_held(srv)
    finally:
        code = srv.stop()
    assert_clean_exit(srv, code)
    assert_all_answered(answers, total)
    clean = redis_stats(s)
    assert clean["hits"] > 0 and l3_errors(clean) == 0, clean
    expected = {a.key: a.ids for a in answers}

    # -- the same workload, Redis SIGKILLed once a quarter of it has started, back a few seconds later
    redis_server.client().flushall()
    srv = start_server(tiny_model, tmp_path / "faulty.log", FAULT_L1, FAULT_L2, redis_server.url)
    try:
        marks: dict[str, dict] = {}
        health: list[int] = []
        killed, restarted = asyncio.Event(), asyncio.Event()

        async def gate(n: int) -> None:
            if n >= RESTART_AT * total:
                await restarted.wait()

        answers, started, run = run_plan(srv, plan, gate)

        async def fault(c: httpx.AsyncClient) -> None:
            while started[0] < KILL_AT * total:
                await asyncio.sleep(0.01)
            marks["kill"] = (await c.get(srv.url + "/v1/cache/stats")).json()
            marks["kill"].update(answers=len(answers), in_flight=started[0] - len(answers))
            redis_server.kill()
            killed.set()
            t_kill = time.monotonic()
            while time.monotonic() < t_kill + OUTAGE_MIN_S or started[0] < RESTART_AT * total:
                await asyncio.sleep(0.05)
            marks["restart"] = (await c.get(srv.url + "/v1/cache/stats")).json()
            marks["restart"].update(answers=len(answers), outage_s=time.monotonic() - t_kill)
            assert await asyncio.to_thread(redis_server.start), "redis-server did not restart"
            restarted.set()

        async def poll_health(c: httpx.AsyncClient) -> None:
            await killed.wait()
            while not restarted.is_set():
                health.append((await c.get(srv.url + "/health")).status_code)
                await asyncio.sleep(0.1)

        async def with_fault():
            async with httpx.AsyncClient(timeout=30) as c:
                await run([fault(c), poll_health(c)])

        t0 = time.monotonic()
        asyncio.run(with_fault())
        faulty_s = time.monotonic() - t0
        s = wait_idle_and_nothing_held(srv)
    finally:
        code = srv.stop()
    assert_clean_exit(srv, code)

    assert_all_answered(answers, total)
    wrong = [a.key for a in answers if a.ids != expected[a.key]]
    assert not wrong, f"{len(wrong)} answers differ from the fault-free run's, e.g. key {wrong[0]}"

    at_kill, at_restart, end = (redis_stats(x) for x in (marks["kill"], marks["restart"], s))
    print(f"fault: {total} requests, fault-free run {clean_s:.1f} s ({clean['hits']} L3 hits); faulty run "
          f"{faulty_s:.1f} s: killed with {marks['kill']['answers']} answered and {marks['kill']['in_flight']} in "
          f"flight, {at_kill['hits']} L3 hits; down {marks['restart']['outage_s']:.1f} s, "
          f"{marks['restart']['answers'] - marks['kill']['answers']} answered meanwhile, L3 errors "
          f"{ {k: v for k, v in at_restart['errors'].items() if v} }, {len(health)} health polls; after the "
          f"restart {end['hits'] - at_restart['hits']} L3 hits, {end['puts'] - at_restart['puts']} puts")
    # before the fault the workload read from Redis; during the outage it kept asking (lookups
    # that failed, counted as errors) and kept being answered; after the restart it read again
    assert at_kill["hits"] > 0 and l3_errors(at_kill) == 0 and marks["kill"]["in_flight"] > 0, marks["kill"]
    assert at_restart["lookups"] > at_kill["lookups"] and l3_errors(at_restart) > 0, at_restart
    assert marks["restart"]["answers"] > marks["kill"]["answers"], marks  # answers came during the outage
    assert end["hits"] > at_restart["hits"] and end["puts"] > at_restart["puts"], (at_restart, end)
    assert health and all(code == 200 for code in health), health
