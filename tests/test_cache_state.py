"""A hypothesis state machine over TieredKVCache: random store / match / retrieve / allocate (pin) /
decode / free (unpin) under eviction pressure, with the cache's invariants checked after every step.

KV is a pure function of the token prefix (tests/prefix_kv.py), so every byte the cache hands
back, and every byte a running sequence holds in L1, can be checked against the truth.
"""

import shutil
import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefix_kv import prefix_kv, read_slots, write_into_slots
from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.config import EVICTION_POLICIES, WRITE_POLICIES
from tierkv.errors import CacheFullError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=1, head_dim=2, dtype=torch.float32, block_size=2)
BS = LAYOUT.block_size

# A 3-token alphabet and block size 2: prompts share prefixes all the time.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)
salts = st.sampled_from([None, "tenant-b"])


class CacheMachine(RuleBasedStateMachine):
    device = "cpu"
    with_disk = False  # a disk L3 under L2 (needs L2 > 0)

    def __init__(self):
        super().__init__()
        self.running: list[tuple] = []  # (seq, tokens written, salt)
        self.fresh = 1000  # token ids above the alphabet, for pressure traffic nobody shares

    @initialize(l1=st.integers(3, 14), l2=st.integers(0, 20), eviction=st.sampled_from(EVICTION_POLICIES),
                write_policy=st.sampled_from(WRITE_POLICIES), min_hits=st.integers(1, 3))
    def build(self, l1, l2, eviction, write_policy, min_hits):
        bpb = LAYOUT.bytes_per_block
        l3 = []
        if self.with_disk:
            l2 = 2 + l2 % 3  # a small L2, so that blocks go on down to the disk
            self.disk = tempfile.mkdtemp(prefix="tierkv-sm-")
            # ~20 objects (header + page-aligned payload): it evicts too. One thread: the disk's own LRU
            # order then follows the write order, so a replayed example behaves the same.
            l3 = [f"file://{self.disk}?size=160KiB&threads=1"]
        config = CacheConfig(l1=l1 * bpb, l2=l2 * bpb, l3=l3, eviction=eviction, write_policy=write_policy,
                             selective_min_hits=min_hits)
        self.cache = TieredKVCache(LAYOUT, config, device=self.device, model="state-machine")

    # ------------------------------------------------------------------ the simple API

    @rule(tokens=prompts, salt=salts)
    def store(self, tokens, salt):
        n = self.cache.store(tokens, prefix_kv(LAYOUT, tokens, salt).to(self.device), salt)
        assert n % BS == 0 and n <= len(tokens) // BS * BS

    @rule(tokens=st.lists(st.integers(0, 2), min_size=8, max_size=64), salt=salts)
    def store_long(self, tokens, salt):
        """Sequences up to 32 blocks: larger than L1, often larger than L1 + L2. store() spills
        what L1 cannot hold and says how much it kept; that much is retrieved, bit for bit."""
        n = self.cache.store(tokens, prefix_kv(LAYOUT, tokens, salt).to(self.device), salt)
        assert n % BS == 0 and n <= len(tokens) // BS * BS
        got, kv = self.cache.retrieve(tokens, salt, limit=n)
        # a disk tier smaller than the sequence may evict its own earlier blocks as it writes later ones
        assert got == n if not self.with_disk else got <= n
        assert torch.equal(kv.cpu(), prefix_kv(LAYOUT, tokens, salt)[:, :, :got])

    @rule(tokens=prompts, salt=salts, whole=st.booleans())
    def match_then_retrieve(self, tokens, salt, whole):
        limit = len(tokens) if whole else None
        m = self.cache.match(tokens, salt, limit=limit)
        assert m.tokens % BS == 0
        assert m.tokens <= (len(tokens) if whole else len(tokens) - 1)
        assert sum(m.by_tier.values()) == m.tokens
        n, kv = self.cache.retrieve(tokens, salt, limit=limit)
        assert n == m.tokens  # match length = retrievable length
        assert torch.equal(kv.cpu(), prefix_kv(LAYOUT, tokens, salt)[:, :, :n])

    @rule(tokens=prompts, salt=salts)
    def prefetch(self, tokens, salt):
        m = self.cache.match(tokens, salt)
        assert self.cache.prefetch(m, deadline_s=30).wait(60)
        after = self.cache.match(tokens, salt)
        assert after.tokens >= len(m.blocks) * BS  # what was in L1/L2 is still found

    @rule(length=st.integers(4, 30))
    def pressure(self, length):
        tokens = list(range(self.fresh, self.fresh + length))
        self.fresh += length
        self.cache.store(tokens, prefix_kv(LAYOUT, tokens).to(self.device))

    # ------------------------------------------------------------------ the block-level API

    @rule(tokens=prompts, salt=salts)
    def allocate(self, tokens, salt):
        m = self.cache.match(tokens, salt)
        if not self.cache.can_allocate(len(tokens), m):
            before = self.cache.stats()["tiers"]
            with pytest.raises(CacheFullError):
                self.cache.allocate(tokens, salt, match=m)
            after = self.cache.stats()["tiers"]
            assert [before[t]["used_blocks"] for t in ("l1", "l2")] == [after[t]["used_blocks"] for t in ("l1", "l2")]
            return
        seq = self.cache.allocate(tokens, salt, match=m)
        seq.wait()
        assert seq.num_cached_tokens == len(m.blocks) * BS  # L1 and L2 hits; L3 ones need a prefetch first
        cached = seq.num_cached_tokens
        assert torch.equal(read_slots(self.cache, seq, cached).cpu(), prefix_kv(LAYOUT, tokens, salt)[:, :, :cached])
        write_into_slots(self.cache, seq, tokens, cached, salt)  # "prefill" the rest
        self.cache.commit(seq, tokens)
        self.running.append((seq, list(tokens), salt))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), token=st.integers(0, 2))
    def decode(self, pick, token):
        seq, tokens, salt = self.running[pick % len(self.running)]
        if not self.cache.can_append(seq, 1):
            with pytest.raises(CacheFullError):
                self.cache.append(seq, 1)
            return
        self.cache.append(seq, 1)
        tokens.append(token)
        write_into_slots(self.cache, seq, tokens, len(tokens) - 1, salt)
        self.cache.commit(seq, tokens)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def free(self, pick):
        seq, _, _ = self.running.pop(pick % len(self.running))
        self.cache.free(seq)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def invariants(self):
        # L3 writes finish on their own threads; taking them in before checking keeps every
        # step, and so every replay of an example, deterministic.
        l3 = self.cache.tiers.l3
        while l3 is not None and l3.in_flight:
            l3.wait_any(5)
            self.cache.tiers.reap()
        self.tiers_within_budget_and_slots_accounted()
        self.ref_counts_are_the_running_holders()
        self.running_sequences_keep_their_kv()

    def tiers_within_budget_and_slots_accounted(self):
        cache = self.cache
        entries = list(cache.index.entries.values())
        private = [s for seq, _, _ in self.running for s, e in zip(seq.slots, seq.entries) if e is None]
        l1 = [e.l1 for e in entries if e.l1 >= 0] + private
        assert len(l1) == len(set(l1)), "an L1 slot is used twice"
        assert len(l1) + len(cache.l1.free) == cache.l1.num_blocks
        stats = cache.stats()["tiers"]
        for tier in ("l1", "l2"):
            assert stats[tier]["used_bytes"] <= stats[tier]["capacity_bytes"]
        if cache.l2 is not None:
            l2 = [e.l2 for e in entries if e.l2 >= 0]
            assert len(l2) == len(set(l2)), "an L2 slot is used twice"
            assert len(l2) + len(cache.l2.free) == cache.l2.num_blocks
        else:
            assert all(e.l2 < 0 for e in entries)

    def ref_counts_are_the_running_holders(self):
        holders: dict[int, int] = {}
        for seq, _, _ in self.running:
            for e in seq.entries:
                if e is not None:
                    holders[id(e)] = holders.get(id(e), 0) + 1
        for e in self.cache.index.entries.values():
            assert e.ref == holders.get(id(e), 0)
            if e.ref:
                assert e.l1 >= 0, "a pinned block left L1"

    def running_sequences_keep_their_kv(self):
        # A pinned block that was evicted and reused would show someone else's bytes here.
        for seq, tokens, salt in self.running:
            assert torch.equal(read_slots(self.cache, seq, len(tokens)).cpu(), prefix_kv(LAYOUT, tokens, salt))

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for seq, _, _ in self.running:
            self.cache.free(seq)
        assert all(e.ref == 0 for e in self.cache.index.entries.values())
        assert self.cache.index.evictable("l1") == sum(e.l1 >= 0 for e in self.cache.index.entries.values())
        self.cache.close()
        if self.with_disk:
            shutil.rmtree(self.disk, ignore_errors=True)


TestCacheStateMachine = CacheMachine.TestCase
TestCacheStateMachine.settings = settings(max_examples=500, stateful_step_count=30, deadline=None)


class DiskCacheMachine(CacheMachine):
    with_disk = True


TestDiskCacheStateMachine = DiskCacheMachine.TestCase
TestDiskCacheStateMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


class CudaCacheMachine(CacheMachine):
    device = "cuda"


TestCudaCacheStateMachine = pytest.mark.gpu(
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(CudaCacheMachine.TestCase)
)
TestCudaCacheStateMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
