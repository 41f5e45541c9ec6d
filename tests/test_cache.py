"""TieredKVCache behaviour that the state machine does not pin down: tiers, write policies,
tenant isolation, collisions, errors."""

import pytest
import torch

from prefix_kv import prefix_kv, write_into_slots
from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.errors import CacheFullError, ConfigError, OutOfMemoryError, ShapeError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)
BPB = LAYOUT.bytes_per_block


def make(l1=8, l2=0, **kw) -> TieredKVCache:
    return TieredKVCache(LAYOUT, CacheConfig(l1=l1 * BPB, l2=l2 * BPB, **kw), device="cpu", model="cache-test")


def store(cache, tokens, salt=None):
    return cache.store(tokens, prefix_kv(LAYOUT, tokens, salt), salt)


def test_store_retrieve_round_trip_and_the_last_token_rule():
    cache = make()
    tokens = list(range(10))  # two full blocks and a partial one
    assert store(cache, tokens) == 8
    m = cache.match(tokens)
    assert (m.tokens, m.by_tier) == (8, {"l1": 8, "l2": 0, "l3": 0})
    n, kv = cache.retrieve(tokens)
    assert n == 8 and torch.equal(kv, prefix_kv(LAYOUT, tokens)[:, :, :8])
    # a prompt of exactly 8 tokens may reuse only 4: its last token must be computed for logits
    assert cache.match(tokens[:8]).tokens == 4
    assert cache.match(tokens[:8], limit=8).tokens == 8
    # a different continuation shares only the first block
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9, 9]).tokens == 4
    assert cache.match([1] + tokens[1:]).tokens == 0  # a match never counts past the first missing block


def test_salts_isolate_tenants():
    cache = make()
    tokens = list(range(13))
    store(cache, tokens, salt="a")
    assert cache.match(tokens, "a").tokens == 12
    assert cache.match(tokens, "b").tokens == 0
    assert cache.match(tokens).tokens == 0


def test_models_and_tp_ranks_do_not_share():
    a = TieredKVCache(LAYOUT, CacheConfig(l1=8 * BPB), device="cpu", model="m1")
    b_hashes = TieredKVCache(LAYOUT, CacheConfig(l1=8 * BPB), device="cpu", model="m2").namespace()
    c_hashes = TieredKVCache(LAYOUT, CacheConfig(l1=8 * BPB), device="cpu", model="m1", tp_rank=1).namespace()
    assert len({a.namespace(), b_hashes, c_hashes}) == 3


def test_l1_eviction_demotes_to_l2_and_l2_hits_load_back():
    cache = make(l1=3, l2=8, write_policy="write_back")
    first, second = list(range(9)), list(range(100, 113))
    store(cache, first)
    assert cache.stats()["tiers"]["l2"]["used_blocks"] == 0  # write-back: nothing copied yet
    store(cache, second)  # L1 holds 3 blocks: the first prompt's blocks are demoted
    assert cache.match(first).by_tier == {"l1": 0, "l2": 8, "l3": 0}
    n, kv = cache.retrieve(first)
    assert n == 8 and torch.equal(kv, prefix_kv(LAYOUT, first)[:, :, :8])
    seq = cache.allocate(first)  # loads the L2 hits into fresh L1 blocks
    assert seq.num_cached_tokens == 8
    assert cache.match(first).by_tier["l1"] == 8
    cache.free(seq)
    stats = cache.stats()["tiers"]
    assert stats["l1"]["evictions"] >= 2 and stats["l2"]["blocks_out"] >= 2


def test_l2_gives_up_its_copies_of_l1_blocks_before_blocks_it_alone_holds():
    """A block loaded up from L2 stays in L2 too; when L2 needs room, that copy goes before a
    block that L2 alone holds (which LRU would take: it was used longer ago), so L1 and L2
    together keep every prefix."""
    cache = make(l1=12, l2=8, write_policy="write_back")
    a, b, c = (list(range(k, k + 17)) for k in (0, 100, 200))  # 4 full blocks each
    store(cache, a)
    store(cache, b)
    cache.evict("l1")  # L2 (8 blocks) now holds a and b; L1 nothing
    for _ in range(2):  # a is loaded up (L1 and L2 hold it), then used again: the most recent
        cache.free(cache.allocate(a))
        if _ == 0:
            store(cache, c)
    store(cache, list(range(300, 333)))  # 8 blocks: L1 demotes c, the least recent, into a full L2
    assert cache.match(a).by_tier == {"l1": 16, "l2": 0, "l3": 0}
    assert cache.match(b).by_tier == {"l1": 0, "l2": 16, "l3": 0}  # LRU alone would have dropped b
    assert cache.match(c).by_tier == {"l1": 0, "l2": 16, "l3": 0}
    assert cache.stats()["tiers"]["l2"]["drops"] == 0  # a's L2 copy went; L1 still has a


def test_l2_gives_up_the_least_recently_used_of_its_copies_of_l1_blocks_first():
    """Among L2's copies of L1 blocks, the one used longest ago goes first: a prefix in use keeps
    its copy (and a router fed by KV events is not told it left a tier while it is hot)."""
    cache = make(l1=16, l2=8, write_policy="write_through")
    a, b, c = (list(range(k, k + 17)) for k in (0, 100, 200))
    store(cache, a)
    store(cache, b)  # L1 holds a and b, L2 their copies (full): a's made first
    cache.free(cache.allocate(a))  # a is used again
    store(cache, c)  # written through: L2 makes room from its copies, b's (used longest ago)
    in_l2 = lambda tokens: [e.l2 >= 0 for e in cache.match(tokens).blocks]  # noqa: E731
    assert in_l2(a) == [True] * 4 and in_l2(b) == [False] * 4 and in_l2(c) == [True] * 4


def test_a_block_leaving_l1_keeps_its_l2_copy_while_others_are_demoted_beside_it():
    """Blocks evicted from L1 together: one whose L2 copy exists is no longer a copy of an L1
    block, so the room that the others' demotion needs comes from L2's policy, not from it."""
    cache = make(l1=8, l2=8, write_policy="write_back")
    a, b, c = (list(range(k, k + 17)) for k in (0, 100, 200))
    store(cache, a)
    store(cache, b)
    cache.evict("l1")
    cache.free(cache.allocate(a))  # a: in L1 and L2, and the most recent in both
    store(cache, c)
    cache.evict("l1")  # a leaves L1 (its L2 copy stays), c is demoted: b, the least recent, goes
    assert cache.match(a).by_tier == {"l1": 0, "l2": 16, "l3": 0}
    assert cache.match(c).by_tier == {"l1": 0, "l2": 16, "l3": 0}
    assert cache.match(b).tokens == 0


def test_write_through_copies_at_once_and_eviction_drops_nothing():
    cache = make(l1=2, l2=8, write_policy="write_through")
    store(cache, list(range(9)))
    assert cache.stats()["tiers"]["l2"]["used_blocks"] == 2
    store(cache, list(range(100, 109)))
    assert cache.stats()["tiers"]["l1"]["drops"] == 0


def test_selective_copies_down_only_blocks_that_were_reused():
    cache = make(l1=3, l2=8, write_policy="selective", selective_min_hits=1)
    reused, once = list(range(9)), list(range(50, 59))
    store(cache, reused)
    cache.free(cache.allocate(reused))  # one reuse: copied down now
    assert cache.stats()["tiers"]["l2"]["used_blocks"] == 2
    store(cache, once)
    store(cache, list(range(100, 113)))  # pushes both out of L1
    assert cache.match(reused).by_tier["l2"] == 8
    assert cache.match(once).tokens == 0  # never reused: dropped, not copied


def test_pinned_blocks_survive_pressure_and_full_l1_raises():
    cache = make(l1=4)
    tokens = list(range(13))
    seq = cache.allocate(tokens)  # 4 blocks: all of L1
    write_into_slots(cache, seq, tokens, 0)
    cache.commit(seq, tokens)
    assert store(cache, list(range(200, 209))) == 0  # nothing evictable: store keeps nothing
    with pytest.raises(CacheFullError):
        cache.allocate(list(range(300, 305)))
    with pytest.raises(CacheFullError):
        cache.append(seq, 4)
    assert cache.match(tokens, limit=13).tokens == 12
    cache.free(seq)
    assert store(cache, list(range(200, 209))) == 8  # now evictable: tail-first eviction makes room


def test_shared_prefix_is_pinned_once_per_sequence_and_freed():
    cache = make(l1=8)
    prompt = list(range(9))
    a = cache.allocate(prompt)
    write_into_slots(cache, a, prompt, 0)
    cache.commit(a, prompt)
    b = cache.allocate(prompt + [42, 43])
    assert b.num_cached_tokens == 8 and b.slots[:2] == a.slots[:2]
    assert [e.ref for e in a.entries[:2]] == [2, 2]
    cache.free(a)
    cache.free(b)
    assert all(e.ref == 0 for e in cache.index.entries.values())
    with pytest.raises(ValueError, match="already freed"):
        cache.free(a)


def test_duplicate_commit_stays_private():
    cache = make(l1=8)
    prompt = list(range(8))
    a, b = cache.allocate(prompt), cache.allocate(prompt)  # both miss: computed twice
    for seq in (a, b):
        write_into_slots(cache, seq, prompt, 0)
        cache.commit(seq, prompt)
    assert a.entries[0] is not None and b.entries[0] is None  # b's copy is private
    cache.free(b)
    assert len(cache.l1.free) == 8 - 2  # b's private blocks went straight back


def test_a_hash_collision_is_a_miss_not_someone_elses_kv():
    cache = make()
    tokens = list(range(8))
    store(cache, tokens)
    entry = cache.match(tokens, limit=8).blocks[0]
    entry.tokens = bytes(len(entry.tokens))  # as if another block had produced the same hash
    m = cache.match(tokens, limit=8)
    assert m.tokens == 0
    assert cache.stats()["collisions"] >= 1


def test_block_table_pads_with_minus_one():
    cache = make(l1=8)
    a, b = cache.allocate(list(range(9))), cache.allocate(list(range(50, 53)))
    table = cache.block_table([a, b])
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    assert table[0].tolist() == a.slots and table[1].tolist() == b.slots + [-1, -1]


def test_a_stored_prompt_gives_way_tail_first_where_its_head_was_cached_before():
    # as after free(): the head goes last, so pressure leaves a shorter hit rather than none
    cache = make(l1=8)
    doc = list(range(100, 132))  # 8 full blocks
    store(cache, doc[:12])  # its first three
    store(cache, doc)  # the other five join them: all of L1
    store(cache, list(range(500, 524)))  # 6 blocks of another prompt evict 6 of doc's
    assert cache.match(doc).tokens == 2 * LAYOUT.block_size


def test_store_rejects_wrong_shape_and_dtype_naming_the_expected_shape():
    cache = make()
    tokens = list(range(8))
    with pytest.raises(ShapeError, match=r"\(3, 2, 8, 2, 4\)"):
        cache.store(tokens, torch.zeros(3, 2, 7, 2, 4, dtype=torch.float16))
    with pytest.raises(ShapeError, match="float16"):
        cache.store(tokens, torch.zeros(3, 2, 8, 2, 4, dtype=torch.float32))


def test_too_much_memory_fails_at_construction_with_sizes():
    with pytest.raises(OutOfMemoryError, match=r"CacheConfig.l1 asks for .* GiB but this host has .* GiB available"):
        TieredKVCache(LAYOUT, CacheConfig(l1="1000TiB"), device="cpu")
    with pytest.raises(OutOfMemoryError, match="CacheConfig.l2"):
        TieredKVCache(LAYOUT, CacheConfig(l1=BPB, l2="1000TiB"), device="cpu")
    with pytest.raises(ConfigError, match="holds no block"):
        TieredKVCache(LAYOUT, CacheConfig(l1=BPB - 1), device="cpu")


def test_stats_count_hits_where_blocks_are_taken_by_the_tier_each_comes_from():
    # Hits count where a lookup is used (allocate, retrieve), by the tier each block comes from;
    # a lookup alone (a scheduler repeats one for a prompt that waits) counts nothing.
    cache = make(l1=4, l2=8, write_policy="write_back")
    store(cache, list(range(9)))
    for _ in range(3):
        cache.match(list(range(9)))
    assert cache.stats()["queries"] == 0 and cache.stats()["hit_tokens"] == 0
    assert cache.retrieve(list(range(9)))[0] == 8  # from L1
    store(cache, list(range(100, 117)))  # four blocks: the first prompt goes down to L2
    seq = cache.allocate(list(range(9)))  # loaded from L2
    assert seq.num_cached_tokens == 8
    cache.free(seq)
    s = cache.stats()
    assert s["queries"] == 2 and s["query_tokens"] == 16 and s["hit_tokens"] == 16
    assert s["tiers"]["l1"]["hit_tokens"] == 8 and s["tiers"]["l2"]["hit_tokens"] == 8
    assert s["hit_rate"] == 1.0


def test_an_l3_prefix_read_up_through_l2_counts_once_as_an_l3_hit(tmp_path):
    # Found in L3, read into L2, found again there: one hit, from L3 (it once counted in both).
    # Used again later, the same blocks count where they are then: L2.
    first = make(l1=8, l2=8, l3=[f"file://{tmp_path}"])
    store(first, list(range(9)))
    assert first.flush(timeout=30)
    first.close()
    cache = make(l1=8, l2=8, l3=[f"file://{tmp_path}"])
    assert cache.retrieve(list(range(9)))[0] == 8
    tiers = cache.stats()["tiers"]
    assert (tiers["l1"]["hit_tokens"], tiers["l2"]["hit_tokens"], tiers["l3"]["hit_tokens"]) == (0, 0, 8)
    assert cache.retrieve(list(range(9)))[0] == 8
    s = cache.stats()
    assert (s["tiers"]["l2"]["hit_tokens"], s["tiers"]["l3"]["hit_tokens"], s["hit_tokens"]) == (8, 8, 16)
    cache.close()


def test_evict_empties_a_tier_into_the_next_one_down(tmp_path):
    cache = make(l1=8, l2=8, write_policy="write_back", l3=[f"file://{tmp_path}"])
    tokens = list(range(21))  # 5 full blocks
    store(cache, tokens)
    cache.evict("l1")  # write-back: the blocks are copied down now, as eviction would
    assert cache.match(tokens).by_tier == {"l1": 0, "l2": 20, "l3": 0}
    cache.evict("l2")  # L3 admits them: they are written there before L2 lets go
    assert cache.flush(timeout=30)
    cache.evict("l2")
    m = cache.match(tokens)
    assert m.by_tier == {"l1": 0, "l2": 0, "l3": 20}
    n, kv = cache.retrieve(tokens)
    assert n == 20 and torch.equal(kv, prefix_kv(LAYOUT, tokens)[:, :, :20])
    with pytest.raises(ValueError, match="'l1' or 'l2'"):
        cache.evict("l3")
    cache.close()


def test_evict_keeps_what_a_running_sequence_holds():
    cache = make(l1=8, l2=8)
    tokens = list(range(17))
    seq = cache.allocate(tokens)
    write_into_slots(cache, seq, tokens, 0)
    cache.commit(seq, tokens)
    cache.evict("l1")
    assert cache.match(tokens).by_tier["l1"] == 16  # pinned by the sequence
    cache.free(seq)
    cache.evict("l1")
    assert cache.match(tokens).by_tier == {"l1": 0, "l2": 16, "l3": 0}


def test_evicting_l2_first_takes_in_the_l3_writes_that_have_ended(tmp_path):
    """Issue 37 item 14: blocks whose L3 write had ended, but had not been taken in, stayed in L2."""
    cache = make(l1=4, l2=32, write_policy="write_through", l3=[f"file://{tmp_path}"])
    tokens = list(range(81))  # 20 full blocks: 4 in L1, every one in L2 and on its way to L3
    store(cache, tokens)
    # L3 writes run one after another on one thread: once this no-op has run, every write has ended
    cache.tiers.l3._writer.submit(lambda: None).result()
    cache.evict("l1")
    cache.evict("l2")
    assert cache.match(tokens).by_tier == {"l1": 0, "l2": 0, "l3": 80}
    assert cache.stats()["tiers"]["l2"]["used_blocks"] == 0
    cache.close()
