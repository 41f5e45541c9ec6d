"""cache.plan: the one admission decision (what each tier serves, streaming, the L1 reserve,
L3 fetches and tails, whether L1 can take the prompt now), checked against the cache's state."""

import torch

from prefix_kv import prefix_kv
from tierkv import CacheConfig, KVLayout, TieredKVCache

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=4)
BPB = LAYOUT.bytes_per_block


def make(l1=8, l2=0, l3=(), **kw) -> TieredKVCache:
    return TieredKVCache(LAYOUT, CacheConfig(l1=l1 * BPB, l2=l2 * BPB, l3=list(l3), **kw), device="cpu",
                         model="plan-test")


def store(cache, tokens):
    return cache.store(tokens, prefix_kv(LAYOUT, tokens))


def test_an_l2_hit_is_loaded_whole_and_fits():
    cache = make(l1=8, l2=16)
    doc = list(range(13))  # 3 full blocks and the token whose logits are computed
    store(cache, doc)
    cache.evict("l1")
    plan = cache.plan(doc, budget=64)
    assert plan.match.by_tier == {"l1": 0, "l2": 12, "l3": 0}
    assert (plan.stream, plan.reserve, plan.fits, plan.fetch, plan.tail, plan.adopt_at) == (
        False, None, True, None, None, None)
    seq = cache.allocate(doc, match=plan.match, stream=plan.stream, reserve=plan.reserve)
    assert seq.num_cached_tokens == 12
    cache.free(seq)


def test_prefix_caching_off_matches_nothing():
    cache = make(l1=8, l2=16)
    doc = list(range(13))
    store(cache, doc)
    plan = cache.plan(doc, budget=64, prefix_caching=False)
    assert plan.match.tokens == 0 and plan.fits


def test_a_prompt_larger_than_l1_streams_and_reserves_one_window():
    cache = make(l1=8, l2=32)
    assert cache.stream_window == 16  # half of L1's 8 blocks of 4 tokens
    doc = list(range(4 * 12 + 1))  # 13 blocks with the next token: more than L1
    assert cache.must_stream(len(doc)) and not cache.must_stream(4 * 7)
    store(cache, doc[:21])  # 5 blocks, some of which end in L2
    cache.evict("l1")
    plan = cache.plan(doc, budget=1000)
    assert plan.stream and plan.match.by_tier["l2"] == 20
    # room for the cached prefix and one window of new tokens, not for the whole prompt
    assert plan.reserve == 20 + 16 and plan.fits
    assert cache.plan(doc, budget=3).reserve == 20 + 3  # a smaller step budget reserves less
    # the longest sequence: one window in L1 and all of L2
    assert cache.max_tokens() == 16 + 32 * 4
    assert make(l1=8).max_tokens() == 32  # no L2: L1 alone


def test_a_full_l1_does_not_fit_until_it_is_released():
    cache = make(l1=4, l2=8)
    running = cache.allocate(list(range(100, 116)))  # 4 blocks: all of L1, pinned
    plan = cache.plan(list(range(9)), budget=64)
    assert not plan.fits
    cache.free(running)
    assert cache.plan(list(range(9)), budget=64).fits  # its private blocks are free again


def test_an_l3_hit_is_fetched_before_admission(tmp_path):
    cache = make(l1=4, l2=8, l3=[f"file://{tmp_path}?size=1MiB"])
    doc = list(range(13))
    store(cache, doc)
    for r in range(3):  # traffic nobody shares, pushing the document out of L1 and L2
        store(cache, list(range(10_000 + 100 * r, 10_000 + 100 * r + 13)))
    assert cache.flush(timeout=30)
    plan = cache.plan(doc, budget=64, deadline_s=7.0)
    first = len(plan.match.blocks)
    assert plan.match.by_tier["l3"] == 12 - 4 * first
    assert plan.fetch == (first, 3) and plan.fetch_deadline_s == 7.0 and plan.tail is None
    assert cache.prefetch(plan.match, plan.fetch_deadline_s, blocks=plan.fetch).wait(30)
    after = cache.plan(doc, budget=64)
    assert after.fetch is None and after.match.by_tier["l3"] == 0 and after.match.tokens == 12
    cache.close()


def on_disk(tmp_path, *docs) -> str:
    """An L3 directory holding `docs`, written by a cache that is gone: a restart finds them there alone."""
    url = f"file://{tmp_path}?size=64MiB"
    with make(l1=48, l2=48, l3=[url]) as first:
        for doc in docs:
            store(first, doc)
        assert first.flush(timeout=30)
    return url


def test_a_slow_l3_hit_becomes_a_tail_read_while_the_head_is_recomputed(tmp_path):
    doc = list(range(4 * 40 + 1))
    url = on_disk(tmp_path, doc)
    with make(l1=48, l2=48, l3=[url]) as cache:
        assert cache.prefetch(cache.match(doc), 30, blocks=(0, 1)).wait(30)  # one read: speed measured
        per_token = cache.tiers.load_seconds("l3", 39) / 39 / 2 / 4  # recompute at half the read cost
        plan = cache.plan(doc, budget=10_000, recompute_seconds_per_token=per_token, deadline_s=1.0)
        assert plan.fetch is None and plan.tail is not None and not plan.stream
        j, end = plan.tail
        assert plan.adopt_at == 4 * j and end == 40
        # no more of the tail is read `deadline_s` past the time recomputing the whole L3 part takes
        assert abs(plan.tail_deadline_s - ((4 * end - plan.match.tokens) * per_token + 1.0)) < 1e-9


def slow_disk(cache, seconds_per_block: float) -> None:
    """A measured read-speed sample, as a slow disk's first read gives: one block took this long."""
    cache.tiers.l3.stores[0]._stats.sample_bandwidth(BPB, seconds_per_block, write=False)


def test_reads_queued_ahead_move_the_split_toward_recomputing_and_a_late_read_is_not_issued(tmp_path):
    import threading

    doc, other = list(range(4 * 40 + 1)), list(range(1000, 1000 + 4 * 40 + 1))
    url = on_disk(tmp_path, doc, other)
    with make(l1=48, l2=48, l3=[url]) as cache:
        slow_disk(cache, 0.01)  # 10 ms a block; recomputing one takes 5 ms
        per_token = 0.005 / 4

        def split(plan):
            assert plan.fetch is None and plan.match.tokens == 0
            return plan.tail[0] if plan.tail is not None else 40

        idle = split(cache.plan(doc, budget=10_000, recompute_seconds_per_token=per_token))
        assert 26 <= idle <= 28  # [j, 40) read in (40 - j) x 10 ms while j x 5 ms are recomputed
        l3 = cache.tiers.l3
        gate = threading.Event()
        l3._reader.submit(gate.wait)  # the reader is busy: reads queue behind it
        try:
            assert cache.prefetch(cache.match(other), 30, blocks=(0, 10)).num_blocks == 10
            busy = split(cache.plan(doc, budget=10_000, recompute_seconds_per_token=per_token))
            assert idle < busy <= 35  # 10 blocks ahead: (50 - j) x 10 ms against j x 5 ms
            assert cache.prefetch(cache.match(other), 30, blocks=(10, 40)).num_blocks == 30
            # 40 blocks ahead: no read of any part of doc would land before its recompute reaches it
            late = cache.plan(doc, budget=10_000, recompute_seconds_per_token=per_token)
            assert (late.fetch, late.tail, late.adopt_at, late.match.by_tier) == (
                None, None, None, {"l1": 0, "l2": 0, "l3": 0})
            # a disk far faster than recomputing, queue and all: read whole first, waited for no
            # longer than recomputing it would take
            fast = cache.plan(doc, budget=10_000, recompute_seconds_per_token=1.0, deadline_s=600)
            assert fast.fetch == (0, 40) and fast.tail is None and fast.fetch_deadline_s == 4 * 40 * 1.0
        finally:
            gate.set()


def test_a_disk_faster_than_recomputing_is_still_split_not_waited_for_whole(tmp_path):
    # Reading the whole L3 run first and then computing nothing takes (40 blocks x 10 ms) 0.4 s;
    # computing the start meanwhile ends both by ~0.27 s. Only a read faster than recomputing a
    # single block is waited for whole (the test above).
    doc = list(range(4 * 40 + 1))
    with make(l1=48, l2=48, l3=[on_disk(tmp_path, doc)]) as cache:
        slow_disk(cache, 0.01)
        plan = cache.plan(doc, budget=10_000, recompute_seconds_per_token=0.02 / 4)  # 20 ms a block
        assert plan.fetch is None and plan.tail is not None
        assert 13 <= plan.tail[0] <= 15 and plan.tail[1] == 40 and plan.adopt_at == 4 * plan.tail[0]
