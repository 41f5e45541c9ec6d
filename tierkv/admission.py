"""Admission: how a prompt enters the cache, for tierkv's scheduler and for engines of their own.

Admission (`plan`, `admit`, `allocate`, and `warm` for a prompt that waits for L1 room), on the
lookups of lookup.py (`match`, `prefetch`): what a prompt takes from which tier, what is read
from L3 first, and where the engine starts computing. `allocate` hands back the SequenceBlocks
whose life paged.py runs. The arithmetic of load-or-recompute is plan.py's; lookups and this
file apply it. Every public method runs under the cache's guard (guard.py) and checks its
arguments before it changes anything. It never knows about requests or HTTP.
"""

from __future__ import annotations

import functools
import sys
import time

import torch

from .errors import CacheFullError, UsageError
from .guard import Guard, guarded
from .index import BlockEntry
from .lookup import Lookups
from .metrics import CacheCounters
from .plan import AdmissionPlan, Match
from .sequence import SequenceBlocks
from .streaming import LayerStreamer
from .tiers import HostPool
from .transfer import in_flight

DEFAULT_L3_DEADLINE_S = 5.0  # how long retrieve() and admit() wait for L3 reads before recomputing instead


def stream_window_blocks(l1_blocks: int) -> int:
    """L1 blocks a streamed sequence may hold at once: half of L1."""
    return max(1, l1_blocks // 2)


def max_sequence_tokens(l1_blocks: int, l2_blocks: int, block_size: int) -> int:
    """The longest sequence tiers of these sizes can ever hold: all of L1, or, streamed (with an
    L2), its window in L1 and the rest in L2. Servers size their context by it."""
    in_l1 = l1_blocks * block_size
    if not l2_blocks:
        return in_l1
    return max(in_l1, (stream_window_blocks(l1_blocks) + l2_blocks) * block_size)


class Admission(Lookups):
    """Admission, on top of the lookups. Mixed into TieredKVCache (through PagedCache), which
    builds these and Lookups' attributes:"""

    device: torch.device
    l2: HostPool | None
    counters: CacheCounters
    streamer: LayerStreamer | None
    _guard: Guard
    _live: dict[SequenceBlocks, None]  # sequences allocated and not freed yet, oldest first

    def _count_hits(self, query_tokens: int | None, from_l1: list[BlockEntry], from_l2: list[BlockEntry],
                    direct_l3: int = 0) -> dict[str, int]:
        """A sequence (or a retrieve) starts from blocks taken from L1 and L2, and `direct_l3`
        blocks read straight from L3: count them as hits by the tier each came from (a block read
        up ahead of its use counts as a hit of the tier it came from, once: `brought_from`), and
        the lookup of `query_tokens` (None: more of a sequence's own prompt, no new lookup).
        Counted when blocks are used, not in `match`: a scheduler looks a waiting prompt up again
        every step, and an L3 prefix is found once in L3 and again in L2 once prefetched; counted
        here, the hits are the cached tokens requests got. Called after the loads are issued:
        this loop overlaps their copies. Returns the hit tokens by tier."""
        c, bs = self.counters, self.block_size
        if query_tokens is not None:
            c.queries += 1
            c.query_tokens += query_tokens
        blocks = {"l1": 0, "l2": 0, "l3": direct_l3}
        for tier, entries in (("l1", from_l1), ("l2", from_l2)):
            for e in entries:
                if e is None:  # (a window hit's block that no tier holds: with L1)
                    blocks[tier] += 1
                    continue
                blocks[e.brought_from or tier] += 1
                e.brought_from = ""
        by_tier = {tier: n * bs for tier, n in blocks.items()}
        c.hit_tokens += sum(by_tier.values())
        for tier, tokens in by_tier.items():
            c.tiers[tier].hit_tokens += tokens
        return by_tier

    # ------------------------------------------------------------------ admission

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def stream_window(self) -> int:
        """Most tokens a streamed sequence computes or keeps in L1 at once: half of L1, so that
        other requests still run beside it."""
        return stream_window_blocks(self.l1.num_blocks) * self.block_size

    @functools.cached_property  # (the layout and L1's size never change: asked each step, decided once)
    def lets_go(self) -> bool:
        """Whether a sequence of any length fits L1 by letting go of what its window has left:
        every layer is windowed, and L1 holds the widest window's blocks beside a chunk of
        `stream_window` tokens. Such a sequence is reserved and computed a chunk at a time,
        never streams, and `PagedCache.release` gives back its blocks as the window moves on."""
        window = self.layout.widest_window
        if window is None or self.tiers.engine_owned:  # (an engine that owns L1 frees its own blocks)
            return False
        l1 = self.l1.num_blocks
        return self.blocks_needed(window) + 1 <= l1 - stream_window_blocks(l1)

    @guarded
    def l1_room(self) -> int:
        """L1 slots to be had now: the free ones and those eviction can free."""
        return self.tiers.l1_room()

    @guarded
    def load_seconds(self, seq: SequenceBlocks) -> float:
        """Expected seconds of the loads into `seq`'s blocks, all of them, at the copy's measured pace
        (its L3 hits come into L1 through L2 too); 0 where it loaded nothing."""
        loaded = seq.cached_by_tier["l2"] + seq.cached_by_tier["l3"]
        return self.tiers.load_seconds("l2", self.blocks_needed(loaded))

    def must_stream(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` (and its next token) is larger than all of L1, so
        that it streams its older blocks from L2 (when there is an L2, and L1 is in tierkv's
        layout, which streamed attention reads); never where it `lets_go`."""
        return (self.l2 is not None and self.l1.kv is not None and not self.lets_go
                and self.blocks_needed(num_tokens + 1) > self.l1.num_blocks)

    def max_tokens(self) -> int:
        """The longest sequence the tiers can ever hold (see `max_sequence_tokens`); no limit
        where a sequence `lets_go` of what its window has left."""
        if self.lets_go:
            return sys.maxsize
        return max_sequence_tokens(self.l1.num_blocks, self.l2.num_blocks if self.l2 else 0, self.block_size)

    def step_tokens(self, streams: bool = False) -> int:
        """Most new tokens one sequence computes in a step: a streamed one (`streams`) keeps to
        `stream_window`, and so does one that lets go of what its window has left (`lets_go`,
        whose L1 holds the window beside one such chunk); no limit otherwise."""
        return self.stream_window if streams or self.lets_go else sys.maxsize

    @guarded
    def plan(
        self, tokens, salt: str | None = None, *, budget: int, prefix_caching: bool = True,
        recompute_seconds_per_token: float | None = None, deadline_s: float = 1.0, limit: int | None = None,
    ) -> AdmissionPlan:
        """How to admit `tokens` now, decided in one place (see AdmissionPlan).

        `budget`: tokens the step can still compute (a streamed sequence reserves L1 for its
        cached prefix and one chunk of at most that). `recompute_seconds_per_token`: the
        engine's measured prefill cost, for load-or-recompute (None: load whatever is cached).
        `deadline_s`: how long L3 reads may take before what has not arrived is recomputed.
        `limit`: at most this many tokens hit (as `match`; a cache of one group of layers follows
        the hit of the group that decided it: groups.py). Changes nothing but the lookup
        counters; apply it with `prefetch` and `allocate`, or let `admit` do both.
        """
        bs = self.block_size
        m = self.match(tokens, salt, limit=limit if prefix_caching else 0,
                       recompute_seconds_per_token=recompute_seconds_per_token, window_hits=True)
        num_tokens = len(m.token_bytes) // 4
        stream = self.must_stream(num_tokens)
        fetch = self._l3_part(m) if m.by_tier["l3"] else None
        if fetch is not None and m.window_hits:  # only the blocks the window reads: a window hit needs no more
            fetch = self.window_reads(*fetch)
        fetch_deadline_s = deadline_s
        if fetch is not None and recompute_seconds_per_token is not None and self.tiers.l3.read_measured:
            # a read chosen because it beats recomputing is waited for no longer than recomputing would take
            fetch_deadline_s = min(deadline_s, m.by_tier["l3"] * recompute_seconds_per_token)
        tail, tail_deadline_s = None, 0.0
        if fetch is None and m.tail is not None and not stream:
            # the start of the L3 part is recomputed while its end is read (where every layer
            # slides, the end's last window: `adopt` takes no more). The scheduler abandons the
            # read once waiting for it would take longer than recomputing the tail
            # (Scheduler._tail_on_its_way); this deadline only ends a read nobody abandons (an
            # engine of its own): `deadline_s` past the time recomputing all of the part takes
            tail = self.window_reads(*m.tail)
            tail_deadline_s = (m.tail[1] * bs - m.tokens) * recompute_seconds_per_token + deadline_s
        chunked = stream or self.lets_go  # room for the cached prefix and one chunk; `append` adds the rest
        reserve = min(num_tokens, m.tokens + min(budget, self.stream_window)) if chunked else None
        return AdmissionPlan(
            match=m, stream=stream, reserve=reserve,
            fits=self.can_allocate(num_tokens, m, stream=stream, reserve=reserve),
            fetch=fetch, fetch_deadline_s=fetch_deadline_s,
            tail=tail, tail_deadline_s=tail_deadline_s, adopt_at=None if tail is None else m.tail[0] * bs,
            tail_tokens=0 if tail is None else (m.tail[1] - m.tail[0]) * bs,
        )

    def window_reads(self, first: int, end: int) -> tuple[int, int]:
        """Of blocks [first, end) of a prompt, those a sequence reads once it computes on from
        block `end`: where it lets go of what its windows have left (`lets_go`), from the first
        block its last window reads; all of them otherwise."""
        if not self.lets_go:
            return first, end
        return max(first, self.layout.first_block_read(end * self.block_size)), end

    def admit(
        self, tokens, salt: str | None = None, *, priority: int = 0, deadline_s: float = DEFAULT_L3_DEADLINE_S,
        recompute_seconds_per_token: float | None = None,
    ) -> SequenceBlocks:
        """One call from a prompt to a sequence ready to compute, for engines of their own.

        Looks `tokens` up in every tier, reads the L3 part into L2 (waiting up to `deadline_s`
        seconds, outside the cache's lock; what has not arrived is recomputed), then allocates
        room for the whole prompt (`seq.num_tokens == len(tokens)`: `append` only for tokens past
        it): L1 hits shared, L2 hits loaded, fresh blocks for the rest. `seq.num_cached_tokens` is
        where the engine starts computing (`seq.cached_by_tier`: from which tier); call
        `seq.wait()` (or `wait_for_layer`) before attention reads the blocks.
        `recompute_seconds_per_token`: the engine's prefill cost, so that a slow tier's hit is
        recomputed where that is faster (None: load whatever is cached). This is the
        AdmissionPlan the scheduler of tierkv's engine applies, end to end. Raises CacheFullError
        (holding nothing) when L1 cannot make room, or when the prompt is larger than all of L1
        (tierkv's engine streams those; see `plan`).
        """
        def make_plan() -> AdmissionPlan:
            return self.plan(tokens, salt, budget=len(tokens), deadline_s=deadline_s,
                             recompute_seconds_per_token=recompute_seconds_per_token)

        end = time.monotonic() + deadline_s
        plan = make_plan()
        while plan.fetch is not None and (left := end - time.monotonic()) > 0:
            fetch = self.prefetch(plan.match, left, priority=priority, blocks=plan.fetch)
            if fetch.num_blocks:
                fetch.wait(left)
            elif not self._wait_for_l3_write(end):
                break  # no L2 room, and no L3 write in flight that would make some
            had, plan = len(plan.match.blocks), make_plan()  # what landed is found in L2 now
            if len(plan.match.blocks) <= had and fetch.num_blocks:
                break  # nothing arrived (misses): the rest is recomputed
        if plan.stream:
            raise CacheFullError(f"a prompt of {len(plan.match.token_bytes) // 4} tokens needs more than all "
                                 f"{self.l1.num_blocks} L1 blocks; give L1 more blocks, or use tierkv's engine, "
                                 "which streams such prompts from L2")
        return self.allocate(None, salt, priority=priority, match=plan.match)

    def _wait_for_l3_write(self, end: float) -> bool:
        """Wait, outside the lock, until an L3 job ends (an L2 slot held for a write may then be
        free), and take it in; False when none is in flight."""
        l3 = self.tiers.l3
        if l3 is None or l3.in_flight == 0:
            return False
        l3.wait_any(max(0.0, end - time.monotonic()))
        with self._guard.lock:
            self._guard.check("admit")
            self.tiers.reap()
        return True

    @guarded
    def can_allocate(self, num_tokens: int, match: Match, *, stream: bool = False, reserve: int | None = None) -> bool:
        """Whether `allocate` with these arguments would succeed now."""
        self._check_match(match)
        blocks = match.blocks
        k = self._streamable(blocks) if stream else self._left_behind(blocks)
        return self._shortfall(self._reserve(num_tokens, reserve, len(blocks)), blocks[k:], k) <= 0

    def _left_behind(self, blocks: list[BlockEntry]) -> int:
        """How many leading cached `blocks` no layer reads once the sequence computes on from
        their end (every layer windowed: `KVLayout.first_block_read`): it takes no L1 slot for them."""
        return min(self.layout.first_block_read(len(blocks) * self.block_size), len(blocks))

    def _whole_loads_from(self, blocks: list[BlockEntry]) -> int:
        """The first of the cached `blocks` that a load brings whole: before it, every sliding
        window has left the blocks behind, and a load that can move some layers alone moves the
        full-attention layers only (into private slots: `allocate`)."""
        return self.layout.window_start(len(blocks) * self.block_size) if self.tiers.loads_layers else 0

    def _shortfall(self, num_tokens: int, blocks: list[BlockEntry], offloaded: int = 0) -> int:
        """L1 blocks missing to hold `num_tokens` tokens whose first `offloaded` blocks stay in L2
        and whose next cached blocks are `blocks`."""
        l1_hits = [e for e in blocks if e.l1 >= 0]
        need = self.blocks_needed(num_tokens) - offloaded - len(l1_hits)
        available = self.tiers.l1_room() - sum(1 for e in l1_hits if e.ref == 0)
        return need - available

    def _streamable(self, blocks: list[BlockEntry]) -> int:
        """How many leading cached blocks L2 holds: a streamed sequence reads them from there."""
        if self.l2 is None:
            return 0
        return next((i for i, e in enumerate(blocks) if e.l2 < 0), len(blocks))

    def _reserve(self, num_tokens: int, reserve: int | None, cached_blocks: int) -> int:
        """Tokens to reserve room for: all by default, never fewer than the cached prefix."""
        if reserve is None:
            return num_tokens
        return min(num_tokens, max(reserve, cached_blocks * self.block_size))

    @guarded
    def allocate(
        self, tokens=None, salt: str | None = None, *, priority: int = 0, match: Match | None = None,
        stream: bool = False, reserve: int | None = None, slots: list[int] | None = None, computed: int = 0,
    ) -> SequenceBlocks:
        """Reserve L1 blocks for `tokens`: cached prefix blocks are shared (L1) or loaded (L2), the rest is fresh.

        Uses what L1 and L2 hold now: L3 hits are brought up by `prefetch` first (or recomputed;
        `admit` does both). `match`: a lookup of these tokens and salt made before (`match`,
        `plan`), checked to be one; with it, `tokens` may be None. Raises CacheFullError,
        changing nothing, when L1 cannot make room. Call `seq.wait()` before attention reads the
        sequence's blocks (L2 loads run asynchronously on CUDA); `seq.num_cached_tokens` is how
        much of the prompt need not be computed.

        For sequences larger than L1: `reserve` limits the room taken now to the first `reserve`
        tokens (`append` adds more later), and `stream=True` leaves the leading cached blocks that
        L2 holds in L2, offloaded, instead of loading them (attention streams them).

        With an engine-owned L1 (engine_blocks=), `slots` are the engine's block ids for the
        sequence's first blocks (those it allocated so far: `append` takes the next ones); the
        first `computed` tokens are already in them (the engine's own prefix cache), and the
        cached blocks after those are loaded from L2 into their ids by the engine (`take_moves`).
        """
        if match is None:
            if tokens is None:
                raise UsageError("allocate() needs the prompt's tokens, or a match of them")
            m = self.match(tokens, salt)
        else:
            self._check_match(match, tokens, salt, salted=True)
            m = match
        self.tiers.reap()
        num_tokens = len(m.token_bytes) // 4
        if num_tokens == 0:
            raise UsageError("allocate() needs at least one token")
        # The match's blocks, as far as the match chose to take them (load-or-recompute may stop
        # short of what the index holds), including its L3 part where a prefetch has brought it
        # into L2 since; walked again only then, or if an entry left the index since the match.
        blocks = m.blocks
        taken = self._l3_part(m)[1]
        if taken > len(m.blocks) or m.removals != self.index.removals:
            blocks = self._walk(m.hashes[:taken], m.ns, m.token_bytes, m.window_hits)
        if self.tiers.engine_owned:
            return self._allocate_in_engine_blocks(m, blocks, slots, computed, priority)
        if slots is not None:
            raise UsageError("allocate(slots=) is for a cache whose L1 the engine owns (engine_blocks=); this one "
                             "takes its own L1 blocks")
        k = self._streamable(blocks) if stream else 0
        # hits no layer reads (every layer windowed, and the window past them): no slot, released
        gone = 0 if stream else self._left_behind(blocks)
        offloaded, left, cached = blocks[:k], blocks[k : k + gone], blocks[k + gone :]
        reserved = self._reserve(num_tokens, reserve, len(blocks))
        short = self._shortfall(reserved, cached, k + gone)
        if short > 0:
            raise CacheFullError(f"a sequence of {reserved} tokens needs {short} more L1 blocks than can be freed")
        self.index.hold_l2(offloaded)  # they stay in L2 for as long as the sequence runs
        # L2 hits before `window` get their full-attention layers alone, into slots the sequence
        # keeps private: their other layers are not there for another request to share
        window = self._whole_loads_from(blocks)
        l1_hits = [e for e in cached if e.l1 >= 0]
        l2_hits = [e for i, e in enumerate(cached, start=k + gone) if e.l1 < 0 and i >= window]
        behind = [e for i, e in enumerate(cached, start=k + gone) if e.l1 < 0 and i < window]
        self.index.pin_all(l1_hits)
        self.index.hold_l2(l2_hits + behind)  # the evictions below must not drop what we are about to load
        fresh = self.tiers.take_l1(self.blocks_needed(reserved) - k - gone - len(l1_hits),
                                   loads=len(l2_hits) + len(behind))
        self.tiers.load_pinned(l2_hits, fresh[: len(l2_hits)])
        private = dict(zip(map(id, behind), fresh[len(l2_hits) : len(l2_hits) + len(behind)]))
        partial = self.tiers.load_l2(behind, list(private.values()), full_layers_only=True)
        self.index.release_l2(l2_hits + behind)
        # (a block left behind that no tier holds, None: a window hit's, counted with L1)
        by_tier = self._count_hits(m.query_tokens, [*(e for e in left if e is None or e.l1 >= 0), *l1_hits],
                                   [*offloaded, *(e for e in left if e is not None and e.l1 < 0), *l2_hits, *behind])
        pending = in_flight([*(e.loading for e in cached), partial])
        self.tiers.used([e for e in blocks if e is not None], priority)
        rest = fresh[len(l2_hits) + len(behind) :]
        seq = SequenceBlocks(
            ns=m.ns,
            priority=priority,
            slots=[-1] * (k + gone) + [private.get(id(e), e.l1) for e in cached] + rest,
            entries=[*offloaded, *([None] * gone), *(None if id(e) in private else e for e in cached),
                     *([None] * len(rest))],
            hashes=list(m.hashes),
            committed=len(blocks),
            num_tokens=reserved,
            num_cached_tokens=len(blocks) * self.block_size,
            pending=pending,
            token_bytes=bytearray(m.token_bytes),
            cached_by_tier=by_tier,
            l2_slots=[e.l2 for e in offloaded],
            owner=self,
            in_l3=m.in_l3,
            released=gone,
        )
        self._live[seq] = None  # until free()
        return seq

    @guarded
    def warm(self, match: Match, keep: int = 0, limit: int | None = None) -> int:
        """Start loading the L2 blocks of `match` into L1 before its `allocate`, leaving at least
        `keep` of L1's room (free slots and unpinned blocks) to others, `limit` loads at most. For a
        request that waits for room while others run, or whose load the scheduler spreads over
        steps: most of its prefix lands meanwhile, and its `allocate` finds it in L1 (loads perhaps
        still in flight, which the sequence waits for as for its own) and loads only the rest. The
        blocks stay cached, not held: room a running sequence needs evicts them again at no cost,
        L2 keeping its copies; their first use counts as L2 hits.
        The blocks `allocate` would load whole, first ones first; its L1 hits are not evicted
        for them. None where the engine owns L1, or once an entry of the match left the index.
        Returns how many loads started."""
        self._check_match(match)
        if self.tiers.engine_owned or self.l2 is None or match.removals != self.index.removals:
            return 0
        blocks = match.blocks
        start = max(self._left_behind(blocks), self._whole_loads_from(blocks))
        in_l2 = [e for e in blocks[start:] if e is not None and e.l1 < 0 and e.l2 >= 0]
        l1_hits = [e for e in blocks if e is not None and e.l1 >= 0]
        # while room is made: its L1 hits out of L1's eviction order, and all its L2 blocks out of
        # L2's (evicted blocks written down must not drop those left for allocate either)
        self.index.pin_all(l1_hits)
        self.index.hold_l2(in_l2)
        try:
            # (L1's spare slots stay free: warming into them, the next take would evict to free
            # them again, the blocks just warmed first among the victims where little else is)
            room = self.tiers.l1_room() - self.tiers.spare - keep
            todo = in_l2[: max(0, room if limit is None else min(room, limit))]
            if not todo:
                return 0
            slots = self.tiers.take_l1(len(todo), partial=True, loads=len(todo))
            todo = todo[: len(slots)]
            self.tiers.load_pinned(todo, slots)
            self.index.unpin_all(todo)  # cached like any block, the prompt's head evicted last
            for e in todo:
                e.brought_from = e.brought_from or "l2"  # (one read up from L3 first stays an L3 hit)
            self.counters.warmed_blocks += len(todo)
            return len(todo)
        finally:
            self.index.release_l2(in_l2)
            self.index.unpin_all(l1_hits)

    def _allocate_in_engine_blocks(self, m: Match, blocks: list[BlockEntry], slots, computed: int,
                                   priority: int) -> SequenceBlocks:
        """`allocate` where the engine owns L1: the cached blocks past the engine's `computed`
        ones are loaded from L2 into the engine's `slots`, their L2 copies held until the engine
        reports the load done. tierkv's index never places a block in the engine's L1."""
        bs = self.block_size
        slots = self._engine_slots(slots, "allocate")
        # the engine may give blocks for the first chunk only: `append` adds the rest as it does
        num_tokens = min(len(m.token_bytes) // 4, len(slots) * bs)
        if not isinstance(computed, int) or not 0 <= computed <= len(m.token_bytes) // 4:
            raise UsageError(f"allocate(computed=) takes the tokens the engine already holds, "
                             f"0..{len(m.token_bytes) // 4}, got {computed!r}")
        blocks = blocks[: len(slots)]
        skip = min(computed // bs, len(blocks))
        # a block the engine keeps no memory for (slot -1: its sliding window has left it behind)
        # is not read by the engine, so it is not loaded
        pairs = [(e, s) for e, s in zip(blocks[skip:], slots[skip:]) if s >= 0]
        load = [e for e, _ in pairs]
        self.index.hold_l2(load)
        moved = self.tiers.load_l2(load, [s for _, s in pairs])
        self.tiers.mover.after(lambda: self.index.release_l2(load))
        by_tier = self._count_hits(m.query_tokens, [], load)
        self.tiers.used(blocks, priority)
        seq = SequenceBlocks(
            ns=m.ns, priority=priority, slots=slots, entries=[None] * len(slots), hashes=list(m.hashes),
            committed=len(blocks), num_tokens=num_tokens,
            num_cached_tokens=max(len(blocks) * bs, computed // bs * bs), pending=in_flight([moved]),
            token_bytes=bytearray(m.token_bytes), cached_by_tier=by_tier, owner=self, in_l3=m.in_l3,
        )
        self._live[seq] = None
        return seq

    def _engine_slots(self, slots, call: str) -> list[int]:
        """The engine's block ids `slots` as a list of ints, each a block it has or -1: a block
        position the engine keeps no memory for (its sliding window has left it behind), where
        nothing is loaded or saved."""
        if slots is None:
            raise UsageError(f"{call}() on a cache whose L1 the engine owns needs slots=: the engine's block ids")
        out = [int(s) for s in slots]
        n = self.l1.engine_blocks
        bad = next((s for s in out if not -1 <= s < n), None)
        if bad is not None:
            raise UsageError(f"{call}(slots=) got block id {bad}; the engine has blocks 0..{n - 1} (-1: none kept)")
        return out
