"""tierkv/tiers/redis.py against a real redis-server: sharing, TTL, limits, and faults (kill, pause)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from services import block_chain, get_and_check, empty_like_blocks

from tierkv.layout import KVLayout
from tierkv.tiers import redis as redis_tier
from tierkv.tiers.codec import key_hex
from tierkv.tiers.open import open_store

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)  # 16 KiB
TESTS = Path(__file__).parent


def _check(store, ids, pays, layout=LAYOUT) -> list[bool]:
    return get_and_check(store, layout, ids, pays)


def _wait_for_hits(store, ids, pays, timeout=10.0) -> list[bool]:
    end = time.monotonic() + timeout
    while True:
        ok = _check(store, ids, pays)
        if all(ok) or time.monotonic() > end:
            return ok
        time.sleep(0.1)


def test_roundtrip_lookup_and_ttl(redis_server):
    ids, pays = block_chain(LAYOUT, 10)
    s = open_store(redis_server.url + "?ttl=100", LAYOUT)
    assert s.contains_many([b.hash for b in ids]) == [False] * 10
    assert s.put_many(ids, pays) == [True] * 10
    assert s.contains_many([b.hash for b in ids] + [99]) == [True] * 10 + [False]
    assert _check(s, ids, pays) == [True] * 10
    ttl = redis_server.client().ttl(f"tierkv:{key_hex(ids[0].hash)}")
    assert 90 <= ttl <= 100
    assert s.stats()["hits"] == 10 and s.stats()["errors"]["io"] == 0
    s.close()


def test_password_is_used_and_never_shown(redis_server, caplog):
    redis_server.client().config_set("requirepass", "s3cr3t-pw")
    ids, pays = block_chain(LAYOUT, 2)
    url = redis_server.url.replace("redis://", "redis://:s3cr3t-pw@")
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        s = open_store(url, LAYOUT)
        assert s.put_many(ids, pays) == [True, True]
        assert _check(s, ids, pays) == [True, True]
        wrong = open_store(redis_server.url, LAYOUT)  # no password: refused, a counted miss
        assert wrong.contains_many([ids[0].hash]) == [False] and wrong.stats()["errors"]["io"] == 1
    assert "s3cr3t-pw" not in repr(s) + str(s.stats()) + caplog.text
    s.close()
    wrong.close()


def test_corrupt_value_is_a_counted_miss_and_deleted(redis_server):
    ids, pays = block_chain(LAYOUT, 2)
    s = open_store(redis_server.url, LAYOUT)
    s.put_many(ids, pays)
    c = redis_server.client()
    key = f"tierkv:{key_hex(ids[0].hash)}"
    value = bytearray(c.get(key))
    value[-1] ^= 1
    c.set(key, bytes(value))
    assert _check(s, ids, pays) == [False, True]
    assert s.stats()["errors"]["checksum"] == 1 and not c.exists(key)
    s.close()


@pytest.mark.parametrize("blocks_per_pipeline", [0, 3])
def test_batches_split_over_several_pipelines(redis_server, monkeypatch, blocks_per_pipeline):
    """Pipelines of 3 blocks, or of 1 (a block above _CHUNK_BYTES goes alone), run on the pool's
    connections in parallel; a damaged block in one of them is a miss, the others still hit."""
    s = open_store(redis_server.url, LAYOUT)
    monkeypatch.setattr(redis_tier, "_CHUNK_BYTES", blocks_per_pipeline * s.object_size)
    ids, pays = block_chain(LAYOUT, 10)
    assert s.put_many(ids, pays) == [True] * 10
    assert s.contains_many([b.hash for b in ids]) == [True] * 10
    c = redis_server.client()
    key = f"tierkv:{key_hex(ids[4].hash)}"
    value = bytearray(c.get(key))
    value[-1] ^= 1
    c.set(key, bytes(value))
    assert _check(s, ids, pays) == [i != 4 for i in range(10)]
    assert s.stats()["errors"]["checksum"] == 1 and s.stats()["errors"]["io"] == 0
    s.close()


def test_blocks_above_the_servers_bulk_limit_are_refused_cleanly(redis_server):
    big = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)  # 1 MiB + header
    redis_server.client().config_set("proto-max-bulk-len", "1mb")
    ids, pays = block_chain(big, 2)
    s = open_store(redis_server.url, big)
    assert s.put_many(ids, pays) == [False, False]
    assert s.stats()["errors"]["too_large"] == 2 and redis_server.client().dbsize() == 0
    s.close()


def test_different_namespaces_never_share_blocks(redis_server):
    ids_a, pays_a = block_chain(LAYOUT, 3, seed=5, salt="tenant-a")
    ids_b, _ = block_chain(LAYOUT, 3, seed=5, salt="tenant-b")  # same tokens, other salt
    s = open_store(redis_server.url, LAYOUT)
    s.put_many(ids_a, pays_a)
    assert s.contains_many([b.hash for b in ids_b]) == [False] * 3
    s.close()


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from services import block_chain
    from tierkv.layout import KVLayout
    from tierkv.tiers.open import open_store
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)
    ids, pays = block_chain(layout, 16, seed=11)
    s = open_store(sys.argv[1], layout)
    assert all(s.put_many(ids, pays))
    """
)


def run_writer(url: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", _WRITER, url], env=env, check=True, timeout=120)


def test_blocks_stored_by_one_process_are_hits_for_another(redis_server):
    run_writer(redis_server.url)
    ids, pays = block_chain(LAYOUT, 16, seed=11)
    s = open_store(redis_server.url, LAYOUT)
    assert s.contains_many([b.hash for b in ids]) == [True] * 16
    assert _check(s, ids, pays) == [True] * 16
    s.close()


def _store_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("tierkv.tiers") and r.levelno >= logging.WARNING]


def test_redis_killed_mid_run_then_restarted(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="tierkv")
    ids, pays = block_chain(LAYOUT, 8)
    s = open_store(redis_server.url + "?timeout=0.5", LAYOUT)
    assert s.put_many(ids[:4], pays[:4]) == [True] * 4
    assert s.stats()["healthy"] and s.stats()["degraded"] == []
    redis_server.kill()
    assert s.contains_many([b.hash for b in ids]) == [False] * 8
    assert _check(s, ids, pays) == [False] * 8
    assert s.put_many(ids[4:], pays[4:]) == [False] * 4
    st = s.stats()["errors"]
    assert st["io"] + st["unavailable"] >= 3 and st["io"] >= 1
    node = f"node 127.0.0.1:{redis_server.port}"
    [why] = s.stats()["degraded"]
    assert not s.stats()["healthy"] and why.startswith(f"{node} does not answer (ConnectionError"), why
    end = time.monotonic() + 1.5  # calls all along the outage, past the breaker's waits: one line said it went
    while time.monotonic() < end:
        s.contains_many([b.hash for b in ids])
        s.put_many(ids[4:], pays[4:])
        time.sleep(0.05)
    [gone] = _store_warnings(caplog)
    assert f"{redis_server.url}: {node} does not answer" in gone and "degraded" in gone, gone
    assert redis_server.start()
    # The restarted server is empty (no persistence): misses until blocks are stored again.
    end = time.monotonic() + 10
    while not all(s.put_many(ids, pays)) and time.monotonic() < end:
        time.sleep(0.1)
    assert _wait_for_hits(s, ids, pays) == [True] * 8
    assert s.stats()["healthy"] and s.stats()["degraded"] == []
    gone, back = _store_warnings(caplog)  # and one line that it came back
    assert f"{redis_server.url}: answers again" in back, back
    s.close()


def test_a_request_that_times_out_is_a_miss_then_service_resumes(redis_server):
    ids, pays = block_chain(LAYOUT, 4)
    s = open_store(redis_server.url + "?timeout=0.3", LAYOUT)
    s.put_many(ids, pays)
    pauser = threading.Thread(target=lambda: redis_server.client().execute_command("CLIENT", "PAUSE", "1500", "ALL"))
    pauser.start()
    pauser.join()
    t0 = time.monotonic()
    assert _check(s, ids, pays) == [False] * 4
    assert time.monotonic() - t0 < 1.2  # bounded by the store's timeout, not by the pause
    assert s.stats()["errors"]["timeout"] >= 1
    time.sleep(1.5)
    assert _wait_for_hits(s, ids, pays) == [True] * 4
    s.close()


def test_dead_redis_at_open_is_a_miss_not_an_exception():
    ids, pays = block_chain(LAYOUT, 2)
    s = open_store("redis://127.0.0.1:1/0?timeout=0.2", LAYOUT)
    assert s.contains_many([ids[0].hash]) == [False]
    assert s.put_many(ids, pays) == [False, False]
    assert s.get_many(ids, empty_like_blocks(LAYOUT, 2)) == [False, False]
    s.close()
