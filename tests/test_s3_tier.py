"""tierkv/tiers/s3.py against a real SeaweedFS: chunk objects, sharing a bucket, damage, faults, and HEADs off botocore."""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime, timedelta, timezone
from urllib.parse import quote

import boto3
import pytest
import torch
from botocore.credentials import RefreshableCredentials
from services import S3_KEY, S3_SECRET, block_chain, get_and_check, empty_like_blocks
from test_redis_tier import run_writer

from tierkv.errors import ConfigError
from tierkv.layout import KVLayout
from tierkv.tiers.codec import key_hex, payload_offset
from tierkv.tiers.open import open_store
from tierkv.tiers.service import Breaker

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
    # two attempts: a new bucket's first PUTs can take SeaweedFS over a second (it grows a volume)
    s = open_store(sw.url("faults", timeout="1", connect_timeout="0.5", retries="2"), LAYOUT)
    assert s.put_many(ids[:4], pays[:4]) == [True] * 4
    sw.stop()
    s._breaker = Breaker(min_wait=2.0, max_wait=2.0)  # the second lookup below comes well within its wait
    assert s.contains_many([b.hash for b in ids]) == [False] * 8  # refused: counted, the breaker opens
    refused = s.stats()["errors"]
    assert refused["io"] >= 1 and refused["timeout"] == 0
    assert s.contains_many([b.hash for b in ids]) == [False] * 8  # skipped: no request while it waits
    skipped = s.stats()["errors"]
    assert skipped["unavailable"] >= 1 and skipped["io"] == refused["io"]
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
        assert s.contains_many([b.hash for b in ids]) == [False] * 4  # the HEADs time out
        assert s.stats()["errors"]["timeout"] >= 1
        assert _check(s, ids, pays) == [False] * 4
        assert time.monotonic() - t0 < 5
        assert s.stats()["errors"]["timeout"] >= 1
    finally:
        sw.thaw()
    assert _wait_for_hits(s, ids, pays) == [True] * 4
    s.close()


def test_lookups_of_a_frozen_s3_miss_within_their_timeout_and_recover_once_it_answers(seaweed_private, caplog):
    # What the engine's thread sees (the cache passes each store's lookup_timeout): a hung S3 costs
    # one timeout, then lookups miss at once while it is degraded; one line says so, one that it is back.
    caplog.set_level(logging.WARNING, logger="tierkv")
    sw = seaweed_private
    ids, pays = block_chain(LAYOUT, 4)
    hashes = [b.hash for b in ids]
    s = open_store(sw.url("frozen", lookup_timeout="0.3"), LAYOUT)  # the default service timeouts
    assert s.put_many(ids, pays) == [True] * 4
    assert s.contains_many(hashes, timeout=s.lookup_timeout) == [True] * 4 and s.stats()["healthy"]
    sw.freeze()  # SIGSTOP: connections are accepted by the kernel, nothing answers
    try:
        t0 = time.monotonic()
        assert s.contains_many(hashes, timeout=s.lookup_timeout) == [False] * 4
        first = time.monotonic() - t0
        t0 = time.monotonic()
        for _ in range(20):
            assert s.contains_many(hashes, timeout=s.lookup_timeout) == [False] * 4
        rest = time.monotonic() - t0
        st = s.stats()
    finally:
        sw.thaw()
    assert s.lookup_timeout <= first < 2 * s.lookup_timeout, first
    assert rest < s.lookup_timeout, rest  # 20 lookups while it is degraded wait for nothing
    assert not st["healthy"] and st["degraded"] == ["lookups take longer than 0.3 s"], st
    assert st["errors"]["timeout"] >= 1 and st["errors"]["unavailable"] == 20
    end = time.monotonic() + 20
    while s.contains_many(hashes, timeout=s.lookup_timeout) != [True] * 4 and time.monotonic() < end:
        time.sleep(0.05)  # a probe answers in time: the next lookup is waited for again
    assert s.contains_many(hashes, timeout=s.lookup_timeout) == [True] * 4
    assert s.stats()["healthy"] and _check(s, ids, pays) == [True] * 4
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("tierkv.tiers")]
    assert len(lines) == 2, lines
    assert "s3 L3 s3://frozen/kv: lookups take longer than 0.3 s: degraded" in lines[0], lines
    assert "s3 L3 s3://frozen/kv: answers again" in lines[1], lines
    s.close()


def test_s3_timeouts_are_a_caches_not_botocores(seaweed):
    # botocore waits 60 s for a byte and tries 3 times; tierkv had 10 s and (botocore's max_attempts
    # counts retries) 4 tries, so one call to a hung S3 could hold its caller 40 s. A cache gives up
    # sooner: a miss costs a recompute.
    s = open_store(seaweed.url("defaults"), LAYOUT)
    cfg = s._s3.meta.config
    assert (cfg.read_timeout, cfg.connect_timeout, cfg.retries["total_max_attempts"]) == (2.0, 1.0, 2)
    assert s.lookup_timeout == 0.5
    s.close()
    with pytest.raises(ConfigError, match="lookup_timeout=0.0 must be above 0"):
        open_store(seaweed.url("defaults", lookup_timeout="0"), LAYOUT)


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
    """Counts the S3 requests a store sends, by operation: botocore's through its event hooks,
    HEADs on the fast path (s3._Heads) at its urllib3 pool, one per attempt."""

    def __init__(self, store) -> None:
        self.ops: list[str] = []
        store._s3.meta.events.register("before-call.s3", self._count)
        assert store._heads is not None, "HEADs should not go through botocore here"
        pool = store._heads._pool
        send = pool.urlopen

        def counted(method, url, *args, **kwargs):
            self.ops.append("HeadObject" if method == "HEAD" else method)
            return send(method, url, *args, **kwargs)

        pool.urlopen = counted  # urllib3 retries call urlopen again: each attempt is counted

    def _count(self, model, **_) -> None:
        self.ops.append(model.name)

    def take(self) -> list[str]:
        ops, self.ops = self.ops, []
        return ops


def test_probing_finds_every_run_end_within_its_bounds():
    """chunks.probe_prefix, which S3 lookups use, for every chain length up to 70 and every run end."""
    from tierkv.tiers.chunks import probe_prefix

    for n in range(71):
        for stored in range(n + 1):
            rounds: list[list[int]] = []

            def present(js):
                assert js and all(0 <= j < n for j in js) and len(set(js)) == len(js)
                rounds.append(js)
                return [j < stored for j in js]

            assert probe_prefix(n, present) == stored
            if n:
                assert len(rounds[0]) == min(n, 2)  # the first and the last item
                if stored in (0, n):
                    assert len(rounds) == 1
            if n == 64:
                assert len(rounds) <= 4 and sum(map(len, rounds)) <= 11


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
    # a run that ends inside: found exactly, in at most 11 HEADs (not 64; chunks.probe_prefix)
    for stored in (1, 2, 37, 63):
        part = open_store(seaweed.url(f"lookup-part{stored}"), LAYOUT)
        assert part.put_many(ids[:stored], pays[:stored]) == [True] * stored
        sent = _Requests(part)
        assert part.contains_many([b.hash for b in ids]) == [True] * stored + [False] * (64 - stored)
        ops = sent.take()
        assert set(ops) == {"HeadObject"} and 2 <= len(ops) <= 11
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


# -- HEADs on the fast path (s3._Heads): the same answers as botocore, the same failures ------------

def test_fast_heads_answer_as_botocore_does_under_a_prefix_that_needs_quoting(seaweed):
    prefix = "team c/x+y ü~(1)"
    s = open_store(seaweed.url("fast-heads", prefix=quote(prefix), chunk="32"), LAYOUT)  # 2 blocks a chunk
    assert s._heads.base == f"{seaweed.endpoint}/fast-heads/{quote(prefix, safe='/~')}/"
    ids, pays = block_chain(LAYOUT, 8, seed=21)
    assert s.put_many(ids[:5], pays[:5]) == [True] * 5  # objects end at blocks 1, 3 and (partial) 4
    raw = boto3.client("s3", endpoint_url=seaweed.endpoint, region_name="us-east-1")

    def boto_size(name):
        try:
            return raw.head_object(Bucket="fast-heads", Key=f"{prefix}/{name}")["ContentLength"]
        except raw.exceptions.ClientError as err:
            assert err.response["Error"]["Code"] == "404"
            return None

    names = [s.object_name(b.hash) for b in ids] + ["0" * 32 + ".c2"]
    expected = [boto_size(n) for n in names]
    rs = s.record_size
    assert expected == [None, 2 * rs, None, 2 * rs, rs, None, None, None, None]
    assert [s._heads.size(n) for n in names] == expected
    assert s._stat(names) == expected
    assert s.contains_many([b.hash for b in ids]) == [True] * 5 + [False] * 3
    assert _check(s, ids[:5], pays[:5]) == [True] * 5
    assert sum(s.stats()["errors"].values()) == 0
    s.close()


def test_a_wrong_secret_is_a_counted_error_and_a_miss(seaweed, monkeypatch, caplog):
    ids, pays = block_chain(LAYOUT, 8, seed=22)
    good = open_store(seaweed.url("wrong-secret"), LAYOUT)
    assert good.put_many(ids, pays) == [True] * 8
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        bad = open_store(seaweed.url("wrong-secret", retries="1"), LAYOUT)
        assert bad._heads is not None
        for _ in range(2):
            assert bad.contains_many([b.hash for b in ids]) == [False] * 8
    errors = bad.stats()["errors"]
    # the first and the last block's HEAD, twice: denied (403) is the service answering, so
    # counted as io and the breaker stays closed
    assert errors["io"] == 4 and errors["unavailable"] == 0 and errors["timeout"] == 0
    assert good.contains_many([b.hash for b in ids]) == [True] * 8
    assert "not-the-secret" not in caplog.text and S3_SECRET not in caplog.text
    good.close()
    bad.close()


def test_fast_heads_sign_with_refreshed_credentials(seaweed):
    ids, pays = block_chain(LAYOUT, 4, seed=23)
    s = open_store(seaweed.url("refresh"), LAYOUT)
    assert s.put_many(ids, pays) == [True] * 4
    now = datetime.now(timezone.utc)
    fresh = {"access_key": S3_KEY, "secret_key": S3_SECRET, "token": None,
             "expiry_time": (now + timedelta(hours=1)).isoformat()}
    expired = {**fresh, "secret_key": "expired-secret", "expiry_time": (now - timedelta(minutes=1)).isoformat()}
    s._heads._credentials = RefreshableCredentials.create_from_metadata(expired, lambda: fresh, "test")
    assert s.contains_many([b.hash for b in ids]) == [True] * 4
    assert sum(s.stats()["errors"].values()) == 0
    s.close()


@pytest.mark.parametrize(
    "url, base, region",
    [
        # the default AWS form: virtual-host addressing, regional endpoint, the prefix quoted
        ("s3://my-bucket/a b?region=us-west-2", "https://my-bucket.s3.us-west-2.amazonaws.com/a%20b/", "us-west-2"),
        ("s3://my-bucket/kv?region=us-east-1", "https://my-bucket.s3.amazonaws.com/kv/", "us-east-1"),
        ("s3://my-bucket/kv?region=us-west-2&addressing=path", "https://s3.us-west-2.amazonaws.com/my-bucket/kv/",
         "us-west-2"),
        # a bucket name with dots cannot be a TLS host name: botocore falls back to path style
        ("s3://my.dotted.bucket/kv?region=eu-west-1", "https://s3.eu-west-1.amazonaws.com/my.dotted.bucket/kv/",
         "eu-west-1"),
        ("s3://b/kv?endpoint=https://minio.example:9000&region=us-east-1", "https://minio.example:9000/b/kv/",
         "us-east-1"),
        ("s3://b?endpoint=http://127.0.0.1:1&region=eu-central-1", "http://127.0.0.1:1/b/", "eu-central-1"),
    ],
)
def test_head_urls_are_the_ones_botocore_builds(s3_env, url, base, region):
    s = open_store(url, LAYOUT)  # nothing is sent: the URL is captured before it would leave
    assert (s._heads.base, s._heads.region) == (base, region)
    s.close()


@pytest.mark.parametrize(
    "opts, message",
    [
        ("addressing=sideways", "addressing='sideways'; accepted: auto, path, virtual"),
        ("endpoint=ftp://host:21", "endpoint 'ftp://host:21' is not an http(s) URL"),
        ("endpoint=127.0.0.1:8333", "is not an http(s) URL; use endpoint=http://host:port"),
        ("threads=0", "threads and retries must be at least 1"),
        ("retries=0", "threads and retries must be at least 1"),
        ("timeout=0", "timeout and connect_timeout above 0"),
        ("timeout=soon", "option timeout='soon' is not valid"),
    ],
)
def test_bad_options_are_config_errors_that_say_what_to_change(opts, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_store(f"s3://bucket/kv?{opts}", LAYOUT)


def test_fast_heads_retry_5xx_then_count_it_and_follow_a_bucket_to_botocore(s3_env, caplog):
    """Against a stub that answers every HEAD with one status: what SeaweedFS cannot be made to say."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[str] = []

    class Stub(BaseHTTPRequestHandler):
        status = 503

        def do_HEAD(self):
            seen.append(self.path)
            self.send_response(Stub.status)
            if Stub.status == 301:
                self.send_header("x-amz-bucket-region", "eu-west-1")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}"
        s = open_store(f"s3://stub/kv?endpoint={endpoint}&region=us-east-1&retries=2", LAYOUT)
        ids, _ = block_chain(LAYOUT, 1, seed=24)
        assert s.contains_many([ids[0].hash]) == [False]
        assert len(seen) == 2  # one retry, as botocore's standard mode retries a 503
        errors = s.stats()["errors"]
        assert errors["io"] == 1 and errors["unavailable"] == 0  # the service answered: no back-off
        Stub.status = 301
        with caplog.at_level(logging.WARNING, logger="tierkv"):
            assert s.contains_many([ids[0].hash]) == [False]
        assert s._heads is None and "answers from region eu-west-1, not us-east-1" in caplog.text
        s.close()
    finally:
        server.shutdown()
        server.server_close()


def test_heads_stay_on_botocore_where_it_would_use_a_proxy(s3_env, monkeypatch):
    for var in ("https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    s = open_store("s3://my-bucket/kv?region=us-west-2", LAYOUT)
    assert s._heads is None
    s.close()
    monkeypatch.setenv("NO_PROXY", "amazonaws.com")
    s = open_store("s3://my-bucket/kv?region=us-west-2", LAYOUT)
    assert s._heads is not None
    s.close()
