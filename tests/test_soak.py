"""Soak under load: a real tierkv-serve process, a real redis-server as L3, httpx clients.

Closed-loop clients send a steady mix (shared prefixes that hit L1/L2/L3, unique prompts that
miss, streaming and not) for a warm-up and two measured windows. Then a fresh server starts
beside the soaked one, on the same Redis, and gets clients of its own sending the same mix;
after its warm-up both are measured over the same window, in which the soaked server's median
latency may be at most 10% above the fresh one's. All along, every answer must be complete, the
soaked server's RSS and open files must not grow and no KV block may stay held once idle.
A soak looks for a server that slows down as it ages; measuring the aged one beside a new one,
rather than against its own first minute, leaves the machine's drift out (see FRESH_CONTROL).
"""

from __future__ import annotations

import asyncio
import random
import statistics
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

SOAK_CLIENTS = 4  # per server
SOAK_WARMUP_S = 12.0  # first requests, allocator growth, Redis filling up: not measured
SOAK_WINDOW_S = 18.0  # a measured window: ~500-900 requests on a 2-core CPU
# windows of the soaked server alone; then one beside the fresh server. By then the soaked server
# has run ~70 s (two windows, the fresh one's start and warm-up), the fresh one 12 s: the ages of
# the first and last quarters that the check compared before (see FRESH_CONTROL)
SOAK_WINDOWS = 2
SOAK_PREFIXES = 16  # 64 blocks: L1 and L2 together hold 64, unique prompts push them down to L3
SOAK_L1, SOAK_L2 = 32 * BLOCK_BYTES, 32 * BLOCK_BYTES  # 4 clients need 24 L1 blocks at most
# Write-through sends every new block to Redis (~2.5 MB/s here): a small LRU Redis is full within
# the warm-up, so the measured window sees one steady regime (evicting as it stores) throughout,
# rather than a store that changes behaviour the moment it fills.
SOAK_REDIS_BYTES = 8 << 20
P50_BOUND = 0.10  # the bound: the soaked server's median latency at most 10% above a fresh one's
# FRESH_CONTROL. Comparing a server's last quarter with its own first one measures the machine as
# much as the server on a shared VM: on the 2-core dev box the CPU time of a fixed piece of Python
# moved between 2.1 and 4.3 ms from one window to the next, and the server's p50 followed it (69
# to 121 ms); in CI, with that probe steady to 4%, the p50 went 85, 101, 100, 94 ms by quarter.
# Two servers running the same load in the same seconds see the same machine, so the ratio of
# their medians is the server's age alone.
# RSS growth allowed from the end of the first window to the end. Without a leak the server's RSS
# moves by less than 1 MiB there (allocator and interpreter noise: 0.1-0.5 MiB in every run so
# far, 1,600-2,400 requests from there to the end). 8 MiB is far above that noise and still
# catches a leak of ~5 KiB a request: less than one KV block (8 KiB here), or one request's
# prompt, outputs and bookkeeping objects left behind.
RSS_GROWTH_BOUND = 8 << 20
FD_GROWTH_BOUND = 8  # open files: sockets to Redis and clients come and go; a leak grows without end


def proc_status(pid: int) -> tuple[int, int]:
    """(VmRSS in bytes, open file descriptors) of a process, from /proc."""
    rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


KINDS = [(hit, stream) for hit in (True, False) for stream in (True, False)]


def soak_request(i: int, rng: random.Random, prefixes: list[list[int]]) -> tuple[list[int], bool]:
    """The i-th request of a client: the four kinds (a shared prefix that hits or a unique prompt
    that misses, streamed or not) in turn, so every window holds the same mix."""
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


def windows_p50(answers: list[Answer], starts: list[float]) -> tuple[list[list[Answer]], list[float]]:
    """The answers whose request started in each window [start, start + SOAK_WINDOW_S), and each
    window's median latency (warm-up requests and those between windows are in none)."""
    windows: list[list[Answer]] = [[a for a in answers if s <= a.start < s + SOAK_WINDOW_S] for s in starts]
    return windows, [statistics.median(a.latency for a in w) if w else float("nan") for w in windows]


@pytest.fixture(scope="module")
def soak(tiny_model, soak_redis, tmp_path_factory) -> dict:
    """One soak run: the soaked server's answers by window, the fresh server's in the last window,
    the soaked server's RSS and open files, both servers' stats once idle and their exit codes.
    The tests below judge it."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads RSS and open files from Linux's /proc")
    redis_server, tmp_path = soak_redis, tmp_path_factory.mktemp("soak")
    cap_redis(redis_server, SOAK_REDIS_BYTES)
    soaked = start_server(tiny_model, tmp_path / "soaked.log", SOAK_L1, SOAK_L2, redis_server.url)
    out: dict = {"servers": [soaked]}
    try:
        rng = random.Random(0)
        prefixes = [[rng.randrange(VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(SOAK_PREFIXES)]
        answers: dict[str, list[Answer]] = {"soaked": [], "fresh": []}
        status: dict[str, tuple[int, int]] = {}
        measure_from = time.monotonic() + SOAK_WARMUP_S
        starts = [measure_from + q * SOAK_WINDOW_S for q in range(SOAK_WINDOWS)]
        stop_at = [float("inf")]  # known once the fresh server is up

        async def client(c: httpx.AsyncClient, url: str, name: str, seed: int, n: int) -> None:
            r = random.Random(seed)  # n: clients start at different kinds
            while time.monotonic() < stop_at[0]:
                prompt, stream = soak_request(n, r, prefixes)
                answers[name].append(await complete(c, url, n, prompt, stream))
                n += 1

        async def run() -> None:
            limits = httpx.Limits(max_connections=4 * SOAK_CLIENTS)
            async with httpx.AsyncClient(timeout=60, limits=limits) as c:
                tasks = [asyncio.create_task(client(c, soaked.url, "soaked", 1000 + i, i)) for i in range(SOAK_CLIENTS)]
                await asyncio.sleep(starts[0] + SOAK_WINDOW_S - time.monotonic())
                status["first"] = proc_status(soaked.proc.pid)
                await asyncio.sleep(starts[-1] + SOAK_WINDOW_S - time.monotonic())
                # the fresh server loads its model while the soaked one keeps serving
                fresh = await asyncio.to_thread(start_server, tiny_model, tmp_path / "fresh.log", SOAK_L1, SOAK_L2,
                                                redis_server.url)
                out["servers"].append(fresh)
                starts.append(time.monotonic() + SOAK_WARMUP_S)
                stop_at[0] = starts[-1] + SOAK_WINDOW_S
                tasks += [asyncio.create_task(client(c, fresh.url, "fresh", 2000 + i, i)) for i in range(SOAK_CLIENTS)]
                await asyncio.gather(*tasks)
            status["end"] = proc_status(soaked.proc.pid)

        asyncio.run(run())
        windows, p50 = windows_p50(answers["soaked"], starts)
        (fresh_window,), (fresh_p50,) = windows_p50(answers["fresh"], starts[-1:])
        (rss_first, fds_first), (rss_end, fds_end) = status["first"], status["end"]
        report = (f"soaked server: {len(answers['soaked'])} answers; by window: requests {[len(w) for w in windows]}, "
                  f"p50 {[f'{x * 1e3:.1f} ms' for x in p50]}; fresh server beside it in the last window: "
                  f"{len(fresh_window)} requests, p50 {fresh_p50 * 1e3:.1f} ms; "
                  f"soaked server's RSS {rss_first / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB, "
                  f"fds {fds_first} -> {fds_end}")
        print("soak:", report)
        out.update(answers=answers["soaked"] + answers["fresh"], windows=windows + [fresh_window], p50=p50,
                   fresh_p50=fresh_p50, report=report, rss=(rss_first, rss_end), fds=(fds_first, fds_end),
                   idle=[wait_idle_and_nothing_held(srv) for srv in out["servers"]])
    finally:
        out["codes"] = [srv.stop() for srv in out["servers"]]
    return out


def test_soak_every_answer_complete_no_leak_nothing_held(soak):
    bad = [a for a in soak["answers"] if a.error]
    assert not bad, f"{len(bad)} of {len(soak['answers'])} answers incomplete: {[a.error for a in bad[:5]]}"
    report = soak["report"]
    assert min(len(w) for w in soak["windows"]) >= 100, report  # enough requests for a median to mean something
    assert soak["rss"][1] - soak["rss"][0] <= RSS_GROWTH_BOUND, report
    assert soak["fds"][1] - soak["fds"][0] <= FD_GROWTH_BOUND, report
    for s in soak["idle"]:  # wait_idle_and_nothing_held asserted that no block stayed held
        l3 = redis_stats(s)
        # the load really went through every tier: L2 and L3 hits, and no L3 error
        assert s["tiers"]["l2"]["hit_tokens"] > 0 and s["tiers"]["l3"]["hit_tokens"] > 0, s
        assert l3["hits"] > 0 and l3["puts"] > 0 and not any(l3["errors"].values()), l3
    for srv, code in zip(soak["servers"], soak["codes"]):
        assert_clean_exit(srv, code)


def test_soak_an_aged_server_answers_as_fast_as_a_fresh_one_beside_it(soak):
    assert soak["p50"][-1] <= (1 + P50_BOUND) * soak["fresh_p50"], soak["report"]
