"""The block-level protocol (tierkv/lookup.py, admission.py, paged.py) under misuse: every wrong call is an error that says
what to change and leaves the cache as it was, never a wrong answer; and `admit` brings a prompt
in from every tier, L3 included, so that the sequence and the lookup never disagree."""

import logging

import numpy as np
import pytest
import torch

from prefix_kv import prefix_kv, read_slots, write_into_slots
from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.errors import ConfigError, ShapeError, UsageError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)
BPB = LAYOUT.bytes_per_block


def make(l1=16, l2=16, l3=(), model="paged-test", **kw) -> TieredKVCache:
    return TieredKVCache(LAYOUT, CacheConfig(l1=l1 * BPB, l2=l2 * BPB, l3=list(l3), **kw), device="cpu", model=model)


def store(cache, tokens, salt=None):
    return cache.store(tokens, prefix_kv(LAYOUT, tokens, salt), salt)


def held(cache) -> tuple:
    """Everything a wrong call must leave as it was: slots in use, index entries and their pins."""
    s = cache.stats()["tiers"]
    pins = sorted((e.hash, e.ref, e.held, e.l1, e.l2) for e in cache.index.entries.values())
    return s["l1"]["used_blocks"], s["l2"]["used_blocks"], len(cache.index), pins


def test_allocate_refuses_a_match_of_other_tokens_or_another_salt():
    cache = make()
    a, b = list(range(33)), list(range(100, 133))
    store(cache, a)
    before = held(cache)
    with pytest.raises(UsageError, match="other tokens"):
        cache.allocate(b, match=cache.match(a))
    with pytest.raises(UsageError, match="another salt"):
        cache.allocate(a, "tenant-b", match=cache.match(a))
    with pytest.raises(UsageError, match="not made by this cache"):
        cache.allocate(a, match=make().match(a))
    assert held(cache) == before
    # the right match, given with or without its tokens, is taken
    seq = cache.allocate(a, match=cache.match(a))
    assert seq.num_cached_tokens == 32 and torch.equal(read_slots(cache, seq, 32), prefix_kv(LAYOUT, a)[:, :, :32])
    cache.free(seq)
    assert cache.allocate(None, match=cache.match(b)).num_cached_tokens == 0


def test_append_commit_and_free_refuse_a_freed_sequence_and_leak_nothing():
    cache = make()
    prompt = list(range(10))
    seq = cache.allocate(prompt)
    cache.free(seq)
    free_l1 = len(cache.l1.free)
    for call in (lambda: cache.append(seq, 8), lambda: cache.commit(seq, prompt), lambda: cache.free(seq),
                 lambda: cache.can_append(seq), lambda: cache.block_table([seq]), lambda: cache.adopt(seq, prompt),
                 lambda: cache.fork(seq, 2, 8), lambda: cache.offload(seq, 1)):
        with pytest.raises(UsageError, match="already freed"):
            call()
    assert len(cache.l1.free) == free_l1 == cache.l1.num_blocks
    with pytest.raises(UsageError, match="did not allocate"):
        make().append(cache.allocate(prompt), 1)
    with pytest.raises(UsageError, match=">= 0"):
        cache.append(cache.allocate(prompt), -3)


def test_commit_refuses_tokens_that_do_not_extend_the_sequence():
    cache = make()
    prompt = list(range(16))
    seq = cache.allocate(prompt)
    write_into_slots(cache, seq, prompt, 0)
    before = held(cache)
    other = list(range(50, 66))
    with pytest.raises(UsageError, match="position 0 that differs"):
        cache.commit(seq, other)
    with pytest.raises(UsageError, match="position 9 that differs"):
        cache.commit(seq, prompt[:9] + [99, 99, 99] + prompt[12:])
    assert held(cache) == before  # nothing entered the index under the prompt's hashes
    # the prompt was not poisoned: storing it keeps it, and a later commit of the right tokens works
    assert cache.commit(seq, prompt[:8]) == 2
    with pytest.raises(UsageError, match="position 10 that differs"):
        cache.commit(seq, prompt[:10] + [99] + prompt[11:])
    assert cache.commit(seq, prompt + [1, 2]) == 2
    cache.append(seq, 6)  # generated tokens extend it
    assert cache.commit(seq, prompt + [1, 2, 3, 4, 5, 6]) == 1
    cache.free(seq)
    assert cache.match(prompt, limit=16).tokens == 16
    assert torch.equal(cache.retrieve(prompt, limit=16)[1], prefix_kv(LAYOUT, prompt))


def test_an_l3_without_a_model_name_refuses_to_start(tmp_path):
    with pytest.raises(ConfigError, match="needs model="):
        make(l3=[f"file://{tmp_path}"], model="")
    make(model="")  # without an L3 nothing is shared between processes: no name needed


def test_two_models_of_one_layout_never_read_each_others_l3_blocks(tmp_path):
    url = f"file://{tmp_path}"
    tokens = list(range(41))
    with make(l3=[url], model="model-a") as a:
        store(a, tokens)
    with make(l3=[url], model="model-b") as b:
        assert b.match(tokens).tokens == 0
    with make(l3=[url], model="model-a") as a_again:
        assert a_again.match(tokens).by_tier["l3"] == 40


@pytest.mark.parametrize("policy", ["write_back", "selective"])
def test_close_and_with_write_what_the_write_policy_owes_l3(tmp_path, policy):
    url = f"file://{tmp_path}"
    prompt = list(range(33))
    with make(l3=[url], write_policy=policy, selective_min_hits=1) as cache:
        seq = cache.allocate(prompt)
        write_into_slots(cache, seq, prompt, 0)
        cache.commit(seq, prompt)
        cache.free(seq)
        if policy == "selective":
            cache.free(cache.allocate(prompt))  # one reuse: now the policy admits the blocks
        assert cache.stats()["tiers"]["l3"]["blocks_in"] == 0  # nothing was written down yet
    with make(l3=[url]) as restarted:
        assert restarted.match(prompt).by_tier["l3"] == 32
        n, kv = restarted.retrieve(prompt)
        assert n == 32 and torch.equal(kv, prefix_kv(LAYOUT, prompt)[:, :, :32])


def test_close_logs_what_it_could_not_write(caplog):
    # nothing listens on port 1: every write fails at once (a dead L3 slows, never breaks)
    cache = make(l3=["redis://127.0.0.1:1/0?timeout=0.2&connect_timeout=0.2"], write_policy="write_back")
    store(cache, list(range(17)))
    with caplog.at_level(logging.WARNING, logger="tierkv.tiering"):
        cache.close(timeout=5)
    assert any("4 blocks (16 tokens)" in r.getMessage() and "could not be written" in r.getMessage()
               for r in caplog.records)


def test_admit_brings_the_l3_part_in_so_the_sequence_starts_where_the_match_says(tmp_path):
    url = f"file://{tmp_path}"
    prompt = list(range(45))
    with make(l3=[url]) as first:
        store(first, prompt)
    with make(l3=[url]) as restarted:  # a new process: empty L1 and L2, the same disk
        found = restarted.match(prompt)
        assert found.by_tier == {"l1": 0, "l2": 0, "l3": 44}
        # allocate uses what L1 and L2 hold now: the L3 part is not in the sequence
        plain = restarted.allocate(prompt)
        assert plain.num_cached_tokens == 0
        restarted.free(plain)
        seq = restarted.admit(prompt)
        assert seq.num_cached_tokens == found.tokens == 44
        seq.wait()
        assert torch.equal(read_slots(restarted, seq, 44), prefix_kv(LAYOUT, prompt)[:, :, :44])
        # the rest is the engine's to compute, in slots already reserved
        assert seq.num_tokens == 45 and len(seq.slots) == restarted.blocks_needed(45)


def test_admit_recomputes_what_l3_cannot_deliver_in_time(tmp_path):
    url = f"file://{tmp_path}"
    prompt = list(range(45))
    with make(l3=[url]) as first:
        store(first, prompt)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            path.write_bytes(b"\0" * path.stat().st_size)  # damaged objects: every read is a miss
    with make(l3=[url]) as restarted:
        seq = restarted.admit(prompt, deadline_s=2)
        assert seq.num_cached_tokens == 0  # a miss, never wrong data
        assert restarted.stats()["tiers"]["l3"]["errors"] > 0


def test_the_kv_shape_check_names_axes_even_with_two_layers():
    two = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)
    cache = TieredKVCache(two, CacheConfig(l1=8 * two.bytes_per_block), device="cpu", model="two")
    tokens = list(range(8))
    kv = prefix_kv(two, tokens)  # [2 layers, 2, 8, 2, 4]
    with pytest.raises(ShapeError, match=r"pass the pair \(k, v\)"):
        cache.store(tokens, kv)  # [2, 2, ...] could be [layers, K/V] or [K/V, layers]
    with pytest.raises(ShapeError, match="pair"):
        cache.store(tokens, (kv[:, 0], kv[:, 1, :7]))
    assert cache.store(tokens, (kv[:, 0], kv[:, 1])) == 8
    assert torch.equal(cache.retrieve(tokens, limit=8)[1], kv)
    assert len(cache.index) == 2


def test_kvlayout_takes_numpy_integers():
    layout = KVLayout(num_layers=np.int64(3), num_kv_heads=np.int32(2), head_dim=np.uint16(4),
                      dtype=torch.float16, block_size=np.int64(4))
    assert layout == LAYOUT and type(layout.num_layers) is int
    assert layout.fingerprint == LAYOUT.fingerprint
    with pytest.raises(ConfigError, match="positive int"):
        KVLayout(num_layers=2.0, num_kv_heads=2, head_dim=4)
    with pytest.raises(ConfigError, match="positive int"):
        KVLayout(num_layers=True, num_kv_heads=2, head_dim=4)


def test_admit_waits_for_l2_room_held_by_blocks_on_their_way_to_l3(tmp_path):
    """Under write-back an L2 full of blocks L3 lacks has no room for an L3 read until their writes
    end: admit waits for them (within its deadline) instead of recomputing the hit. (Found by the
    API state machine: L1 3 blocks, L2 2, a disk.)"""
    url = f"file://{tmp_path}"
    with make(l1=3, l2=2, l3=[url], write_policy="write_back") as first:
        store(first, [0, 1, 2, 3, 4])
    with make(l1=3, l2=2, l3=[url], write_policy="write_back") as cache:
        store(cache, list(range(50, 70)))  # fills L1 and L2 with blocks owed to L3
        prompt = [0, 1, 2, 3, 4, 5]
        assert cache.match(prompt).by_tier["l3"] == 4
        seq = cache.admit(prompt, deadline_s=30)
        assert seq.num_cached_tokens == 4
        assert torch.equal(read_slots(cache, seq, 4), prefix_kv(LAYOUT, prompt)[:, :, :4])


def test_a_layer_by_layer_save_copies_each_group_once_its_last_layer_is_written():
    # Eight layers go down in groups of two (transfer.LAYER_GROUPS = 4): a group is copied once
    # its last layer is saved, and commit copies the rest, so that L2 ends up with every layer.
    from tierkv.transfer import LAYER_GROUPS

    layout = KVLayout(num_layers=8, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)
    assert LAYER_GROUPS == 4
    cache = TieredKVCache(layout, CacheConfig(l1=16 * layout.bytes_per_block, l2=16 * layout.bytes_per_block,
                                              write_policy="write_through"), device="cpu", model="groups")
    tokens = list(range(13))  # 3 full blocks
    seq = cache.admit(tokens)
    write_into_slots(cache, seq, tokens, 0)
    cache.l2.kv.zero_()  # nothing in L2 yet: what is not copied stays zero
    want = prefix_kv(layout, tokens)[:, :, :12].reshape(8, 2, 3, 4, 2, 4).transpose(1, 2)  # [L, 3, 2, bs, H, D]
    for layer in range(5):  # the forward stops after layer 4, halfway through the third group
        cache.save_layer(layer, [seq])
    slots = seq.saving.l2_slots
    got = cache.l2.kv[torch.tensor(slots)].transpose(0, 1)  # [L, 3, 2, bs, H, D]
    assert torch.equal(got[:4], want[:4])  # groups 0-1 and 2-3 are down
    assert not got[4:].any()  # layer 4 waits for layer 5, the end of its group
    assert cache.commit(seq, tokens) == 3
    assert [e.l2 for e in seq.entries[:3]] == slots  # entered where the save put them
    assert torch.equal(cache.l2.kv[torch.tensor(slots)].transpose(0, 1), want)
    assert cache.stats()["tiers"]["l2"]["blocks_in"] == 3
    cache.free(seq)
    cache.close()


def test_slot_of_a_position_without_room_says_to_append():
    cache = make()
    seq = cache.allocate(list(range(6)))  # room for positions 0..5, in two blocks of 4
    assert [seq.slot_of(p, 4) for p in (0, 5)] == [seq.slots[0] * 4, seq.slots[1] * 4 + 1]
    for past in (6, 8, 100, -1):  # 6 and 7 lie in the last block, but no room was made for them
        with pytest.raises(UsageError, match=r"room for positions 0\.\.5; append\(\)"):
            seq.slot_of(past, 4)
    cache.append(seq, 3)
    assert seq.slot_of(8, 4) == seq.slots[2] * 4
    assert cache.offload(seq, 1) == 1  # block 0 streams from L2 now
    with pytest.raises(UsageError, match="offloaded to L2"):
        seq.slot_of(3, 4)


def test_admit_says_which_tier_served_each_part_of_the_hit(tmp_path):
    url = f"file://{tmp_path}"
    prompt = list(range(14))  # blocks 0-2 can be hit: the last token is computed
    with make(l3=[url]) as first:
        store(first, prompt)
    with make(l3=[url]) as cache:  # a new process: L3 holds the three blocks
        store(cache, prompt[:9])  # blocks 0 and 1 in L1 (and L2, write-through)
        cache.evict("l1")
        cache.free(cache.admit(prompt[:5]))  # block 0 back into L1; block 1 stays in L2 only
        assert cache.match(prompt).by_tier == {"l1": 4, "l2": 4, "l3": 4}
        seq = cache.admit(prompt)
        assert seq.num_cached_tokens == 12 and seq.cached_by_tier == {"l1": 4, "l2": 4, "l3": 4}
        seq.wait()
        assert torch.equal(read_slots(cache, seq, 12), prefix_kv(LAYOUT, prompt)[:, :, :12])
        cache.free(seq)
        assert cache.allocate(list(range(50, 60))).cached_by_tier == {"l1": 0, "l2": 0, "l3": 0}


def test_live_sequences_lists_what_was_allocated_and_not_freed():
    cache = make()
    assert cache.live_sequences() == []
    a, b = cache.allocate(list(range(9))), cache.admit(list(range(20, 29)))
    forks = cache.fork(a, 2, 9)
    assert cache.live_sequences() == [a, b, *forks]
    cache.free(a)
    cache.free(forks[1])
    assert cache.live_sequences() == [b, forks[0]]  # what a leak check finds still holding blocks
    for seq in cache.live_sequences():
        cache.free(seq)
    assert cache.live_sequences() == [] and len(cache.l1.free) == cache.l1.num_blocks
