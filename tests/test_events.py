"""Block events (tierkv/events.py): the bounded queue, and what the cache records in it as blocks
enter and leave L1, L2, a local disk L3 and a shared Redis L3, and when it is cleared."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from test_cache_state import DiskCacheMachine

import tierkv
from tierkv.events import CLEARED, CPU, GPU, REMOVED, STORED, BlockEvents, Medium
from tierkv.hashing import hash_blocks, token_bytes
from tierkv.tiers.codec import record_size

LAYOUT = tierkv.KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
BLOCK = LAYOUT.bytes_per_block


def kv(n: int) -> torch.Tensor:
    return torch.randn(3, 2, n, 2, 8)  # [layers, 2, tokens, kv_heads, head_dim]


def cache(l1_blocks: int, l2_blocks: int = 0, l3: tuple[str, ...] = (), **options) -> tierkv.TieredKVCache:
    config = tierkv.CacheConfig(l1=l1_blocks * BLOCK, l2=l2_blocks * BLOCK, l3=list(l3), **options)
    return tierkv.TieredKVCache(LAYOUT, config, device="cpu", model="test-model")


def by_kind(records, kind: int, medium: Medium) -> list[tuple]:
    return [r for r in records if r[0] == kind and r[1] == medium]


def test_a_full_queue_drops_its_oldest_record_and_counts_it():
    events = BlockEvents(max_records=3)
    for h in range(5):
        events.removed(GPU, h)
    assert [r[2] for r in events.take()] == [2, 3, 4]
    assert events.dropped == 2
    assert not events.take()  # taking empties it
    events.cleared()
    assert list(events.take()) == [(CLEARED,)] and events.dropped == 2


@given(st.integers(1, 8), st.lists(st.sampled_from(["stored", "removed", "cleared", "take"]), max_size=40))
def test_the_queue_keeps_the_newest_records_in_order(max_records, ops):
    events, queue, dropped = BlockEvents(max_records), [], 0  # `queue`: what it should hold
    for i, op in enumerate(ops):
        if op == "take":
            assert list(events.take()) == queue
            queue = []
            continue
        if op == "stored":
            events.stored(CPU, i, i - 1, b"\0" * 16)
            queue.append((STORED, CPU, i, i - 1, b"\0" * 16))
        elif op == "removed":
            events.removed(GPU, i)
            queue.append((REMOVED, GPU, i))
        else:
            events.cleared()
            queue.append((CLEARED,))
        if len(queue) > max_records:
            queue.pop(0)
            dropped += 1
    assert list(events.take()) == queue and events.dropped == dropped


def test_blocks_entering_and_leaving_l1_and_l2_are_recorded_with_their_chain_and_tokens():
    c = cache(l1_blocks=4, l2_blocks=8, write_policy="write_back")
    events = BlockEvents()
    c.listen(events)
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    c.store(tokens, kv(len(tokens)))
    hashes = hash_blocks(token_bytes(tokens), 4, c.namespace(None))
    stored = by_kind(events.take(), STORED, GPU)
    # (hash, parent, tokens) of each block, whatever order the cache entered them in
    assert sorted((r[2], r[3], r[4]) for r in stored) == sorted(
        (h, hashes[i - 1] if i else 0, token_bytes(tokens[4 * i : 4 * i + 4])) for i, h in enumerate(hashes))
    c.evict("l1")  # write-back: down to L2
    records = events.take()
    assert {r[2] for r in by_kind(records, REMOVED, GPU)} == set(hashes)
    assert {r[2] for r in by_kind(records, STORED, CPU)} == set(hashes)
    # loading them back is a store into L1 again, and no record leaves L2 (the copy stays)
    seq = c.allocate(tokens)
    records = events.take()
    assert {r[2] for r in by_kind(records, STORED, GPU)} == set(hashes) and not by_kind(records, REMOVED, CPU)
    c.free(seq)


def test_clear_is_refused_while_a_sequence_holds_blocks_then_drops_everything_as_one_record():
    c = cache(l1_blocks=8, l2_blocks=8)
    events = BlockEvents()
    c.listen(events)
    tokens = list(range(12))
    c.store(tokens, kv(12))
    seq = c.allocate(tokens)
    events.take()
    assert c.clear() is False and not events.take()
    assert c.match(tokens).tokens == 8  # nothing was dropped (the last block is left to compute)
    c.free(seq)
    assert c.clear() is True
    assert list(events.take()) == [(CLEARED,)]  # not one removal per block
    assert c.match(tokens).tokens == 0 and len(c.index) == 0
    assert c.stats()["tiers"]["l1"]["used_blocks"] == 0
    c.store(tokens, kv(12))  # the slots came back
    assert c.match(tokens).tokens == 8


def test_a_local_disk_l3_records_what_it_stored_and_what_it_evicted(tmp_path):
    # room for 3 one-block objects
    size = 3 * record_size(LAYOUT, 4096) + 100
    c = cache(l1_blocks=8, l2_blocks=8, l3=(f"file://{tmp_path}?size={size}",))
    events = BlockEvents()
    c.listen(events)
    tokens = list(range(50, 62))  # 3 blocks
    c.store(tokens, kv(12))
    assert c.flush(timeout=30)
    hashes = hash_blocks(token_bytes(tokens), 4, c.namespace(None))
    disk = Medium("STORAGE", "LOCAL")
    on_disk = by_kind(events.take(), STORED, disk)  # in the order the store's threads wrote them
    assert sorted(r[2:] for r in on_disk) == sorted(
        (h, hashes[i - 1] if i else 0, token_bytes(tokens[4 * i : 4 * i + 4])) for i, h in enumerate(hashes))
    c.store(list(range(90, 94)), kv(4))  # a 4th object: one of the first three goes
    assert c.flush(timeout=30)
    records = events.take()
    assert len(by_kind(records, STORED, disk)) == 1
    gone = by_kind(records, REMOVED, disk)
    assert len(gone) == 1 and gone[0][2] in hashes
    c.close()


def test_a_shared_redis_l3_marks_its_blocks_with_the_pool_they_are_in(redis_server):
    c = cache(l1_blocks=8, l2_blocks=8, l3=(redis_server.url + "?timeout=5",))
    events = BlockEvents()
    c.listen(events)
    c.store(list(range(8)), kv(8))
    assert c.flush(timeout=30)
    shared = [r for r in events.take() if r[0] == STORED and r[1].name == "STORAGE"]
    assert len(shared) == 2
    # every replica that opens the same URL names the pool alike; options and secrets stay out
    assert {r[1] for r in shared} == {Medium("STORAGE", "REMOTE", f"redis://127.0.0.1:{redis_server.port}/0")}
    c.close()


def test_nothing_is_recorded_without_a_listener_and_after_it_stops():
    c = cache(l1_blocks=8)
    events = BlockEvents()
    c.store(list(range(8)), kv(8))
    c.listen(events)
    c.listen(None)
    c.store(list(range(20, 28)), kv(8))
    assert not events.take()


class EventsCacheMachine(DiskCacheMachine):
    """The cache state machine (test_cache_state.py) with a listener: whatever the steps, a
    subscriber replaying the records holds exactly what each tier holds."""

    @rule()
    def clear(self):
        refused = any(e.ref for e in self.cache.index.entries.values())
        assert self.cache.clear() is not refused

    @invariant()
    def invariants(self):
        super().invariants()  # takes in the L3 writes first: every replay of an example sees the same
        if not hasattr(self, "events"):  # the first check comes right after build(): nothing is cached yet
            assert len(self.cache.index) == 0
            self.events = BlockEvents()
            self.cache.listen(self.events)
            self.seen: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        for rec in self.events.take():
            if rec[0] == CLEARED:
                self.seen["GPU"].clear()
                self.seen["CPU"].clear()
            elif rec[0] == STORED:
                self.seen[rec[1].name].add(rec[2])
            else:
                self.seen[rec[1].name].discard(rec[2])
        entries = self.cache.index.entries.values()
        assert self.seen["GPU"] == {e.hash for e in entries if e.l1 >= 0}
        assert self.seen["CPU"] == {e.hash for e in entries if e.l2 >= 0}
        disk = self.cache.tiers.l3.stores[0]
        assert self.seen["STORAGE"] == {int(name[:32], 16) for name in disk._lru}  # one block per object


TestEventsCacheMachine = EventsCacheMachine.TestCase
TestEventsCacheMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
