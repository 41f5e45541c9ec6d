"""tierkv/tiers/redis.py on a real 3-node Redis Cluster (redis+cluster:// URLs): routing by hash
tag, a node killed and restarted, two processes sharing the cluster, URL checks and passwords."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from services import block_chain, empty_like_blocks, get_and_check

from tierkv.config import CacheConfig
from tierkv.errors import ConfigError
from tierkv.layout import KVLayout
from tierkv.tiers import redis as redis_tier
from tierkv.tiers.codec import key_hex
from tierkv.tiers.open import open_store
from tierkv.tiers.redis import slot_tag

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)  # 16 KiB
TESTS = Path(__file__).parent


def _key(h: int) -> str:
    return f"tierkv:{{{slot_tag(h)}}}"


def _check(store, ids, pays) -> list[bool]:
    return get_and_check(store, LAYOUT, ids, pays)  # asserts every hit is byte-identical


@pytest.mark.parametrize(
    "url, message",
    [
        ("redis+cluster://", "needs host:port of one or more cluster nodes"),
        ("redis+cluster://127.0.0.1:7000,,127.0.0.1:7001/", "needs host:port of one or more cluster nodes"),
        ("redis+cluster://127.0.0.1:7000,127.0.0.1:port/", "node '127.0.0.1:port' has a port that is not a number"),
        ("redis+cluster://127.0.0.1:70000/", "has a port that is not a number from 1 to 65535"),
        ("redis+cluster://:pw-in-url@127.0.0.1:7000/2", "has only database 0"),
        ("redis+clusters://127.0.0.1:7000/", "accepted schemes"),
    ],
)
def test_bad_cluster_urls_are_config_errors(url, message):
    with pytest.raises(ConfigError, match=message) as err:
        CacheConfig(l3=[url])
    assert "pw-in-url" not in str(err.value)
    with pytest.raises(ConfigError, match=message):
        open_store(url, LAYOUT)


def test_good_cluster_urls_pass_through():
    urls = ["redis+cluster://127.0.0.1:7000,127.0.0.1:7001/", "rediss+cluster://:pw@[::1]:7000,cache-2/?ttl=60",
            "redis+cluster://10.0.0.1:7000/0?timeout=0.5&prefix=kv"]
    assert CacheConfig(l3=urls).l3 == urls


def test_cluster_down_at_open_is_a_miss_not_an_exception():
    ids, pays = block_chain(LAYOUT, 2)
    t0 = time.monotonic()
    s = open_store("redis+cluster://127.0.0.1:1,127.0.0.1:2/?timeout=0.2", LAYOUT)
    assert s.contains_many([ids[0].hash]) == [False]
    assert s.put_many(ids, pays) == [False, False]
    assert s.get_many(ids, empty_like_blocks(LAYOUT, 2)) == [False, False]
    errors = s.stats()["errors"]
    assert errors["io"] >= 1 and errors["io"] + errors["unavailable"] >= 3
    assert time.monotonic() - t0 < 3
    s.close()


def test_roundtrip_spreads_blocks_over_the_nodes_by_hash_tag(redis_cluster):
    ids, pays = block_chain(LAYOUT, 24)
    s = open_store(redis_cluster.url + "?ttl=100", LAYOUT)
    assert s.contains_many([b.hash for b in ids]) == [False] * 24
    assert s.put_many(ids, pays) == [True] * 24
    assert s.contains_many([b.hash for b in ids] + [12345]) == [True] * 24 + [False]
    assert _check(s, ids, pays) == [True] * 24
    # Each key sits on the node that serves its tag's slot, and every node got some.
    per_node = {node.port: 0 for node in redis_cluster.nodes}
    for b in ids:
        node = redis_cluster.node_of(_key(b.hash))
        assert node.client().exists(_key(b.hash)) == 1
        assert 90 <= node.client().ttl(_key(b.hash)) <= 100
        per_node[node.port] += 1
    assert sum(per_node.values()) == 24 and min(per_node.values()) > 0
    assert [n.client().dbsize() for n in redis_cluster.nodes] == list(per_node.values())
    # A damaged object is a counted miss and is deleted from its node; the others still hit.
    c = redis_cluster.node_of(_key(ids[3].hash)).client()
    value = bytearray(c.get(_key(ids[3].hash)))
    value[-1] ^= 1
    c.set(_key(ids[3].hash), bytes(value))
    assert _check(s, ids, pays) == [i != 3 for i in range(24)]
    assert s.stats()["errors"]["checksum"] == 1 and not c.exists(_key(ids[3].hash))
    assert s.stats()["errors"]["io"] == 0
    s.close()


def test_a_nodes_blocks_split_over_several_pipelines(redis_cluster, monkeypatch):
    ids, pays = block_chain(LAYOUT, 24, seed=3)
    s = open_store(redis_cluster.url, LAYOUT)
    monkeypatch.setattr(redis_tier, "_CHUNK_BYTES", 2 * s.object_size)  # ~8 blocks a node: 4 pipelines each
    assert s.put_many(ids, pays) == [True] * 24
    assert s.contains_many([b.hash for b in ids]) == [True] * 24
    assert _check(s, ids, pays) == [True] * 24
    assert s.stats()["errors"]["io"] == 0
    s.close()


def test_password_is_used_and_never_shown(redis_cluster, caplog):
    for node in redis_cluster.nodes:  # clients only: the cluster bus does not use requirepass
        node.client().config_set("requirepass", "clu5ter-pw")
    url = redis_cluster.url.replace("redis+cluster://", "redis+cluster://:clu5ter-pw@")
    ids, pays = block_chain(LAYOUT, 6)
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        s = open_store(url, LAYOUT)
        assert s.put_many(ids, pays) == [True] * 6
        assert _check(s, ids, pays) == [True] * 6
        wrong = open_store(redis_cluster.url + "?timeout=0.5", LAYOUT)  # no password: refused, counted misses
        assert wrong.contains_many([b.hash for b in ids]) == [False] * 6
        assert wrong.stats()["errors"]["io"] >= 1
    assert "clu5ter-pw" not in repr(s) + str(s.stats()) + caplog.text
    s.close()
    wrong.close()


def _move_slot(slot: int, src, dst, nodes) -> None:
    """Migrate one hash slot and its keys from node `src` to node `dst`, as resharding does."""
    src_id = src.client().execute_command("CLUSTER", "MYID").decode()
    dst_id = dst.client().execute_command("CLUSTER", "MYID").decode()
    dst.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    keys = src.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    src.client().execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
    for node in nodes:
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def test_a_resharded_slot_is_a_miss_then_found_on_its_new_node(redis_cluster):
    ids, pays = block_chain(LAYOUT, 8)
    s = open_store(redis_cluster.url, LAYOUT)
    assert s.put_many(ids, pays) == [True] * 8
    src = redis_cluster.node_of(_key(ids[0].hash))
    dst = next(node for node in redis_cluster.nodes if node is not src)
    slot = src.client().execute_command("CLUSTER", "KEYSLOT", _key(ids[0].hash))
    _move_slot(slot, src, dst, redis_cluster.nodes)
    assert redis_cluster.node_of(_key(ids[0].hash)) is dst and dst.client().exists(_key(ids[0].hash))
    # The store's slot map is stale: MOVED is a counted miss (never a redirect followed blindly)...
    assert s.contains_many([ids[0].hash]) == [False] and s.stats()["errors"]["io"] == 1
    # ...and makes it reload the map, after which the block is found where it now lives.
    assert s.contains_many([b.hash for b in ids]) == [True] * 8
    assert _check(s, ids, pays) == [True] * 8
    s.close()


def test_node_killed_then_restarted_misses_and_recovers(redis_cluster):
    ids, pays = block_chain(LAYOUT, 24)
    s = open_store(redis_cluster.url + "?timeout=0.5", LAYOUT)
    assert s.put_many(ids, pays) == [True] * 24
    victim = redis_cluster.node_of(_key(ids[0].hash))
    on_victim = [redis_cluster.node_of(_key(b.hash)) is victim for b in ids]
    elsewhere = [not v for v in on_victim]
    assert any(elsewhere)

    victim.kill()
    t0 = time.monotonic()
    # The other nodes keep answering: their blocks hit (byte-checked), the dead node's miss.
    assert s.contains_many([b.hash for b in ids]) == elsewhere
    assert _check(s, ids, pays) == elsewhere
    new_ids, new_pays = block_chain(LAYOUT, 12, seed=7)
    new_elsewhere = [redis_cluster.node_of(_key(b.hash)) is not victim for b in new_ids]
    assert s.put_many(new_ids, new_pays) == new_elsewhere
    assert time.monotonic() - t0 < 3  # refused connections, no waiting on timeouts
    errors = s.stats()["errors"]
    assert errors["io"] >= 1 and errors["io"] + errors["unavailable"] >= 3

    assert victim.start() and redis_cluster.wait_ok()
    # The node came back empty (no persistence): its blocks miss, never return other bytes.
    assert _check(s, ids, pays) == elsewhere
    end = time.monotonic() + 15
    while not all(s.put_many(ids, pays)) and time.monotonic() < end:
        time.sleep(0.2)
    assert _check(s, ids, pays) == [True] * 24
    assert victim.client().dbsize() == sum(on_victim)
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
    assert all(s.put_many(ids, pays)), s.stats()
    """
)


def test_blocks_written_by_one_process_are_read_by_another(redis_cluster):
    first, last = redis_cluster.nodes[0], redis_cluster.nodes[-1]
    # Each process names a different single seed: the rest of the cluster is discovered.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", _WRITER, f"redis+cluster://127.0.0.1:{first.port}/"],
                   env=env, check=True, timeout=120)
    ids, pays = block_chain(LAYOUT, 16, seed=11)
    s = open_store(f"redis+cluster://127.0.0.1:{last.port}/", LAYOUT)
    assert s.contains_many([b.hash for b in ids]) == [True] * 16
    assert _check(s, ids, pays) == [True] * 16
    assert sum(n.client().dbsize() for n in redis_cluster.nodes) == 16
    assert key_hex(ids[0].hash) in _key(ids[0].hash)
    s.close()
