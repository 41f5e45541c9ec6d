"""L1 slots freed while a copy is still at them (tierkv/tiering.py: `take_l1`, `_evict_l1`).

An evicted block whose save to L2 is still in flight leaves its slot to the next taker. A load
may take it at once (its copy runs after the save on the copy stream), so such slots go to loads
first, and the compute stream waits for the save only where it takes one of them itself. On a
CPU every copy ends before it returns, so these tests stand a copy still in flight in for it.
"""

import torch

from prefix_kv import prefix_kv
from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.recorded_moves import FENCE
from tierkv.transfer import Transfer

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)
BPB = LAYOUT.bytes_per_block


class InFlight(Transfer):
    """A copy in flight until the test ends it; counts the streams ordered after it."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        self.ended = False

    def done(self) -> bool:
        return self.ended

    def wait(self) -> None:
        self.waits += 1


def cache_with_saves_in_flight(l1_blocks: int = 8):
    """A cache whose L1 is full of one stored prompt's blocks, each still being saved to L2."""
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=l1_blocks * BPB, l2=4 * l1_blocks * BPB), device="cpu",
                          model="evicted-slots")
    tokens = list(range(l1_blocks * LAYOUT.block_size))
    cache.store(tokens, prefix_kv(LAYOUT, tokens))
    save = InFlight()
    entries = [e for e in cache.index.entries.values() if e.l1 >= 0]
    assert len(entries) == l1_blocks and not cache.l1.free
    for e in entries:
        e.reading = save
    return cache, save, sorted(e.l1 for e in entries)


def test_slots_a_save_is_still_reading_go_to_loads_without_a_wait():
    cache, save, slots = cache_with_saves_in_flight()
    taken = cache.tiers.take_l1(3, loads=3)
    assert len(taken) == 3 and set(taken) <= set(slots)
    assert save.waits == 0  # the loads queue behind the save on the copy stream
    assert not any(s in cache.tiers._busy for s in taken)


def test_the_compute_stream_waits_for_the_save_only_for_the_slots_it_takes():
    cache, save, slots = cache_with_saves_in_flight()
    cache.evict("l1")  # every block leaves L1 (into L2, where it is): all eight slots are the save's
    assert sorted(cache.tiers._busy) == slots and save.waits == 0
    assert len(cache.tiers.take_l1(2, loads=2)) == 2 and save.waits == 0
    cache.tiers.take_l1(1)  # the compute stream writes it
    assert save.waits == 1 and len(cache.tiers._busy) == 5
    taken = cache.tiers.take_l1(4, loads=1)  # one load, three slots the compute stream writes
    assert save.waits == 2 and len(cache.tiers._busy) == 1
    assert not set(taken) & set(cache.tiers._busy)


def test_slots_no_copy_is_at_need_no_wait_and_keep_the_free_lists_order():
    cache, save, slots = cache_with_saves_in_flight()
    first = cache.tiers.take_l1(2, loads=2)
    cache.tiers.give_l1(first)  # private slots given back: no copy at them
    again = cache.tiers.take_l1(2)
    assert again == sorted(first) and save.waits == 0
    # a load part and a compute part, each ascending (runs of neighbours for the DMAs)
    mixed = cache.tiers.take_l1(5, loads=2)
    assert mixed[:2] == sorted(mixed[:2]) and mixed[2:] == sorted(mixed[2:]) and save.waits == 1


def test_tensor_parallel_ranks_are_told_to_fence_where_the_compute_stream_waited():
    # the other ranks replay rank 0's moves, not its waits: a copy within L1 (fork) into a slot the
    # save still reads must come after the save there too
    cache, save, slots = cache_with_saves_in_flight()
    cache.evict("l1")
    cache.tiers.moves = []  # rank 0 records its moves from here
    cache.tiers.take_l1(2, loads=2)
    assert FENCE not in [kind for kind, _, _ in cache.tiers.moves]
    cache.tiers.take_l1(1)
    assert [kind for kind, _, _ in cache.tiers.moves] == [FENCE] and save.waits == 1


def test_the_compute_streams_waits_are_counted_by_the_copy_they_wait_for():
    # a save still reading an evicted block, or a load still writing one (a warmed block evicted
    # before it landed): /metrics tells them apart (tierkv_l1_slot_waits{copy})
    cache, save, slots = cache_with_saves_in_flight()
    load = InFlight()
    loading = next(e for e in cache.index.entries.values() if e.l1 == slots[-1])
    loading.loading = load
    cache.evict("l1")
    cache.tiers.take_l1(len(slots))  # the compute stream writes all of them
    stats = cache.stats()
    assert stats["slot_waits_on_saves"] == len(slots) - 1 and stats["slot_waits_on_loads"] == 1
    assert save.waits == 1 and load.waits == 1
    cache.tiers.take_l1(0)
    assert cache.stats()["slot_waits_on_saves"] == len(slots) - 1  # nothing more waited


def test_l1_keeps_spare_slots_free_and_the_compute_stream_takes_one_whose_save_ended():
    # 128 slots: 2 spare. The first take evicts them ahead of need (their saves start); once those
    # end, a slot the compute stream takes comes from them, not from the eviction it causes (whose
    # save queues behind every load on the copy stream)
    cache, first, slots = cache_with_saves_in_flight(128)
    assert cache.tiers.spare == 128 // 64 == 2
    assert cache.tiers.take_l1(0) == [] and len(cache.l1.free) == 2
    spares = sorted(cache.tiers._busy)
    assert len(spares) == 2 and first.waits == 0
    later = InFlight()
    for e in cache.index.entries.values():
        if e.l1 >= 0:
            e.reading = later
    first.ended = True
    taken = cache.tiers.take_l1(1)  # evicts one more (its save: `later`), takes a spare instead
    assert taken[0] in spares and later.waits == first.waits == 0
    evicted = set(cache.tiers._busy) - set(spares)  # free again, its save still running
    assert len(cache.l1.free) == 2 and len(evicted) == 1 and taken[0] not in cache.tiers._busy
    assert cache.stats()["slot_waits_on_saves"] == 0
    # a load takes a slot whose save is running (the one it evicts) without a wait
    loaded = cache.tiers.take_l1(1, loads=1)
    assert later.waits == 0 and loaded[0] not in evicted | set(spares) and loaded[0] not in cache.tiers._busy


def test_with_no_spare_whose_save_ended_the_compute_stream_waits_for_its_own_slots():
    cache, first, slots = cache_with_saves_in_flight(128)
    cache.tiers.take_l1(0)
    taken = cache.tiers.take_l1(3)  # every free slot's save is still running
    assert first.waits == 1 and cache.stats()["slot_waits_on_saves"] == 3
    assert not set(taken) & set(cache.tiers._busy) and len(cache.l1.free) == 2


def test_no_spare_without_an_l2_to_save_evictions_to():
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=128 * BPB, l2=0), device="cpu", model="evicted-slots")
    assert cache.tiers.spare == 0
