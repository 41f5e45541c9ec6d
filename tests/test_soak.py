"""Soak under load: a real tierkv-serve process, a real redis-server as L3, httpx clients.

Closed-loop clients send a steady mix (shared prefixes that hit L1/L2/L3, unique prompts that
miss, streaming and not) for a warm-up and four measured quarters; every answer must be
complete, the server's RSS and open files must not grow, no KV block may stay held once idle,
and the median latency of the last quarter may be at most 10% above the first quarter's
(checked when the machine itself held steady between the two: see OTHER_LOAD_LIMIT).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("redis")
from load_helpers import (  # noqa: E402
    BLOCK_BYTES, PREFIX_TOKENS, PROMPT_TOKENS, VOCAB, Answer, assert_clean_exit, cap_redis, complete,
    redis_stats, start_server, tiny_model, wait_idle_and_nothing_held,
)
from services import RedisServer, unavailable  # noqa: E402

pytestmark = pytest.mark.slow  # ~95 s (2-core CPU)
_ = tiny_model  # a fixture: imported so that pytest finds it here

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
