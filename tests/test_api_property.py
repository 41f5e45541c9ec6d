"""A hypothesis state machine over TieredKVCache's public API as a custom engine uses it, misuse included.

Random runs of match / store / retrieve / plan / allocate / admit / append / "the engine writes
KV" / commit / free / evict / close, each followed by the calls an engine gets wrong: a match
made for other tokens, another salt or another cache (even a stale one), tokens that do not
extend a sequence, a freed or foreign sequence, room L1 cannot give, calls after close().
A wrong call must raise its tierkv error and change nothing; a right one must never hand back
KV other than what was stored or computed for those tokens (prefix_kv.py makes KV a pure function
of the token prefix, so every byte is checked), and no block may leak.

tests/test_cache_state.py drives the cache's internals under pressure; this machine keeps to the
surface and reuses that file's layout and per-step checks of the tiers' slots and pins.
"""

import shutil
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefix_kv import prefix_kv, read_slots, write_into_slots
from test_cache_state import LAYOUT, CacheMachine
from test_paged import held
from tierkv import CacheConfig, TieredKVCache
from tierkv.config import EVICTION_POLICIES, WRITE_POLICIES
from tierkv.errors import CacheClosedError, CacheFullError, ShapeError, TierKVError, UsageError

BS = LAYOUT.block_size
BPB = LAYOUT.bytes_per_block

# A 3-token alphabet and block size 2, and every prompt the start of one of a few conversations with
# a few tokens of its own: prompts share prefixes all the time. L1 is a handful of blocks.
CONVERSATIONS = ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 0, 2, 1, 1, 0, 2, 2], [2, 2, 1, 0, 0, 1, 2, 1, 0, 1])
token_ids = st.integers(0, 2)


def turn(conversation: list[int], n: int, own: list[int]) -> list[int]:
    """A prompt: the first `n` tokens of a conversation, then a few of its own."""
    return conversation[:n] + own


prompts = st.builds(turn, st.sampled_from(CONVERSATIONS), st.integers(1, 10), st.lists(token_ids, max_size=4))
salts = st.sampled_from([None, None, "tenant-b"])  # mostly one tenant, so that hits are common
limits = st.one_of(st.none(), st.just("all"), st.integers(-1, 12))
token_forms = st.sampled_from(["list", "numpy", "tensor"])  # how an engine may hand its token ids over
picks = st.integers(0, 100)


def as_form(tokens: list[int], form: str):
    if form == "numpy":
        return np.asarray(tokens, dtype=np.int64)
    if form == "tensor":
        return torch.tensor(tokens, dtype=torch.int64)
    return list(tokens)


def other_salt(salt):
    return "tenant-b" if salt is None else None


def seq_state(seq) -> tuple:
    """What a refused call must leave as it was on the sequence itself."""
    return (list(seq.slots), [id(e) for e in seq.entries], seq.committed, seq.num_tokens,
            bytes(seq.token_bytes), list(seq.hashes), list(seq.l2_slots), seq.freed)


def pins_of(snapshot: tuple) -> list:
    """(hash, ref) of the pinned entries in a `held` snapshot."""
    return [(h, ref) for h, ref, *_ in snapshot[3] if ref]


def pins(cache) -> list:
    return pins_of(held(cache))


@dataclass
class Running:
    seq: object
    tokens: list[int]  # every token the sequence has room for: the prompt, then what append() made room for
    written: int  # leading positions whose KV the "engine" wrote (or the cache brought)
    salt: str | None


class ApiMachine(RuleBasedStateMachine):
    with_disk = False  # a disk L3 under L2 (needs model= and L2 > 0)

    def __init__(self):
        super().__init__()
        self.seqs: list[Running] = []
        self.freed: list = []  # sequences this cache freed
        self.foreign: list = []  # sequences of another cache, or of this one before close()
        self.matches: list[tuple] = []  # (match, tokens, salt): lookups kept across steps (stale ones)
        self.old_matches: list = []  # matches made by a cache that was closed since
        self.closes = 0
        self.steps = 0

    @property
    def running(self) -> list[tuple]:
        """(seq, tokens written, salt) of every running sequence: the form test_cache_state's checks take."""
        return [(r.seq, r.tokens[: r.written], r.salt) for r in self.seqs]

    @initialize(l1=st.integers(3, 10), l2=st.integers(0, 12), eviction=st.sampled_from(EVICTION_POLICIES),
                write_policy=st.sampled_from(WRITE_POLICIES), min_hits=st.integers(1, 3))
    def build(self, l1, l2, eviction, write_policy, min_hits):
        l3 = []
        if self.with_disk:
            l2 = 2 + l2 % 3  # a small L2, so that blocks go on down to the disk
            self.disk = tempfile.mkdtemp(prefix="tierkv-api-")
            # one writer thread: the disk's LRU order follows the write order, so a replay behaves the same
            l3 = [f"file://{self.disk}?size=160KiB&threads=1"]
        self.config = CacheConfig(l1=l1 * BPB, l2=l2 * BPB, l3=l3, eviction=eviction, write_policy=write_policy,
                                  selective_min_hits=min_hits)
        self.cache = self.make()
        # another instance of the same model and layout: its matches and sequences are not this cache's
        self.other = TieredKVCache(LAYOUT, CacheConfig(l1=4 * BPB), device="cpu", model="api-machine")
        self.foreign.append(self.other.allocate([0, 1, 2]))

    def make(self) -> TieredKVCache:
        return TieredKVCache(LAYOUT, self.config, device="cpu", model="api-machine")

    # ------------------------------------------------------------------ helpers

    def pick(self, pick: int) -> Running:
        return self.seqs[pick % len(self.seqs)]

    def refused(self, error, call, match: str | None = None, seq=None):
        """`call` raises `error` (its message containing `match`) and changes nothing in the cache or `seq`."""
        before = held(self.cache), seq_state(seq) if seq is not None else None
        with pytest.raises(error, match=match):
            call()
        assert (held(self.cache), seq_state(seq) if seq is not None else None) == before

    def check_prefix(self, seq, tokens, salt, n: int) -> None:
        assert torch.equal(read_slots(self.cache, seq, n), prefix_kv(LAYOUT, tokens, salt)[:, :, :n])

    def started(self, seq, tokens: list[int], salt, prefill: bool) -> None:
        """A sequence the cache just allocated: its cached prefix holds that prefix's KV. `prefill`:
        the engine computes the rest of the prompt and commits it at once."""
        seq.wait()
        assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens <= len(tokens)
        assert seq.num_tokens == len(tokens) and len(seq.slots) == self.cache.blocks_needed(len(tokens))
        self.check_prefix(seq, tokens, salt, seq.num_cached_tokens)
        self.seqs.append(Running(seq, list(tokens), seq.num_cached_tokens, salt))
        if prefill:
            self.compute(self.seqs[-1], len(tokens))
            self.commit_written(self.seqs[-1])

    # ------------------------------------------------------------------ the simple API

    @rule(tokens=prompts, salt=salts, pair=st.booleans(), form=token_forms)
    def store(self, tokens, salt, pair, form):
        kv = prefix_kv(LAYOUT, tokens, salt)  # [L, 2, T, H, D]
        n = self.cache.store(as_form(tokens, form), (kv[:, 0], kv[:, 1]) if pair else kv, salt)
        assert n % BS == 0 and n <= len(tokens) // BS * BS
        got, back = self.cache.retrieve(tokens, salt, limit=n)
        # a disk tier smaller than the sequence may evict its own earlier blocks as it writes later ones
        assert got == n if not self.with_disk else got <= n
        assert torch.equal(back, kv[:, :, :got])

    @rule(tokens=prompts, salt=salts, kind=st.sampled_from(["longer", "dtype", "pair", "layers"]))
    def store_wrong_kv(self, tokens, salt, kind):
        kv = prefix_kv(LAYOUT, tokens, salt)
        bad = {
            "longer": lambda: prefix_kv(LAYOUT, tokens + [0], salt),
            "dtype": lambda: kv.half(),
            "pair": lambda: (kv[:, 0], kv[:, 1, :, :, :1]),
            "layers": lambda: kv[:2],
        }[kind]()
        self.refused(ShapeError, lambda: self.cache.store(tokens, bad, salt))

    @rule(tokens=prompts, salt=salts, limit=limits, form=token_forms)
    def match_and_retrieve(self, tokens, salt, limit, form):
        limit = len(tokens) if limit == "all" else limit
        top = len(tokens) - 1 if limit is None else max(0, min(limit, len(tokens)))
        m = self.cache.match(as_form(tokens, form), salt, limit=limit)
        assert m.tokens % BS == 0 and m.tokens <= top
        assert sum(m.by_tier.values()) == m.tokens
        assert m.by_tier["l3"] == 0 or self.with_disk
        n, kv = self.cache.retrieve(as_form(tokens, form), salt, limit=limit)
        # L3 reads have a deadline: a block that does not arrive is a shorter hit, never other KV
        assert n == m.tokens if not self.with_disk else n <= m.tokens
        assert torch.equal(kv, prefix_kv(LAYOUT, tokens, salt)[:, :, :n])
        event(f"retrieve: hit in {[t for t, n in m.by_tier.items() if n] or 'no tier'}")
        self.matches = [*self.matches[-3:], (self.cache.match(tokens, salt, limit=limit), tokens, salt)]

    # ------------------------------------------------------------------ admission

    @rule(tokens=prompts, salt=salts, source=st.sampled_from(["match", "plan", "kept"]), pass_tokens=st.booleans(),
          form=token_forms, prefill=st.booleans())
    def allocate(self, tokens, salt, source, pass_tokens, form, prefill):
        fresh = True
        if source == "kept" and self.matches:  # a lookup made steps ago: the index changed since
            m, tokens, salt = self.matches[len(tokens) % len(self.matches)]
            fresh = False
        elif source == "plan":
            p = self.cache.plan(tokens, salt, budget=len(tokens))
            m = p.match
            if not p.stream:  # a streamed plan (prompt and next token larger than L1) reserves less
                assert p.fits == self.cache.can_allocate(len(tokens), m)
        else:
            m = self.cache.match(tokens, salt)
        fits = self.cache.can_allocate(len(tokens), m)
        before = held(self.cache)
        try:
            seq = self.cache.allocate(as_form(tokens, form) if pass_tokens else None, salt, match=m)
        except CacheFullError:
            assert held(self.cache) == before  # refused: nothing taken, evicted or pinned
            assert not fits or not fresh
            return
        assert fits or not fresh
        if fresh:  # L1 and L2 hits; L3 ones need a prefetch (admit) first
            assert seq.num_cached_tokens == len(m.blocks) * BS
        event(f"allocate ({source}): cached tokens {'>' if seq.num_cached_tokens else '='} 0")
        self.started(seq, tokens, salt, prefill)

    @rule(tokens=prompts, salt=salts, wrong=st.sampled_from(["tokens", "salt", "other cache", "closed cache",
                                                            "no match"]),
          pass_tokens=st.booleans(), other=prompts)
    def allocate_with_a_wrong_match(self, tokens, salt, wrong, pass_tokens, other):
        m = self.cache.match(tokens, salt)
        given, given_salt, text = tokens if pass_tokens else None, salt, None
        if wrong == "tokens":
            given = other if other != tokens else tokens + [0]
            text = "other tokens"
        elif wrong == "salt":
            given_salt, text = other_salt(salt), "another salt"
        elif wrong == "other cache":
            m, text = self.other.match(tokens, salt), "not made by this cache"
        elif wrong == "closed cache" and self.old_matches:
            m, text = self.old_matches[len(other) % len(self.old_matches)], "not made by this cache"
        else:  # no match and no tokens (also "closed cache" before any close)
            m, given, text = None, None, "needs the prompt's tokens"
        self.refused(UsageError, lambda: self.cache.allocate(given, given_salt, match=m), text)
        if m is not None and m.owner is not self.cache:
            self.refused(UsageError, lambda: self.cache.prefetch(m), text)

    @rule(tokens=st.sampled_from([[], [2**31], [0, -(2**31) - 1], [0.5, 1.0], [[0, 1], [2, 0]]]),
          call=st.sampled_from(["match", "retrieve", "store", "allocate", "admit"]))
    def tokens_that_are_not_a_prompt(self, tokens, call):
        """No tokens, ids outside int32, floats, a 2-D list: refused with UsageError, nothing changed."""
        if not tokens and call in ("match", "retrieve", "store"):
            return  # an empty prompt is a lookup that finds nothing, and nothing to store
        calls = {
            "match": lambda: self.cache.match(tokens),
            "retrieve": lambda: self.cache.retrieve(tokens),
            "store": lambda: self.cache.store(tokens, torch.zeros(LAYOUT.kv_shape(len(tokens)))),
            "allocate": lambda: self.cache.allocate(tokens),
            "admit": lambda: self.cache.admit(tokens),
        }
        self.refused(UsageError, calls[call])

    @rule(tokens=prompts, salt=salts, prefill=st.booleans())
    def admit(self, tokens, salt, prefill):
        expected = self.cache.match(tokens, salt)
        before = held(self.cache)
        try:
            seq = self.cache.admit(tokens, salt, deadline_s=30)
        except CacheFullError:
            if self.with_disk:  # the L3 part may have landed in L2 meanwhile; nothing was pinned
                assert (held(self.cache)[0], pins(self.cache)) == (before[0], pins_of(before))
            else:
                assert held(self.cache) == before
            return
        # every tier's hit is in the sequence. With a disk, the L3 part is recomputed when it does
        # not all come in: an L2 of a few blocks cannot hold a longer L3 part (what landed first
        # is evicted for what lands next), or a read misses.
        assert seq.num_cached_tokens == expected.tokens if not self.with_disk else \
            seq.num_cached_tokens <= expected.tokens
        event(f"admit: {seq.num_cached_tokens} of {expected.tokens} cached tokens, {expected.by_tier['l3']} in L3")
        self.started(seq, tokens, salt, prefill)

    # ------------------------------------------------------------------ a running sequence

    @precondition(lambda self: self.seqs)
    @rule(pick=picks, new=st.lists(token_ids, max_size=5))
    def append(self, pick, new):
        r = self.pick(pick)
        if self.cache.can_append(r.seq, len(new)):
            self.cache.append(r.seq, len(new))
            r.tokens += new
            assert r.seq.num_tokens == len(r.tokens) and len(r.seq.slots) == self.cache.blocks_needed(len(r.tokens))
        else:
            self.refused(CacheFullError, lambda: self.cache.append(r.seq, len(new)), seq=r.seq)

    @precondition(lambda self: self.seqs)
    @rule(pick=picks, upto=st.integers(1, 12))
    def write(self, pick, upto):
        self.compute(self.pick(pick), upto)

    def compute(self, r: Running, upto: int) -> None:
        """Play the engine: write the KV of the next `upto` positions into the sequence's L1 slots."""
        end = min(len(r.tokens), r.written + upto)
        write_into_slots(self.cache, r.seq, r.tokens[:end], r.written, r.salt)
        r.written = end

    @precondition(lambda self: self.seqs)
    @rule(pick=picks, form=token_forms)
    def commit(self, pick, form):
        self.commit_written(self.pick(pick), form)

    def commit_written(self, r: Running, form: str = "list") -> None:
        """Commit the tokens whose KV is written: every full block among them enters the sequence's prefix."""
        before = r.seq.committed
        n = self.cache.commit(r.seq, as_form(r.tokens[: r.written], form))
        assert n == max(0, r.written // BS - before)
        assert r.seq.committed == max(before, r.written // BS)

    @precondition(lambda self: self.seqs)
    @rule(pick=picks, where=st.integers(0, 100), shift=st.integers(1, 2))
    def commit_tokens_that_do_not_extend(self, pick, where, shift):
        """A token the sequence knows (its prompt, or one committed before) differs: refused."""
        r = self.pick(pick)
        seq = r.seq
        # commit checks the blocks it would enter now, where the sequence knows their tokens
        first = seq.committed * BS
        if r.written < len(r.tokens):
            self.compute(r, len(r.tokens))  # the engine computed the rest of its tokens, not committed yet
        end = min(len(seq.token_bytes) // 4, r.written // BS * BS)
        if first >= end:
            return
        p = first + where % (end - first)
        bad = r.tokens[: r.written]
        bad[p] = (bad[p] + shift) % 3
        self.refused(UsageError, lambda: self.cache.commit(seq, bad), f"position {p} that differs", seq=seq)

    @precondition(lambda self: self.seqs)
    @rule(pick=picks, n=st.sampled_from([-1, -5, 1.5, "2"]))
    def append_a_wrong_count(self, pick, n):
        r = self.pick(pick)
        self.refused(UsageError, lambda: self.cache.append(r.seq, n), ">= 0", seq=r.seq)

    @precondition(lambda self: self.seqs)
    @rule(pick=picks)
    def free(self, pick):
        r = self.seqs.pop(pick % len(self.seqs))
        self.cache.free(r.seq)
        assert r.seq.freed and not r.seq.slots
        self.freed = [*self.freed[-3:], r.seq]

    @precondition(lambda self: self.freed or self.foreign)
    @rule(pick=picks, call=st.sampled_from(["append", "commit", "free", "can_append", "block_table", "adopt"]))
    def call_a_dead_sequence(self, pick, call):
        """A freed sequence, another cache's, or one this cache made before close(): refused."""
        dead = [*self.freed, *self.foreign]
        seq = dead[pick % len(dead)]
        text = "did not allocate" if seq.owner is not self.cache else "already freed"
        tokens = [0, 1, 2, 0]
        calls = {
            "append": lambda: self.cache.append(seq, 2),
            "commit": lambda: self.cache.commit(seq, tokens),
            "free": lambda: self.cache.free(seq),
            "can_append": lambda: self.cache.can_append(seq),
            "block_table": lambda: self.cache.block_table([seq]),
            "adopt": lambda: self.cache.adopt(seq, tokens),
        }
        self.refused(UsageError, calls[call], text, seq=seq)

    # ------------------------------------------------------------------ lifecycle

    @rule(tier=st.sampled_from(["l1", "l2"]))
    def evict(self, tier):
        self.cache.evict(tier)
        entries = self.cache.index.entries.values()
        if tier == "l1":
            assert all(e.ref > 0 for e in entries if e.l1 >= 0), "evict('l1') kept an unpinned block"
        elif self.cache.tiers.l3 is None:
            assert all(e.held > 0 for e in entries if e.l2 >= 0), "evict('l2') kept a block nothing holds"

    @rule()
    def evict_a_tier_that_is_not_one(self):
        self.refused(UsageError, lambda: self.cache.evict("l3"), "'l1' or 'l2'")

    @precondition(lambda self: self.steps >= 12 and not self.closes)  # late and once: a run builds state first
    @rule(tokens=prompts)
    def close(self, tokens):
        """close(): every later call is refused; then a new cache (on the same disk) takes over."""
        cache = self.cache
        m = cache.match(tokens)
        cache.close()
        seq = self.seqs[0].seq if self.seqs else None
        calls = [
            lambda: cache.match(tokens), lambda: cache.retrieve(tokens),
            lambda: cache.store(tokens, prefix_kv(LAYOUT, tokens)), lambda: cache.allocate(tokens),
            lambda: cache.allocate(None, match=m), lambda: cache.admit(tokens), lambda: cache.can_allocate(1, m),
            lambda: cache.plan(tokens, budget=8), lambda: cache.prefetch(m), lambda: cache.evict("l1"),
            lambda: cache.stats(), lambda: cache.flush(),
        ]
        if seq is not None:
            calls += [lambda: cache.append(seq, 1), lambda: cache.commit(seq, tokens), lambda: cache.free(seq),
                      lambda: cache.block_table([seq])]
        for call in calls:
            with pytest.raises(CacheClosedError, match="closed"):
                call()
        cache.close()  # a second close does nothing
        self.closes += 1
        self.foreign = [*self.foreign, *(r.seq for r in self.seqs), *self.freed][-6:]
        self.old_matches = [*self.old_matches, m, *(k[0] for k in self.matches)][-4:]
        self.seqs, self.freed, self.matches = [], [], []
        self.cache = self.make()

    # ------------------------------------------------------------------ invariants

    def drain_l3(self):
        # L3 writes finish on their own threads; taking them in before checking keeps every step
        # (and every replay of an example) deterministic
        l3 = self.cache.tiers.l3
        while l3 is not None and l3.in_flight:
            l3.wait_any(5)
            self.cache.tiers.reap()

    @invariant()
    def blocks_accounted_and_kv_intact(self):
        self.steps += 1
        self.drain_l3()
        # every L1/L2 slot is free, a running sequence's private one, or an index entry's, once;
        # ref counts are the running holders; running sequences hold their prefix's KV
        CacheMachine.tiers_within_budget_and_slots_accounted(self)
        CacheMachine.ref_counts_are_the_running_holders(self)
        CacheMachine.running_sequences_keep_their_kv(self)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        if sys.exc_info()[0] is not None:  # a step failed: report that, not the blocks it left held
            self.release()
            return
        cache = self.cache
        for r in self.seqs:
            cache.free(r.seq)
        self.seqs = []
        cache.evict("l1")
        # an L2 block that L3 admits but lacks is written first and stays until that write ends
        for _ in range(20):
            cache.evict("l2")
            self.drain_l3()
            if cache.stats()["tiers"]["l2"]["used_blocks"] == 0:
                break
        tiers = cache.stats()["tiers"]
        assert tiers["l1"]["used_blocks"] == 0, "L1 blocks leaked"
        assert tiers["l2"]["used_blocks"] == 0, "L2 blocks leaked"
        assert len(cache.index) == 0
        self.release()

    def release(self):
        self.cache.close()
        self.other.close()
        if self.with_disk:
            shutil.rmtree(self.disk, ignore_errors=True)


class DiskApiMachine(ApiMachine):
    with_disk = True


# ~40 s for both on a 2-core VM; the disk machine's steps cost more (L3 threads, files)
TestApiMachine, TestDiskApiMachine = ApiMachine.TestCase, DiskApiMachine.TestCase
TestApiMachine.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)
TestDiskApiMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


# ---------------------------------------------------------------------- known gaps, found by the machine
# Each passes once the cache refuses the call with its own error; strict, so that the fix shows.


@pytest.mark.parametrize("call", ["allocate []", "admit []", "match [2**31]", "store [0.5]", "evict l3"])
def test_a_wrong_argument_is_a_tierkv_error(call):
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=4 * BPB, l2=4 * BPB), device="cpu", model="api-machine")
    calls = {
        "allocate []": lambda: cache.allocate([]),
        "admit []": lambda: cache.admit([]),
        "match [2**31]": lambda: cache.match([2**31]),
        "store [0.5]": lambda: cache.store([0.5], torch.zeros(LAYOUT.kv_shape(1))),
        "evict l3": lambda: cache.evict("l3"),
    }
    with pytest.raises(ValueError) as raised:
        calls[call]()
    assert isinstance(raised.value, TierKVError), f"{type(raised.value).__name__}: {raised.value}"


def test_can_allocate_refuses_another_caches_match():
    a, b = (TieredKVCache(LAYOUT, CacheConfig(l1=4 * BPB), device="cpu", model="api-machine") for _ in range(2))
    tokens = [0, 1, 2, 0, 1]
    b.store(tokens, prefix_kv(LAYOUT, tokens))
    with pytest.raises(UsageError, match="not made by this cache"):
        a.can_allocate(len(tokens), b.match(tokens))
