"""Faults under load: one fixed workload against two real tierkv-serve processes over a real Redis
L3, one whose Redis is SIGKILLed mid-run and restarted; every answer must come, with the
fault-free run's tokens, and the server must keep answering.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("redis")
from load_helpers import (  # noqa: E402
    BLOCK_BYTES, PREFIX_TOKENS, PROMPT_TOKENS, VOCAB, Answer, assert_clean_exit, complete, redis_stats,
    start_server, tiny_model, wait_idle_and_nothing_held,
)
from server_helpers import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow  # ~30-45 s for the two runs (2-core CPU)
_ = tiny_model  # a fixture: imported so that pytest finds it here

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
        health: list[tuple[int, dict]] = []
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
                h = await c.get(srv.url + "/health")
                health.append((h.status_code, h.json()))
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
    assert health and all(code == 200 for code, _ in health), health
    # /health names the store while it is down (once a call has failed), and the log says it went
    # and came back, once each, whatever the number of failed calls in between
    store = redis_server.url
    named = [body["degraded"] for _, body in health if body["status"] == "degraded"]
    assert named, health
    for [entry] in named:  # refused, or reset by the dying server: ConnectionError either way
        [problem] = entry["problems"]
        assert entry["tier"] == "l3" and entry["store"] == store, entry
        assert problem.startswith(f"node 127.0.0.1:{redis_server.port} does not answer (ConnectionError: "), entry
    lines = [line for line in srv.log_path.read_text().splitlines() if f"redis L3 {store}" in line]
    assert len(lines) == 2 and "does not answer" in lines[0] and "answers again" in lines[1], lines


# ---------------------------------------------------------------------------- S3 frozen mid-run

BEFORE_S, FROZEN_S = 4.0, 4.0  # the workload runs this long before the freeze, then this long frozen
RECOVER_S = 30.0  # at most this long after the thaw for the store to be healthy and read again


def healthy_gauge(text: str) -> list[str]:
    """The tierkv_tier_healthy samples of a /metrics text, as lines."""
    return [line for line in text.splitlines() if line.startswith("tierkv_tier_healthy{")]


def test_a_frozen_s3_stalls_no_request_and_health_names_it(tiny_model, seaweed_private, tmp_path):
    """SIGSTOP on SeaweedFS under load, with S3's default timeouts: its lookups ran on the engine's
    thread and one took up to ~30 s, so every request stalled. Now requests keep completing at the
    pace they had before, /health (still 200) and tierkv_tier_healthy name the store, /v1/cache/stats
    answers, and once thawed the store is healthy and read again. One log line each way."""
    sw = seaweed_private
    store = "s3://frozen/kv"
    srv = start_server(tiny_model, tmp_path / "s3.log", FAULT_L1, FAULT_L2, sw.url("frozen"))
    answers: list[Answer] = []
    marks: dict[str, float] = {}
    polls: list[tuple[float, int, dict, float, list[str]]] = []  # (time, /health status, body, stats s, gauge)
    after: dict[str, dict] = {}
    stop = asyncio.Event()

    async def client(c: httpx.AsyncClient, mine) -> None:
        i = 0
        while not stop.is_set():
            key, prompt, stream = mine[i % len(mine)]
            answers.append(await complete(c, srv.url, key, prompt, stream))
            i += 1

    async def l3_hits(c: httpx.AsyncClient) -> int:
        (st,) = (await c.get(srv.url + "/v1/cache/stats")).json()["l3_stores"]
        return st["hits"]

    async def fault(c: httpx.AsyncClient) -> None:
        marks["start"] = time.monotonic()
        await asyncio.sleep(BEFORE_S)
        after["before"] = (await c.get(srv.url + "/v1/cache/stats")).json()
        sw.freeze()
        marks["freeze"] = time.monotonic()
        while time.monotonic() < marks["freeze"] + FROZEN_S:
            t0 = time.monotonic()
            h = await c.get(srv.url + "/health")
            t1 = time.monotonic()
            assert (await c.get(srv.url + "/v1/cache/stats")).status_code == 200
            t2 = time.monotonic()
            gauge = healthy_gauge((await c.get(srv.url + "/metrics")).text)
            polls.append((t0 - marks["freeze"], h.status_code, h.json(), t2 - t1, gauge))
            await asyncio.sleep(0.2)
        sw.thaw()
        marks["thaw"] = time.monotonic()
        hits = await l3_hits(c)
        while time.monotonic() < marks["thaw"] + RECOVER_S:
            if (await c.get(srv.url + "/health")).json() == {"status": "ok"} and await l3_hits(c) > hits:
                break
            await asyncio.sleep(0.2)
        marks["recovered"] = time.monotonic()
        after["health"] = (await c.get(srv.url + "/health")).json()
        after["gauge"] = healthy_gauge((await c.get(srv.url + "/metrics")).text)
        after["hits"] = {"thaw": hits, "end": await l3_hits(c)}
        stop.set()

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(fault(c), *(client(c, mine) for mine in fault_plan()))

    try:
        asyncio.run(run())
        s = wait_idle_and_nothing_held(srv)
    finally:
        sw.thaw()
        code = srv.stop()
    assert_clean_exit(srv, code)
    assert_all_answered(answers, len(answers))

    def window(a: float, b: float) -> list[Answer]:
        return [x for x in answers if a <= x.start and x.end <= b]

    before = window(marks["start"] + 1.0, marks["freeze"])  # the first second warms the model up
    frozen = window(marks["freeze"], marks["thaw"])
    before_rate = len(before) / (marks["freeze"] - marks["start"] - 1.0)
    frozen_rate = len(frozen) / (marks["thaw"] - marks["freeze"])
    slowest = max(a.latency for a in before)
    median = sorted(a.latency for a in before)[len(before) // 2]
    frozen_median = sorted(a.latency for a in frozen)[len(frozen) // 2] if frozen else float("inf")
    stats_s = max(p[3] for p in polls)
    print(f"frozen S3: before {len(before)} answers ({before_rate:.1f}/s, median {median * 1e3:.0f} ms, slowest "
          f"{slowest * 1e3:.0f} ms); frozen {FROZEN_S:.0f} s: {len(frozen)} answers ({frozen_rate:.1f}/s, median "
          f"{frozen_median * 1e3:.0f} ms, slowest {max((a.latency for a in frozen), default=0) * 1e3:.0f} ms), "
          f"/v1/cache/stats at most {stats_s * 1e3:.0f} ms; healthy and read again "
          f"{marks['recovered'] - marks['thaw']:.1f} s after the thaw; L3 hits {after['hits']}")
    # requests kept their pace: the engine never waited on the hung store but once, for one lookup
    assert frozen_rate >= 0.5 * before_rate and frozen_median <= 2 * median, (before_rate, frozen_rate)
    assert stats_s <= slowest + 0.5, stats_s  # at most one lookup_timeout (0.5 s) behind the engine
    # /health stays 200 and names the store (from the first lookup that timed out on), as the gauge does
    assert all(status == 200 for _, status, _, _, _ in polls), polls
    named = [p for p in polls if p[2]["status"] == "degraded"]
    assert named and named[-1] is polls[-1], polls
    for _, _, body, _, gauge in named:
        [entry] = body["degraded"]
        assert entry["tier"] == "l3" and entry["store"] == store and entry["problems"], body
        assert gauge == [f'tierkv_tier_healthy{{store="{store}",tier="l3"}} 0.0'], gauge
    # and once it answers, it is healthy and read again
    assert after["health"] == {"status": "ok"}, after
    assert after["gauge"] == [f'tierkv_tier_healthy{{store="{store}",tier="l3"}} 1.0'], after
    assert after["hits"]["end"] > after["hits"]["thaw"], after
    (st,) = s["l3_stores"]
    assert st["healthy"] and st["hits"] > 0, st
    lines = [line for line in srv.log_path.read_text().splitlines() if f"s3 L3 {store}" in line]
    assert len(lines) == 2 and "degraded" in lines[0] and "answers again" in lines[1], lines
