"""tierkv/tiers/s3.py against a real SeaweedFS: chunk objects, sharing a bucket, damage, and faults (stopped, frozen)."""

from __future__ import annotations

import logging
import time

import boto3
import torch
from services import S3_SECRET, block_chain, get_and_check, empty_like_blocks
from test_redis_tier import run_writer

from tierkv.layout import KVLayout
from tierkv.tiers.codec import key_hex, payload_offset
from tierkv.tiers.open import open_store

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)  # 16 KiB


def _check(store, ids, pays) -> list[bool]:
    return get_and_check(store, LAYOUT, ids, pays)


def _wait_for_hits(store, ids, pays, timeout=20.0) -> list[bool]:
    end = time.monotonic() + timeout
    while True:
        ok = _check(store, ids, pays)
        if all(ok) or time.monotonic() > end:
            return ok
        time.sleep(0.2)


def test_roundtrip_lookup_and_no_secret_in_logs(seaweed, caplog):
    ids, pays = block_chain(LAYOUT, 10)
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        s = open_store(seaweed.url("roundtrip"), LAYOUT)
        assert s.contains_many([b.hash for b in ids]) == [False] * 10
        assert s.put_many(ids, pays) == [True] * 10
        assert s.contains_many([b.hash for b in ids] + [99]) == [True] * 10 + [False]
        assert _check(s, ids, pays) == [True] * 10
    assert s.stats()["hits"] == 10 and sum(s.stats()["errors"].values()) == 0
    assert S3_SECRET not in repr(s) + str(s.stats()) + caplog.text
    s.close()


def test_corrupt_object_is_a_counted_miss_and_deleted(seaweed):
    ids, pays = block_chain(LAYOUT, 2)
    s = open_store(seaweed.url("corrupt", chunk="16"), LAYOUT)  # one block per object
    s.put_many(ids, pays)
    raw = boto3.client("s3", endpoint_url=seaweed.endpoint, region_name="us-east-1")
    key = f"kv/{key_hex(ids[0].hash)}.c1"
    raw.put_object(Bucket="corrupt", Key=key, Body=b"\x00" * 100)
    assert _check(s, ids, pays) == [False, True]
    assert s.stats()["errors"]["garbage"] == 1
    assert raw.list_objects_v2(Bucket="corrupt", Prefix=key)["KeyCount"] == 0
    s.close()


def test_chunks_partial_then_longer_write_and_a_damaged_block(seaweed):
    ids, pays = block_chain(LAYOUT, 12)
    s = open_store(seaweed.url("chunks", chunk="64"), LAYOUT)  # 4 blocks a chunk
    assert s.put_many(ids[:6], pays[:6]) == [True] * 6
    assert s.contains_many([b.hash for b in ids[:8]]) == [True] * 6 + [False] * 2
    assert s.put_many(ids[6:10], pays[6:10]) == [True] * 4  # completes the partial chunk 4..7
    raw = boto3.client("s3", endpoint_url=seaweed.endpoint, region_name="us-east-1")
    keys = sorted(o["Key"] for o in raw.list_objects_v2(Bucket="chunks", Prefix="kv/")["Contents"])
    assert keys == sorted(f"kv/{key_hex(ids[i].hash)}.c4" for i in (3, 7, 9))
    assert s.contains_many([b.hash for b in ids]) == [True] * 10 + [False] * 2
    assert _check(s, ids, pays) == [True] * 10 + [False] * 2
    # a flipped byte in block 6 (record 2 of chunk 4..7): blocks 4, 5 still hit, 6 and 7 miss
    key = f"kv/{key_hex(ids[7].hash)}.c4"
    body = bytearray(raw.get_object(Bucket="chunks", Key=key)["Body"].read())
    body[2 * s.record_size + payload_offset(LAYOUT) + 7] ^= 0x40
    raw.put_object(Bucket="chunks", Key=key, Body=bytes(body))
    fresh = open_store(seaweed.url("chunks", chunk="64"), LAYOUT)
    assert _check(fresh, ids[4:8], pays[4:8]) == [True, True, False, False]
    assert fresh.stats()["errors"]["checksum"] == 1
    assert sum(s.stats()["errors"].values()) == 0
    s.close()
    fresh.close()


def test_missing_bucket_without_create_is_a_counted_miss(seaweed):
    ids, pays = block_chain(LAYOUT, 2)
    s = open_store(f"s3://no-such-bucket/kv?endpoint={seaweed.endpoint}&region=us-east-1&retries=1", LAYOUT)
    assert s.put_many(ids, pays) == [False, False]
    assert s.get_many(ids, empty_like_blocks(LAYOUT, 2)) == [False, False]
    assert s.stats()["errors"]["io"] >= 2
    s.close()


def test_blocks_stored_by_one_process_are_hits_for_another(seaweed):
    url = seaweed.url("shared", prefix="team/a")
    run_writer(url)
    ids, pays = block_chain(LAYOUT, 16, seed=11)
    s = open_store(url, LAYOUT)
    assert s.contains_many([b.hash for b in ids]) == [True] * 16
    assert _check(s, ids, pays) == [True] * 16
    s.close()


def test_seaweedfs_stopped_mid_run_then_restarted(seaweed_private):
    sw = seaweed_private
    ids, pays = block_chain(LAYOUT, 8)
    s = open_store(sw.url("faults", timeout="1", connect_timeout="0.5", retries="1"), LAYOUT)
    assert s.put_many(ids[:4], pays[:4]) == [True] * 4
    sw.stop()
    assert s.contains_many([b.hash for b in ids]) == [False] * 8
    assert _check(s, ids, pays) == [False] * 8
    assert s.put_many(ids[4:], pays[4:]) == [False] * 4
    st = s.stats()["errors"]
    assert st["io"] >= 1 and st["io"] + st["unavailable"] + st["timeout"] >= 3
    assert sw.start()
    # Same data directory: what was stored before the stop is found again, byte for byte.
    assert _wait_for_hits(s, ids[:4], pays[:4]) == [True] * 4
    assert s.put_many(ids[4:], pays[4:]) == [True] * 4
    assert _check(s, ids, pays) == [True] * 8
    s.close()


def test_a_request_that_times_out_is_a_miss_then_service_resumes(seaweed_private):
    sw = seaweed_private
    ids, pays = block_chain(LAYOUT, 4)
    s = open_store(sw.url("slow", timeout="0.5", connect_timeout="0.5", retries="1"), LAYOUT)
    s.put_many(ids, pays)
    sw.freeze()  # SIGSTOP: connections are accepted by the kernel, nothing answers
    try:
        t0 = time.monotonic()
        assert _check(s, ids, pays) == [False] * 4
        assert time.monotonic() - t0 < 5
        assert s.stats()["errors"]["timeout"] >= 1
    finally:
        sw.thaw()
    assert _wait_for_hits(s, ids, pays) == [True] * 4
    s.close()
