"""Eviction policies: each one's order, pins, and the shared contract (property-tested)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv.config import EVICTION_POLICIES
from tierkv.errors import ConfigError
from tierkv.policies import (
    ARCPolicy,
    BucketQueue,
    LFUPolicy,
    LRUPolicy,
    PriorityPolicy,
    S3FIFOPolicy,
    make_policy,
)


def drain(policy) -> list:
    out = []
    while (key := policy.evict()) is not None:
        out.append(key)
    return out


def test_lru_evicts_least_recently_used():
    p = LRUPolicy()
    for k in "abcd":
        p.insert(k)
    p.touch("a")  # a is now the most recent
    p.pin("b")
    p.unpin("b")  # an unpin counts as a use
    assert drain(p) == ["c", "d", "a", "b"]


def test_lru_never_evicts_pinned():
    p = LRUPolicy()
    p.insert("a", pinned=True)
    p.insert("b")
    p.pin("b")
    assert p.evict() is None and len(p) == 0
    p.unpin("a")
    assert p.evict() == "a"


def test_lfu_counts_hits_and_breaks_ties_by_age():
    p = LFUPolicy()
    for k in "abcd":
        p.insert(k)
    for k, hits in (("a", 3), ("b", 1), ("d", 1)):
        for _ in range(hits):
            p.touch(k)
    assert drain(p) == ["c", "b", "d", "a"]


def test_lfu_keeps_counts_across_pins():
    p = LFUPolicy()
    p.insert("hot")
    p.insert("cold")
    for _ in range(5):
        p.touch("hot")
    p.pin("hot")
    p.touch("hot")  # hits while pinned count too
    p.unpin("hot")
    assert p.evict() == "cold"


def test_priority_evicts_lowest_priority_then_lru():
    p = PriorityPolicy()
    p.insert("a", priority=5)
    p.insert("b", priority=0)
    p.insert("c", priority=5)
    p.insert("d", priority=0)
    p.touch("b")  # b becomes more recent than d within priority 0
    p.touch("d", priority=9)  # a hit from a higher-priority request lifts d
    assert drain(p) == ["b", "a", "c", "d"]


def replay(policy, accesses, capacity: int) -> set:
    """Run `accesses` through a cache of `capacity` blocks ordered by `policy`; return what stays resident."""
    resident = set()
    for k in accesses:
        if k in resident:
            policy.touch(k)
            continue
        if len(resident) >= capacity:
            resident.remove(policy.evict())
        policy.insert(k)
        resident.add(k)
    return resident


def test_s3fifo_keeps_reused_blocks_through_a_scan():
    hot = [("hot", k) for k in range(10)]
    accesses = hot + hot + [("scan", k) for k in range(200)]  # reused once, then a scan nobody reuses
    assert set(hot) <= replay(S3FIFOPolicy(), accesses, capacity=20)
    assert not set(hot) & replay(LRUPolicy(), accesses, capacity=20)  # LRU loses them all


def test_s3fifo_ghost_hit_goes_to_main():
    p = S3FIFOPolicy()
    p.insert("a")
    p.insert("b")
    assert p.evict() == "a"  # never hit: dropped, remembered in the ghost list
    p.insert("a")  # comes back: straight to main
    for k in range(20):
        p.insert(k)
    # small queue (b, 0..19) drains before anything in main
    assert "a" not in [p.evict() for _ in range(21)]
    assert p.evict() == "a"


def test_arc_keeps_reused_blocks_through_a_scan():
    hot = [("hot", k) for k in range(10)]
    accesses = hot + hot + [("scan", k) for k in range(200)]
    assert set(hot) <= replay(ARCPolicy(), accesses, capacity=20)  # the scan only cycles through T1


def test_arc_evicts_new_blocks_first_and_lru_within_a_list():
    p = ARCPolicy()
    for k in "abcd":
        p.insert(k)
    p.touch("b")  # b moves to the frequency list
    p.touch("b")
    p.pin("c")
    p.touch("c")  # a hit while pinned counts too
    p.unpin("c")
    assert drain(p) == ["a", "d", "b", "c"]


def test_arc_ghost_hit_grows_the_recency_side():
    p = ARCPolicy()
    p.insert("a")
    p.insert("b")
    assert p.evict() == "a"  # T1 holds everything: its oldest goes, remembered as a ghost
    p.insert("a")  # a ghost hit: T1 was too small; a returns on the frequency list
    p.insert("c")
    p.insert("d")
    # T1's target grew to 1: T1 (b, c, d) shrinks to one block before T2's a goes
    assert drain(p) == ["b", "c", "a", "d"]
    q = ARCPolicy()  # the same without the ghost: a stranger is just the oldest block
    for k in ("b", "x", "c", "d"):
        q.insert(k)
    assert drain(q) == ["b", "x", "c", "d"]


def test_arc_ghost_list_is_bounded():
    p = ARCPolicy()
    for k in range(1000):
        p.insert(k)
        if k >= 10:
            p.evict()
    assert len(p) == 10
    assert len(p._b1) + len(p._b2) <= ARCPolicy.GHOST_FACTOR * 10


def test_make_policy_rejects_unknown():
    assert {type(make_policy(n)) for n in EVICTION_POLICIES} == {
        LRUPolicy, LFUPolicy, S3FIFOPolicy, ARCPolicy, PriorityPolicy}
    with pytest.raises(ConfigError, match="accepted: lru, lfu, s3fifo, priority, arc"):
        make_policy("random")


class PolicyContract(RuleBasedStateMachine):
    """Every policy, whatever its order: only resident unpinned keys are evicted, each once; len is exact."""

    def __init__(self):
        super().__init__()
        self.policy = None
        self.resident: set[int] = set()
        self.pinned: set[int] = set()

    @precondition(lambda self: self.policy is None)
    @rule(name=st.sampled_from(EVICTION_POLICIES))
    def choose(self, name):
        self.policy = make_policy(name)

    @precondition(lambda self: self.policy is not None)
    @rule(key=st.integers(0, 30), priority=st.integers(0, 3), pinned=st.booleans())
    def insert(self, key, priority, pinned):
        if key in self.resident:
            return
        self.policy.insert(key, priority=priority, pinned=pinned)
        self.resident.add(key)
        if pinned:
            self.pinned.add(key)

    @precondition(lambda self: self.policy is not None)
    @rule(key=st.integers(0, 30))
    def pin(self, key):
        if key in self.resident:
            self.policy.pin(key)
            self.pinned.add(key)

    @precondition(lambda self: self.policy is not None)
    @rule(key=st.integers(0, 30))
    def unpin(self, key):
        if key in self.pinned:
            self.policy.unpin(key)
            self.pinned.discard(key)

    @precondition(lambda self: self.policy is not None)
    @rule(key=st.integers(0, 30), priority=st.integers(0, 3))
    def touch(self, key, priority):
        self.policy.touch(key, priority=priority)

    @precondition(lambda self: self.policy is not None)
    @rule(key=st.integers(0, 30))
    def remove(self, key):
        self.policy.remove(key)
        self.resident.discard(key)
        self.pinned.discard(key)

    @precondition(lambda self: self.policy is not None)
    @rule()
    def evict(self):
        key = self.policy.evict()
        evictable = self.resident - self.pinned
        if key is None:
            assert not evictable
        else:
            assert key in evictable
            self.resident.discard(key)

    @invariant()
    def length_is_the_evictable_count(self):
        if self.policy is not None:
            assert len(self.policy) == len(self.resident - self.pinned)


TestPolicyContract = PolicyContract.TestCase
TestPolicyContract.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 50), max_size=200))
def test_lru_matches_a_reference_model(accesses):
    p, model = LRUPolicy(), []
    for k in accesses:
        if k in model:
            p.touch(k)
            model.remove(k)
        else:
            p.insert(k)
        model.append(k)
    assert drain(p) == model


# ---------------------------------------------------------------------------- BucketQueue (LFU and priority)


def pop_all(q: BucketQueue) -> list:
    out = []
    while (key := q.pop_min()) is not None:
        out.append(key)
    return out


def test_bucket_queue_lowest_level_first_oldest_first_within_a_level():
    q = BucketQueue()
    for key, level in (("a", 2), ("b", 1), ("c", 2), ("d", 1), ("e", -3)):
        q.add(key, level)
    q.set_level("b", 1)  # same level: still goes last in it
    assert len(q) == 5 and q.level("a") == 2
    assert pop_all(q) == ["e", "d", "b", "a", "c"]
    assert len(q) == 0 and "a" not in q


def test_bucket_queue_held_keys_keep_their_level_out_of_the_order():
    q = BucketQueue()
    q.add("a", 1)
    q.add("b", 5, queued=False)
    q.add("c", 3)
    q.hold("a")
    q.hold("a")  # twice: still one entry
    q.set_level("a", 9)  # a level change while held stays held
    assert len(q) == 1 and "a" in q and "b" in q
    assert q.pop_min() == "c" and q.pop_min() is None
    q.release("b")
    q.release("a")
    q.release("a")  # releasing a queued key moves it last, never adds it twice
    assert len(q) == 2 and pop_all(q) == ["b", "a"]


def test_bucket_queue_ignores_absent_keys_and_re_adds_cleanly():
    q = BucketQueue()
    for op in (q.hold, q.release, q.discard):
        op("ghost")
    assert len(q) == 0 and "ghost" not in q and q.pop_min() is None
    q.add("a", 4)
    q.add("a", 0)  # a second add replaces the first: one entry, at the new level
    q.add("b", 1)
    q.discard("b")
    q.discard("b")
    assert len(q) == 1 and pop_all(q) == ["a"]


def test_bucket_queue_heap_stays_small_as_levels_climb():
    q = BucketQueue()
    q.add("floor", 0)
    q.add("hot", 1)
    for level in range(2, 10_000):  # LFU: one key's count climbing opens a new level per hit
        q.set_level("hot", level)
    assert len(q._heap) <= 2 * len(q._buckets) + 8
    assert pop_all(q) == ["floor", "hot"]


@given(st.lists(st.tuples(st.sampled_from(["add", "held", "set", "hold", "release", "discard", "pop"]),
                          st.integers(0, 8), st.integers(-3, 3)), max_size=120))
def test_bucket_queue_matches_a_sorted_list_model(ops):
    """The model: queued keys as a list in (level, arrival) order; held keys remember their level."""
    q, level, queued, stamp = BucketQueue(), {}, {}, 0

    def enqueue(k):
        nonlocal stamp
        stamp += 1
        queued[k] = stamp

    for op, k, lvl in ops:
        if op in ("add", "held"):
            queued.pop(k, None)
            level[k] = lvl
            q.add(k, lvl, queued=op == "add")
            if op == "add":
                enqueue(k)
        elif op == "set" and k in level:
            level[k] = lvl
            q.set_level(k, lvl)
            if k in queued:
                enqueue(k)
        elif op == "hold":
            q.hold(k)
            queued.pop(k, None)
        elif op == "release":
            q.release(k)
            if k in level:
                enqueue(k)
        elif op == "discard":
            q.discard(k)
            level.pop(k, None)
            queued.pop(k, None)
        elif op == "pop":
            want = min(queued, key=lambda key: (level[key], queued[key])) if queued else None
            assert q.pop_min() == want
            if want is not None:
                del queued[want], level[want]
        assert len(q) == len(queued) and all(key in q for key in level)
    assert pop_all(q) == sorted(queued, key=lambda key: (level[key], queued[key]))
