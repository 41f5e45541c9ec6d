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


def _branch(ids, at: int, n: int, seed: int):
    """`n` blocks of new random tokens chained after ids[at - 1] (chain positions at, at+1, ...)."""
    import numpy as np

    from tierkv.hashing import hash_blocks, token_bytes
    from tierkv.tiers.codec import BlockId

    rng = np.random.default_rng(seed)
    ns, stride = ids[0].ns, 4 * LAYOUT.block_size
    tokens = token_bytes(rng.integers(0, 50_000, n * LAYOUT.block_size, dtype=np.int64))
    out, parent = [], ids[at - 1].hash
    for i, h in enumerate(hash_blocks(tokens, LAYOUT.block_size, ns, parent=parent)):
        out.append(BlockId(h, parent, ns, tokens[i * stride : (i + 1) * stride], at + i))
        parent = h
    pays = [torch.randint(0, 256, (LAYOUT.bytes_per_block,), dtype=torch.uint8).view(LAYOUT.dtype).reshape(LAYOUT.block_shape)
            for _ in range(n)]
    return out, pays


class _Requests:
    """Counts the S3 requests a store sends, by operation, through botocore's event hooks."""

    def __init__(self, store) -> None:
        self.ops: list[str] = []
        store._s3.meta.events.register("before-call.s3", self._count)

    def _count(self, model, **_) -> None:
        self.ops.append(model.name)

    def take(self) -> list[str]:
        ops, self.ops = self.ops, []
        return ops


def test_a_64_block_lookup_is_one_round_of_two_heads_for_a_hit_or_a_miss(seaweed):
    ids, pays = block_chain(LAYOUT, 64, seed=5)
    cold, _ = block_chain(LAYOUT, 64, seed=6)
    s = open_store(seaweed.url("lookup64"), LAYOUT)
    assert s.put_many(ids, pays) == [True] * 64
    sent = _Requests(s)
    assert s.contains_many([b.hash for b in ids]) == [True] * 64
    assert sent.take() == ["HeadObject"] * 2  # the first and the last block
    assert s.contains_many([b.hash for b in cold]) == [False] * 64
    assert sent.take() == ["HeadObject"] * 2
    # a run that ends inside: found exactly, in at most 18 HEADs (not 64)
    for stored in (1, 2, 37, 63):
        part = open_store(seaweed.url(f"lookup-part{stored}"), LAYOUT)
        assert part.put_many(ids[:stored], pays[:stored]) == [True] * stored
        sent = _Requests(part)
        assert part.contains_many([b.hash for b in ids]) == [True] * stored + [False] * (64 - stored)
        assert 2 <= len(sent.take()) <= 18
        part.close()
    # from a chain position on (the cache asks past what L1 and L2 hold)
    assert s.contains_many([b.hash for b in ids[40:]], first_pos=40) == [True] * 24
    s.close()


def test_a_hole_in_a_stored_run_is_a_read_miss_never_wrong_data(seaweed):
    ids, pays = block_chain(LAYOUT, 64, seed=7)
    s = open_store(seaweed.url("holes"), LAYOUT)
    assert s.put_many(ids, pays) == [True] * 64
    raw = boto3.client("s3", endpoint_url=seaweed.endpoint, region_name="us-east-1")
    raw.delete_object(Bucket="holes", Key=f"kv/{key_hex(ids[20].hash)}.c1")  # evicted, or never landed
    found = s.contains_many([b.hash for b in ids])
    n = found.index(False) if False in found else len(found)
    assert found == [True] * n + [False] * (64 - n) and n >= 20  # prefix-closed, at least up to the hole
    ok = _check(s, ids[:n], pays[:n])  # every hit checked byte for byte against what was stored
    assert ok == [True] * 20 + [False] + [True] * (n - 21) if n > 20 else ok == [True] * n
    s.close()


def test_two_processes_writing_one_bucket_branch_and_overlap(seaweed):
    url = seaweed.url("two-writers", prefix="team/b")
    run_writer(url)  # another process: blocks 0..15 of chain seed=11
    longer, pays = block_chain(LAYOUT, 16, seed=11)
    s = open_store(url, LAYOUT)
    # this process writes some of the same blocks again (same names, same bytes) and a branch
    # off block 7 (another question after one shared system prompt), 4 blocks long
    assert s.put_many(longer[:8], pays[:8]) == [True] * 8
    branch, bpays = _branch(longer, 8, 12, seed=12)
    assert s.put_many(branch[:4], bpays[:4]) == [True] * 4
    reader = open_store(url, LAYOUT)
    assert reader.contains_many([b.hash for b in longer]) == [True] * 16
    assert reader.contains_many([b.hash for b in longer[:8] + branch]) == [True] * 12 + [False] * 8
    assert reader.contains_many([b.hash for b in branch], first_pos=8) == [True] * 4 + [False] * 8
    assert _check(reader, longer, pays) == [True] * 16 and _check(reader, branch[:4], bpays[:4]) == [True] * 4
    s.close()
    reader.close()
