"""The cache with L3 below L2: write-down per policy, L3 lookups, prefetch with a deadline,
load-or-recompute, warm restarts and shared stores, and faults that must never change an answer."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from prefix_kv import prefix_kv, read_slots, write_into_slots
from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.errors import ConfigError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=4)
BPB = LAYOUT.bytes_per_block


def make(l3, l1=4, l2=4, **kw) -> TieredKVCache:
    return TieredKVCache(LAYOUT, CacheConfig(l1=l1 * BPB, l2=l2 * BPB, l3=l3, **kw), device="cpu", model="l3-test")


def store(cache, tokens, salt=None):
    return cache.store(tokens, prefix_kv(LAYOUT, tokens, salt), salt)


def check_retrieve(cache, tokens, expect_tokens, salt=None):
    n, kv = cache.retrieve(tokens, salt)
    assert n == expect_tokens
    assert torch.equal(kv, prefix_kv(LAYOUT, tokens, salt)[:, :, :n])


def push_out(cache, rounds=3):
    """Traffic nobody shares, enough to push everything else out of L1 and L2."""
    for r in range(rounds):
        store(cache, list(range(10_000 + 100 * r, 10_000 + 100 * r + 13)))


def test_l3_needs_l2():
    with pytest.raises(ConfigError, match="needs an L2 pool"):
        TieredKVCache(LAYOUT, CacheConfig(l1=4 * BPB, l3=["file:///tmp/x"]), device="cpu", model="m")


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_disk_blocks_come_back_after_l1_and_l2_forget_them(tmp_path, policy):
    cache = make([f"file://{tmp_path}?size=1MiB"], write_policy=policy)
    doc = list(range(13))
    store(cache, doc)
    push_out(cache)
    assert cache.flush(timeout=30)
    m = cache.match(doc)
    assert m.by_tier == {"l1": 0, "l2": 0, "l3": 12}
    check_retrieve(cache, doc, 12)  # read L3 -> L2, served byte-identical
    assert cache.stats()["tiers"]["l3"]["blocks_out"] == 3
    cache.close()


def test_prefetch_then_allocate_loads_through_l2(tmp_path):
    cache = make([f"file://{tmp_path}"], l1=5, l2=6)
    doc = list(range(13))
    store(cache, doc)
    push_out(cache)
    cache.flush(timeout=30)
    m = cache.match(doc + [1, 2])
    assert m.by_tier["l3"] == 12
    seq = cache.allocate(doc + [1, 2], match=m)
    assert seq.num_cached_tokens == 0  # allocate never waits for L3: without a prefetch it recomputes
    cache.free(seq)
    p = cache.prefetch(m, deadline_s=30)
    assert p.wait(30) and p.num_blocks == 3
    seq = cache.allocate(doc + [1, 2])
    assert seq.num_cached_tokens == 12
    cache.free(seq)
    cache.close()


def test_a_prefetch_past_its_deadline_is_recomputed_not_waited_for(tmp_path):
    cache = make([f"file://{tmp_path}"])
    doc = list(range(13))
    store(cache, doc)
    push_out(cache)
    cache.flush(timeout=30)
    p = cache.prefetch(cache.match(doc), deadline_s=-1)  # already late
    assert p.wait(30)
    assert cache.match(doc).by_tier["l2"] == 0  # nothing arrived: the engine computes it
    cache.close()


def test_warm_restart_finds_the_disk_tier(tmp_path):
    url = f"file://{tmp_path}?size=1MiB"
    with make([url]) as first:
        store(first, list(range(13)))
        assert first.flush(timeout=30)
    with make([url]) as second:  # a new cache (as after a restart) on the same directory
        assert second.match(list(range(13))).by_tier["l3"] == 12
        check_retrieve(second, list(range(13)), 12)
        assert second.match(list(range(13)), salt="other").tokens == 0  # other tenants see nothing


def test_load_or_recompute_skips_tiers_slower_than_recomputing(tmp_path):
    cache = make([f"file://{tmp_path}"], l2=16)
    doc = list(range(13))
    store(cache, doc)
    push_out(cache, rounds=1)
    cache.flush(timeout=30)
    cache.match(doc)
    tiers = cache.match(doc).by_tier
    assert tiers["l1"] < 12 and tiers["l1"] + tiers["l2"] + tiers["l3"] == 12
    assert cache.match(doc, recompute_seconds_per_token=1.0).tokens == 12  # recompute is slow: load it all
    cheap = cache.match(doc, recompute_seconds_per_token=1e-15)  # recompute is free: load only L1 hits
    assert cheap.tokens == tiers["l1"] and cheap.by_tier["l2"] == cheap.by_tier["l3"] == 0
    cache.close()


def test_an_unmeasured_l3_is_probed_then_judged_by_its_measured_speed(tmp_path):
    from tierkv.plan import L3_PROBE_BLOCKS

    url = f"file://{tmp_path}?size=64MiB"
    doc = list(range(4 * 40 + 1))  # 40 full blocks
    with make([url], l1=48, l2=48) as first:
        store(first, doc)
        assert first.flush(timeout=30)
    with make([url], l1=48, l2=48) as cache:  # restarted: nothing read from the disk yet
        assert cache.match(doc).by_tier["l3"] == 160
        # slow recompute: everything is worth loading, measured or not
        assert cache.match(doc, recompute_seconds_per_token=1.0).by_tier["l3"] == 160
        # free recompute: only a probe is loaded, so that the disk's real speed gets measured
        probe = cache.match(doc, recompute_seconds_per_token=1e-15)
        assert probe.by_tier == {"l1": 0, "l2": 0, "l3": 4 * L3_PROBE_BLOCKS}
        assert cache.prefetch(probe).wait(30)
        assert cache.tiers.l3.read_measured
        assert cache.match(doc).by_tier == {"l1": 0, "l2": 4 * L3_PROBE_BLOCKS, "l3": 160 - 4 * L3_PROBE_BLOCKS}
        # measured now: no more probing, the L3 part is judged by that speed (free recompute wins)
        assert cache.match(doc, recompute_seconds_per_token=1e-15).tokens == 0


@pytest.mark.parametrize("chunk", [16, 256])
def test_chunked_l3_hits_a_prompt_ending_inside_a_chunk_and_a_longer_one(tmp_path, chunk):
    """Chunk objects are named after their last block: a prompt whose usable part ends one block
    before the stored chain's end still finds it (the match looks up its last block's hash too),
    and a longer prompt whose chain was stored in two writes reads both parts."""
    url = f"file://{tmp_path}?size=64MiB&chunk={chunk}"  # 4 or 64 blocks of 4 tokens a chunk
    doc = list(range(4 * 10))  # 10 full blocks: the last token is computed, so 9 blocks are usable
    longer = doc + list(range(500, 500 + 4 * 7 + 1))  # 17 full blocks and one token
    with make([url], l1=48, l2=48) as first:
        store(first, doc)
        assert first.flush(timeout=30)
    with make([url], l1=48, l2=48) as second:
        assert second.match(doc).by_tier["l3"] == 36
        check_retrieve(second, doc, 36)
        store(second, longer)
        assert second.flush(timeout=30)
    with make([url], l1=48, l2=48) as third:
        assert third.match(longer).by_tier["l3"] == 68
        check_retrieve(third, longer, 68)
        assert sum(third.stats()["l3_stores"][0]["errors"].values()) == 0


def test_an_l3_tail_is_read_while_the_head_is_computed_then_adopted(tmp_path):
    url = f"file://{tmp_path}?size=64MiB"
    doc = list(range(4 * 40 + 1))  # 40 full blocks and the token whose logits are computed
    with make([url], l1=48, l2=48) as first:
        store(first, doc)
        assert first.flush(timeout=30)
    with make([url], l1=48, l2=48) as cache:
        assert cache.prefetch(cache.match(doc), 30, blocks=(0, 1)).wait(30)  # one read: speed measured
        # recomputing costs half of what reading costs, per block: read the end while computing the start
        per_token = cache.tiers.load_seconds("l3", 39) / 39 / 2 / 4
        m = cache.match(doc, recompute_seconds_per_token=per_token)
        assert m.by_tier == {"l1": 0, "l2": 4, "l3": 0} and m.tail is not None
        j, end = m.tail
        assert 1 < j < end == 40
        seq = cache.allocate(doc, match=m)
        assert seq.cached_by_tier == {"l1": 0, "l2": 0, "l3": 4}  # block 0 came up from L3 (the first read)
        assert cache.prefetch(m, 30, blocks=m.tail).wait(30)
        write_into_slots(cache, seq, doc[: 4 * j], 4)  # the engine computes blocks 1..j-1
        cache.commit(seq, doc[: 4 * j])
        assert cache.adopt(seq, doc) == 40 - j and seq.committed == 40
        assert seq.cached_by_tier == {"l1": 0, "l2": 0, "l3": 4 * (1 + 40 - j)}  # what adopt took, by tier
        assert torch.equal(read_slots(cache, seq, 160), prefix_kv(LAYOUT, doc)[:, :, :160])
        assert cache.adopt(seq, doc) == 0  # nothing past the prompt's last full block
        cache.free(seq)


def test_a_windowed_sequence_adopts_only_the_window_of_an_l3_tail_and_lets_go_of_the_rest(tmp_path):
    """Every layer slides (8 tokens): of an L3 tail read while its start is computed, a sequence
    takes only the blocks its window reads from the tail's end (blocks 38 and 39: the window of
    the query at 160) and lets go of the rest unread. Up to a given end it takes all or nothing."""
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=4, windows=(8,) * 3)
    url = f"file://{tmp_path}?size=64MiB"

    def windowed() -> TieredKVCache:
        bpb = layout.bytes_per_block
        return TieredKVCache(layout, CacheConfig(l1=48 * bpb, l2=48 * bpb, l3=[url]), device="cpu", model="w")

    doc, j = list(range(4 * 40 + 1)), 20  # 40 full blocks and the token whose logits are computed
    with windowed() as first:
        first.store(doc, prefix_kv(layout, doc))
        assert first.flush(timeout=30)
    with windowed() as cache:
        assert cache.lets_go
        seq = cache.allocate(doc, match=cache.match(doc, limit=0))  # the engine computes blocks 0..j-1
        write_into_slots(cache, seq, doc[: 4 * j], 0)
        cache.commit(seq, doc[: 4 * j])
        cache.let_go(seq, 4 * j)
        m = cache.match(doc)
        assert cache.prefetch(m, 30, blocks=(j, 39)).wait(30)  # the tail's end, but for its last block
        free = len(cache.l1.free)
        # ending at 39 needs blocks 37 and 38, held; at 40, block 39 too, which is not
        assert cache.adoptable(seq, doc)[0] == 39 and 40 not in cache.adoptable(seq, doc)
        assert cache.adopt(seq, doc, upto=40) == 0 and seq.committed == j and len(cache.l1.free) == free
        assert cache.prefetch(m, 30, blocks=(39, 40)).wait(30)
        loaded = cache.stats()["tiers"]["l2"]["blocks_out"]
        assert cache.adopt(seq, doc) == 40 - j and seq.committed == 40 and seq.released == 38
        assert cache.stats()["tiers"]["l2"]["blocks_out"] - loaded == 2  # blocks 38 and 39 alone
        assert seq.slots[:38] == [-1] * 38 and seq.entries[:38] == [None] * 38
        kv = cache.l1.kv[:, torch.tensor(seq.slots[38:40])]  # [L, 2 blocks, 2, bs, H, D]
        assert torch.equal(kv.transpose(1, 2).reshape(3, 2, 8, 2, 8), prefix_kv(layout, doc)[:, :, 152:160])
        # skipped blocks count as computed, with L1 as allocate's window hits; the read ones as L3
        assert seq.cached_by_tier == {"l1": 4 * (38 - j), "l2": 0, "l3": 8}
        cache.free(seq)
        assert not cache.live_sequences() and len(cache.l1.free) + cache.index.evictable("l1") == 48


def test_redis_dying_mid_run_slows_nothing_down_to_wrong(redis_server):
    cache = make([redis_server.url])
    docs = [list(range(i * 100, i * 100 + 13)) for i in range(4)]
    for d in docs[:2]:
        store(cache, d)
    cache.flush(timeout=30)
    redis_server.kill()
    for d in docs[2:]:  # writes fail: counted, never raised
        store(cache, d)
    push_out(cache)
    cache.flush(timeout=30)
    for d in docs:  # every answer is the right KV or a miss
        n, kv = cache.retrieve(d)
        assert torch.equal(kv, prefix_kv(LAYOUT, d)[:, :, :n])
    stats = cache.stats()
    assert stats["tiers"]["l3"]["errors"] > 0  # the failed writes, counted
    redis_server.start()  # it comes back: new blocks are written and found again
    time.sleep(5.5)  # past the store's longest back-off
    store(cache, list(range(777, 790)))
    push_out(cache)
    assert cache.flush(timeout=30)
    assert cache.match(list(range(777, 790))).by_tier["l3"] == 12
    cache.close()


SECOND_PROCESS = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from prefix_kv import prefix_kv
    from tierkv import CacheConfig, KVLayout, TieredKVCache
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=4)
    cache = TieredKVCache(layout, CacheConfig(l1=4 * layout.bytes_per_block, l2=4 * layout.bytes_per_block,
                          l3=[{url!r}]), device="cpu", model="l3-test")
    doc = list(range(13))
    m = cache.match(doc)
    n, kv = cache.retrieve(doc)
    print(m.by_tier["l3"], n, torch.equal(kv, prefix_kv(layout, doc)[:, :, :n]))
""")


@pytest.mark.parametrize("service", ["redis", "s3"])
def test_a_second_process_hits_what_the_first_stored(service, request, tmp_path):
    if service == "redis":
        url = request.getfixturevalue("redis_server").url
    else:
        url = request.getfixturevalue("seaweed").url("shared-cache", prefix=tmp_path.name)
    with make([url]) as first:
        store(first, list(range(13)))
        assert first.flush(timeout=60)
    script = SECOND_PROCESS.format(tests=str(request.path.parent), url=url)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["12", "12", "True"]


def test_a_block_l3_reported_but_cannot_read_is_recomputed_from_there(tmp_path):
    # An S3 lookup answers by prefix (chunks.probe_prefix), so it may report a block that a read then
    # misses (evicted, deleted, never landed). The plan must then load what it can up to that
    # block and recompute the rest, with the bytes of every loaded block right.
    from tierkv.hashing import hash_blocks, namespace, token_bytes
    from tierkv.tiers.codec import key_hex

    cache = make([f"file://{tmp_path}"], l1=5, l2=6)
    doc = list(range(13))
    store(cache, doc)
    push_out(cache)
    assert cache.flush(timeout=30)
    m = cache.match(doc + [1, 2])
    assert m.by_tier["l3"] == 12
    ns = namespace("l3-test", LAYOUT.fingerprint, 0, None)
    second = hash_blocks(token_bytes(doc), LAYOUT.block_size, ns)[1]
    victims = list(tmp_path.rglob(f"{key_hex(second)}*"))
    assert len(victims) == 1
    victims[0].unlink()  # after the lookup, before the read
    p = cache.prefetch(m, deadline_s=30)
    assert p.wait(30)
    seq = cache.allocate(doc + [1, 2])
    assert seq.num_cached_tokens == 4  # block 0 loaded; blocks 1.. are computed
    cache.free(seq)
    check_retrieve(cache, doc, 4)
    cache.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_prefix_recomputed_though_l3_holds_it_is_not_written_again(tmp_path, policy):
    # An engine recomputes an L3 part when reading it looks slower (or its read came late). Those
    # blocks are new in the index, but L3 has them: evicting them must not write them again (on
    # a saturated disk, such rewrites took most of its time from the reads requests waited for).
    # The blocks past the stored part are new to L3 and are written.
    url = f"file://{tmp_path}?size=64MiB"
    doc = list(range(4 * 10 + 1))  # 10 full blocks
    longer = doc[:-1] + list(range(500, 500 + 4 * 3 + 1))  # the same 10, then 3 more
    with make([url], l1=48, l2=48, write_policy=policy) as first:
        store(first, doc)
        assert first.flush(timeout=30)
    with make([url], l1=48, l2=48, write_policy=policy) as cache:
        m = cache.match(longer)
        assert m.by_tier["l3"] == 40 and m.in_l3 == (0, 10)
        seq = cache.allocate(longer, match=m)  # no prefetch: the engine computes everything
        assert seq.num_cached_tokens == 0
        write_into_slots(cache, seq, longer, 0)
        cache.commit(seq, longer)
        cache.free(seq)
        cache.evict("l1")
        cache.evict("l2")
        assert cache.flush(timeout=30)
        assert cache.stats()["l3_stores"][0]["puts"] == 3  # the 3 new blocks only
        assert cache.stats()["tiers"]["l3"]["blocks_in"] == 3
        check_retrieve(cache, longer, 52)  # and what L3 holds is the prompt's KV, all 13 blocks


def test_reads_queued_on_l3_and_reads_slower_than_estimated_count_in_its_load_estimate(tmp_path):
    # One thread reads L3 for every request, in order: a read submitted behind others lands after
    # them. Load-or-recompute must see that wait, or requests queue on a busy disk while the GPU,
    # which could recompute their prefixes, idles. A read also waits for what the store's speed
    # does not see (copies out of its L2 slots, writes on the same device): once reads take longer
    # than estimated, the next estimates expect it.
    import threading

    url = f"file://{tmp_path}?size=64MiB"
    doc = list(range(4 * 40 + 1))
    with make([url], l1=48, l2=48) as first:
        store(first, doc)
        assert first.flush(timeout=30)
    with make([url], l1=48, l2=48) as cache:
        l3 = cache.tiers.l3
        gate = threading.Event()
        l3._reader.submit(gate.wait)  # the reader is busy: the next read waits its turn
        try:
            alone = l3.estimate_seconds(10)
            assert alone == l3.stores[0].estimate_load_seconds(10)  # no read timed yet: unscaled
            p = cache.prefetch(cache.match(doc), 30)
            assert p.num_blocks == 40 and l3.queued_reads == 40
            assert l3.estimate_seconds(10) == l3.stores[0].estimate_load_seconds(50) > alone
            time.sleep(0.3)  # what holds the reader is nothing the estimate knew of
        finally:
            gate.set()
        assert p.wait(30)
        cache.match(doc)  # takes the finished read in
        assert l3.queued_reads == 0
        reads = cache.stats()["l3_reads"]
        assert reads["recent"][-1]["actual_s"] > 0.3 > reads["recent"][-1]["estimate_s"]
        assert l3.estimate_seconds(10) > 1.5 * l3.stores[0].estimate_load_seconds(10)
        assert reads["estimate_scale"] == l3.estimate_scale > 1.5


def test_writes_wait_for_the_reads_in_flight(tmp_path):
    # A request waits for an L3 read; a write only frees L2. On one device a write beside a read
    # slows the read (on the H200, reads took 4.9x their estimates in a point that wrote 12.8 GB
    # to the same disk), so a write piece starts only once no read is in flight, or after WRITE_YIELD_S.
    import threading

    from tierkv.l3_mover import WRITE_YIELD_S

    doc, other = list(range(4 * 8 + 1)), list(range(500, 500 + 4 * 8 + 1))
    url = f"file://{tmp_path}?size=64MiB"
    with make([url], l1=16, l2=16) as first:
        store(first, doc)
        assert first.flush(timeout=30)
    with make([url], l1=16, l2=16, write_policy="write_through") as cache:
        l3 = cache.tiers.l3
        puts = lambda: cache.stats()["l3_stores"][0]["puts"]  # noqa: E731
        gate = threading.Event()
        l3._reader.submit(gate.wait)  # the device is busy reading: the read below is in flight
        try:
            p = cache.prefetch(cache.match(doc), 30)
            assert p.num_blocks == 8
            store(cache, other)  # write-through: its 8 blocks go to L3 at once
            time.sleep(WRITE_YIELD_S / 3)
            assert puts() == 0  # the write waits for the read
        finally:
            gate.set()
        assert p.wait(30) and cache.flush(timeout=30)
        assert puts() == 8
        check_retrieve(cache, other, 32)


def test_write_through_writes_the_l1_blocks_l2_had_no_room_for_once_writes_end(tmp_path):
    # Under write-through a new L1 block is copied into L2 and on to L3. While L2's slots are all
    # held by blocks on their way to L3, new blocks stay in L1 alone: they must reach L3 once those
    # writes end, not only when L1 evicts them (into an L2 perhaps full again, where they are dropped
    # unwritten; or written while requests read L3: on the H200, long_doc's first point after a
    # priming burst wrote 12.8 GB to the disk its reads used).
    import threading

    url = f"file://{tmp_path}?size=64MiB"
    doc = list(range(4 * 8 + 1))  # 8 full blocks
    with make([url], l1=16, l2=4, write_policy="write_through") as cache:
        l3 = cache.tiers.l3
        puts = lambda: cache.stats()["l3_stores"][0]["puts"]  # noqa: E731 (stats() takes finished writes in)
        gate = threading.Event()
        l3._writer.submit(gate.wait)  # the disk is slow: L2's 4 slots stay held by their writes
        try:
            store(cache, doc)
            assert cache.match(doc).by_tier == {"l1": 32, "l2": 0, "l3": 0}
            assert cache.l2.num_blocks - len(cache.l2.free) == 4 and puts() == 0
            assert cache.stats()["tiers"]["l3"]["write_backlog_blocks"] == 4
        finally:
            gate.set()
        end = time.monotonic() + 10
        while puts() < 8 and time.monotonic() < end:
            time.sleep(0.02)
        assert puts() == 8  # the 4 that L2 had no room for went on once the first 4 were written
        stats = cache.stats()
        assert stats["tiers"]["l1"]["drops"] == 0 and stats["tiers"]["l3"]["write_backlog_blocks"] == 0
    with make([url], l1=16, l2=16) as other:  # L3 holds the whole document
        assert other.match(doc).by_tier["l3"] == 32
        check_retrieve(other, doc, 32)


class DeferredTransfer:
    """A copy that runs only when someone waits for it, as a CUDA copy is still in flight after
    it was issued: on a CPU the moves are synchronous, and the race below could not happen."""

    def __init__(self, run) -> None:
        self._run = run

    def done(self) -> bool:
        return self._run is None

    def synchronize(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run()

    wait = synchronize

    def wait_layer(self, layer, stream=None) -> None:
        self.synchronize()


def test_an_l3_read_into_an_l2_slot_waits_for_the_load_still_reading_it(tmp_path):
    # allocate() gives an L2 hit's slots back (release_l2) right after issuing their loads into
    # L1; an L3 read taking those slots at once must not write them before the loads have read them.
    from tierkv.transfer import BlockMover

    class DeferredMover(BlockMover):
        def l2_to_l1(self, l2_slots, l1_slots, layers=None):
            run = lambda: BlockMover.l2_to_l1(self, list(l2_slots), list(l1_slots), layers)  # noqa: E731
            self.last = DeferredTransfer(run)
            return self.last

    a, b = list(range(13)), list(range(500, 513))  # 3 full blocks each
    with make([f"file://{tmp_path}?size=1MiB"], l1=4, l2=3) as cache:
        store(cache, b)
        assert cache.flush(timeout=30)
        cache.evict("l1")
        store(cache, a)  # L2 (3 blocks) now holds a's blocks alone; b is in L3 only
        assert cache.flush(timeout=30)
        cache.evict("l1")
        assert cache.match(a).by_tier == {"l1": 0, "l2": 12, "l3": 0}
        cache.tiers.mover = DeferredMover(cache.l1, cache.l2, warm_up=False)
        seq = cache.allocate(a)  # a's loads out of its 3 L2 slots are issued, not run yet
        m = cache.match(b)
        assert m.by_tier["l3"] == 12
        fetch = cache.prefetch(m, 30)  # takes those 3 slots: a's blocks are in L3, so they go
        assert fetch.num_blocks == 3 and fetch.wait(30)
        seq.wait()
        assert torch.equal(read_slots(cache, seq, 12), prefix_kv(LAYOUT, a)[:, :, :12])
        cache.free(seq)
        check_retrieve(cache, b, 12)  # and b's blocks landed whole


def test_stats_keep_the_last_reads_estimate_and_actual_time_bounded(tmp_path):
    from tierkv.l3_mover import RECENT_READS

    doc = list(range(4 * 8 + 1))
    with make([f"file://{tmp_path}?size=1MiB"], l1=16, l2=16) as cache:
        store(cache, doc)
        assert cache.flush(timeout=30)
        assert cache.stats()["l3_reads"] == {"recent": [], "timed": 0, "abandoned": 0,
                                             "mean_actual_over_estimate": None, "estimate_scale": 1.0}
        cache.evict("l1")
        cache.evict("l2")
        m = cache.match(doc)
        for _ in range(RECENT_READS + 4):  # each read lands in L2, and is dropped for the next
            assert cache.prefetch(m, 30, blocks=(0, 2)).wait(30)
            cache.evict("l2")
        reads = cache.stats()["l3_reads"]
        assert len(reads["recent"]) == RECENT_READS and reads["timed"] == RECENT_READS + 4
        assert all(r["blocks"] == 2 and r["estimate_s"] > 0 and r["actual_s"] > 0 and not r["abandoned"]
                   for r in reads["recent"])
        assert reads["mean_actual_over_estimate"] > 0


def test_flush_writes_blocks_that_write_throughs_catch_up_copied_down_meanwhile(tmp_path, monkeypatch):
    """flush() copies the blocks only L1 holds down to L2 as room frees. Meanwhile write-through's
    catch-up (run when an L3 write ends) may copy some of them down itself; flush must take them
    as copied rather than wait for room for them, which ended in False once no write was left
    (test_redis_dying_mid_run..., 2 in 16 runs beside CPU hogs). Slow writes make it happen here:
    L2 holds two blocks, both being written, when flush starts; the third is owed."""
    cache = make([f"file://{tmp_path}?size=1MiB"], l1=4, l2=2)
    [store_l3] = cache.tiers.l3.stores
    put_many = store_l3.put_many

    def slow_put_many(ids, payloads):
        time.sleep(0.3)
        return put_many(ids, payloads)

    monkeypatch.setattr(store_l3, "put_many", slow_put_many)
    doc = list(range(13))  # 3 full blocks: two go down to L2 and on to L3, the third waits in L1
    store(cache, doc)
    assert cache.match(doc).by_tier == {"l1": 12, "l2": 0, "l3": 0} and len(cache.tiers.owed) == 1
    assert cache.flush(timeout=30)
    assert cache.stats()["tiers"]["l3"]["blocks_in"] == 3
    cache.evict("l1")
    cache.evict("l2")
    check_retrieve(cache, doc, 12)
    cache.close()
