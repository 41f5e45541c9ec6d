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
