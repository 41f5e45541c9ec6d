"""PagedCache: the protocol a paged engine speaks with TieredKVCache.

Lookups (`match`, `prefetch`), admission (`plan`, `admit`, `allocate`: what a prompt takes from
which tier and where the engine starts computing), and the blocks of a running sequence
(`append`, `commit`, `adopt`, `fork`, `offload`, `free`, `block_table`, `stream`). TieredKVCache
(cache.py) is this plus the simple API, lifecycle and stats; it builds the state used here.

Every public method runs under the cache's guard (guard.py) and checks its arguments before it
changes anything: a match made for other tokens, a freed sequence or tokens that do not extend
one raise UsageError and leave the cache as it was. Which block is evicted or copied down is
decided in tiering.py, and bytes move in transfer.py; this file never knows about requests,
scheduling or HTTP.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .errors import CacheFullError, UsageError
from .guard import Guard, guarded
from .hashing import hash_blocks, namespace, token_bytes
from .index import BlockEntry, BlockIndex
from .layout import KVLayout
from .metrics import CacheCounters
from .plan import AdmissionPlan, Match, tail_to_read, worth_loading
from .sequence import LayerSave, SequenceBlocks, fill_block_table
from .streaming import LayerStream, LayerStreamer, StreamPlan
from .tiering import Prefetch, Tiering
from .tiers import DevicePool, HostPool
from .tiers.codec import BlockId
from .transfer import DONE

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


class PagedCache:
    """The block-level API. Mixed into TieredKVCache, which builds these:"""

    layout: KVLayout
    block_size: int
    device: torch.device
    model: str
    tp_rank: int
    tiers: Tiering
    l1: DevicePool
    l2: HostPool | None
    index: BlockIndex
    counters: CacheCounters
    streamer: LayerStreamer | None
    _guard: Guard
    _shared: dict[int, int]  # private L1 slots forked sequences share: slot -> holders beyond the first

    def namespace(self, salt: str | None = None) -> bytes:
        # the format L3 stores: an fp8 cache and a bf16 one name their objects apart, and a
        # tensor-parallel engine (which stores every head) names them as a single-GPU one does
        return namespace(self.model, self.tiers.l3_layout.fingerprint, self.tp_rank, salt)

    # ------------------------------------------------------------------ lookups

    @guarded
    def match(
        self, tokens, salt: str | None = None, *, limit: int | None = None,
        recompute_seconds_per_token: float | None = None,
    ) -> Match:
        """The longest prefix of `tokens` whose full blocks some tier holds.

        At most `limit` tokens count; by default len(tokens) - 1, because the last token of a
        prompt must be computed to get its logits. Pass limit=len(tokens) to match everything.
        With `recompute_seconds_per_token`, the match stops where loading the rest of the hit
        from its tiers is expected to take longer than recomputing it (load-or-recompute); if it
        stops before an L3 part, `tail` says which end of that part is worth reading while the
        start is recomputed (the two overlap: the end's KV does not depend on the start).
        `match.tokens` counts what the tiers hold, L3 included: what a sequence allocated from it
        starts with is `seq.num_cached_tokens` (`admit` brings the L3 part in first).
        """
        self.tiers.reap()
        tb = token_bytes(tokens)
        n = len(tb) // 4
        limit = max(n - 1, 0) if limit is None else max(0, min(limit, n))
        ns = self.namespace(salt)
        # limit=0 is how an engine with prefix caching off allocates: nothing to hash or look up
        hashes = hash_blocks(tb, self.block_size, ns) if limit else []
        usable = hashes[: limit // self.block_size]
        blocks = self.index.walk(usable, ns, tb, self.block_size)
        l3_blocks = (self.tiers.l3_present(hashes[len(blocks) :], len(blocks), len(usable) - len(blocks))
                     if len(blocks) < len(usable) else 0)
        tail = None
        if recompute_seconds_per_token is not None:
            per_block = recompute_seconds_per_token * self.block_size
            found, found_l3 = len(blocks), l3_blocks
            blocks, l3_blocks = worth_loading(self.tiers, blocks, l3_blocks, len(usable), per_block)
            if found_l3 and not l3_blocks and len(blocks) == found:
                tail = tail_to_read(self.tiers, found, found + found_l3, per_block)
        by_tier = {"l1": 0, "l2": 0, "l3": l3_blocks * self.block_size}
        for e in blocks:
            by_tier[e.tier()] += self.block_size
        matched = (len(blocks) + l3_blocks) * self.block_size
        c = self.counters
        c.queries += 1
        c.query_tokens += limit
        c.hit_tokens += matched
        for tier, hit in by_tier.items():
            c.tiers[tier].hit_tokens += hit
        return Match(matched, by_tier, ns, tb, hashes, blocks, self.index.removals, tail, owner=self)

    @guarded
    def prefetch(
        self, match: Match, deadline_s: float | None = None, *, priority: int = 0,
        blocks: tuple[int, int] | None = None,
    ) -> Prefetch:
        """Start bringing the match's L3 blocks into L2, in the background.

        Returns at once; once `done()`, `match`/`allocate` find the blocks that arrived in L2.
        What has not arrived `deadline_s` seconds from now is not read: the engine recomputes it.
        `blocks=(j, m)` reads blocks j..m-1 of the prompt instead (`match.tail`), which a running
        sequence takes with `adopt` once it has computed the blocks before them.
        """
        self._check_match(match)
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        return self.tiers.prefetch(self._l3_ids(match, *(blocks or self._l3_part(match))), deadline, priority)

    def _l3_part(self, match: Match) -> tuple[int, int]:
        """Blocks [first, end) of the match's prompt that it found in L3 (after its L1/L2 blocks)."""
        return len(match.blocks), match.tokens // self.block_size

    def _l3_ids(self, match: Match, first: int, end: int) -> list[BlockId]:
        """BlockIds of blocks first..end-1 of the match's prompt, in chain order."""
        stride = 4 * self.block_size
        return [
            BlockId(match.hashes[i], match.hashes[i - 1] if i else 0, match.ns,
                    match.token_bytes[i * stride : (i + 1) * stride], i)
            for i in range(first, end)
        ]

    def _check_match(self, match: Match, tokens=None, salt: str | None = None, *, salted: bool = False) -> None:
        """A match handed back to the cache must be one of its own, for `tokens` and `salt` when given."""
        if not isinstance(match, Match) or match.owner is not self:
            raise UsageError("the match was not made by this cache's match() or plan(); look the tokens up here")
        if salted and match.ns != self.namespace(salt):
            raise UsageError("the match was made for another salt (cache_salt) than the one given; "
                             "pass the salt it was made with, or match the tokens under this salt")
        if tokens is not None and token_bytes(tokens) != match.token_bytes:
            raise UsageError("the match was made for other tokens than the ones given; pass the tokens it "
                             "was made for (or tokens=None), or match these tokens")

    # ------------------------------------------------------------------ admission

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def stream_window(self) -> int:
        """Most tokens a streamed sequence computes or keeps in L1 at once: half of L1, so that
        other requests still run beside it."""
        return stream_window_blocks(self.l1.num_blocks) * self.block_size

    def must_stream(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` (and its next token) is larger than all of L1, so
        that it streams its older blocks from L2 (when there is an L2, and L1 is in tierkv's
        layout, which streamed attention reads)."""
        return (self.l2 is not None and self.l1.kv is not None
                and self.blocks_needed(num_tokens + 1) > self.l1.num_blocks)

    def max_tokens(self) -> int:
        """The longest sequence the tiers can ever hold (see `max_sequence_tokens`)."""
        return max_sequence_tokens(self.l1.num_blocks, self.l2.num_blocks if self.l2 else 0, self.block_size)

    @guarded
    def plan(
        self, tokens, salt: str | None = None, *, budget: int, prefix_caching: bool = True,
        recompute_seconds_per_token: float | None = None, deadline_s: float = 1.0,
    ) -> AdmissionPlan:
        """How to admit `tokens` now, decided in one place (see AdmissionPlan).

        `budget`: tokens the step can still compute (a streamed sequence reserves L1 for its
        cached prefix and one chunk of at most that). `recompute_seconds_per_token`: the
        engine's measured prefill cost, for load-or-recompute (None: load whatever is cached).
        `deadline_s`: how long L3 reads may take before what has not arrived is recomputed.
        Changes nothing but the lookup counters; apply it with `prefetch` and `allocate`, or let
        `admit` do both.
        """
        bs = self.block_size
        m = self.match(tokens, salt, limit=None if prefix_caching else 0,
                       recompute_seconds_per_token=recompute_seconds_per_token)
        num_tokens = len(m.token_bytes) // 4
        stream = self.must_stream(num_tokens)
        fetch = self._l3_part(m) if m.by_tier["l3"] else None
        tail, tail_deadline_s = None, 0.0
        if fetch is None and m.tail is not None and not stream:
            # the start of the L3 part is recomputed while its end is read: allow the read twice
            # the recompute's expected time before giving up on it
            head_s = (m.tail[0] * bs - m.tokens) * (recompute_seconds_per_token or 0.0)
            tail, tail_deadline_s = m.tail, 2 * head_s + deadline_s
        reserve = min(num_tokens, m.tokens + min(budget, self.stream_window)) if stream else None
        return AdmissionPlan(
            match=m, stream=stream, reserve=reserve,
            fits=self.can_allocate(num_tokens, m, stream=stream, reserve=reserve),
            fetch=fetch, fetch_deadline_s=deadline_s,
            tail=tail, tail_deadline_s=tail_deadline_s, adopt_at=None if tail is None else tail[0] * bs,
        )

    def admit(
        self, tokens, salt: str | None = None, *, priority: int = 0, deadline_s: float = DEFAULT_L3_DEADLINE_S,
        recompute_seconds_per_token: float | None = None,
    ) -> SequenceBlocks:
        """One call from a prompt to a sequence ready to compute, for engines of their own.

        Looks `tokens` up in every tier, reads the L3 part into L2 (waiting up to `deadline_s`
        seconds, outside the cache's lock; what has not arrived is recomputed), then allocates:
        L1 hits shared, L2 hits loaded, fresh blocks for the rest. `seq.num_cached_tokens` is
        where the engine starts computing; call `seq.wait()` (or `wait_for_layer`) before
        attention reads the blocks. `recompute_seconds_per_token`: the engine's prefill cost, so
        that a slow tier's hit is recomputed where that is faster (None: load whatever is cached).
        This is the AdmissionPlan the scheduler of tierkv's engine applies, end to end. Raises
        CacheFullError (holding nothing) when L1 cannot make room, or when the prompt is larger
        than all of L1 (tierkv's engine streams those; see `plan`).
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
        k = self._streamable(blocks) if stream else 0
        return self._shortfall(self._reserve(num_tokens, reserve, len(blocks)), blocks[k:], k) <= 0

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
        stream: bool = False, reserve: int | None = None,
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
            blocks = self.index.walk(m.hashes[:taken], m.ns, m.token_bytes, self.block_size)
        k = self._streamable(blocks) if stream else 0
        offloaded, cached = blocks[:k], blocks[k:]
        reserved = self._reserve(num_tokens, reserve, len(blocks))
        short = self._shortfall(reserved, cached, k)
        if short > 0:
            raise CacheFullError(f"a sequence of {reserved} tokens needs {short} more L1 blocks than can be freed")
        self.index.hold_l2(offloaded)  # they stay in L2 for as long as the sequence runs
        l1_hits = [e for e in cached if e.l1 >= 0]
        l2_hits = [e for e in cached if e.l1 < 0]
        for e in l1_hits:
            self.index.pin(e)
        self.index.hold_l2(l2_hits)  # the evictions below must not drop what we are about to load
        fresh = self.tiers.take_l1(self.blocks_needed(reserved) - k - len(l1_hits))
        self.tiers.load_pinned(l2_hits, fresh[: len(l2_hits)])
        self.index.release_l2(l2_hits)
        pending = [e.loading for e in cached if e.loading is not None and not e.loading.done()]
        self.tiers.used(blocks, priority)
        rest = fresh[len(l2_hits) :]
        return SequenceBlocks(
            ns=m.ns,
            priority=priority,
            slots=[-1] * k + [e.l1 for e in cached] + rest,
            entries=[*blocks, *([None] * len(rest))],
            hashes=list(m.hashes),
            committed=len(blocks),
            num_tokens=reserved,
            num_cached_tokens=len(blocks) * self.block_size,
            pending=pending,
            token_bytes=bytearray(m.token_bytes),
            l2_slots=[e.l2 for e in offloaded],
            owner=self,
        )

    # ------------------------------------------------------------------ a running sequence

    def _check_seq(self, seq: SequenceBlocks, call: str) -> None:
        if not isinstance(seq, SequenceBlocks) or seq.owner is not self:
            raise UsageError(f"{call}() of a sequence this cache did not allocate; pass one from its "
                             "allocate() or admit()")
        if seq.freed:
            raise UsageError(f"{call}() of a sequence that was already freed; allocate it again")

    @guarded
    def can_append(self, seq: SequenceBlocks, num_tokens: int = 1) -> bool:
        self._check_seq(seq, "can_append")
        need = self.blocks_needed(seq.num_tokens + num_tokens) - len(seq.slots)
        return need <= self.tiers.l1_room()

    @guarded
    def append(self, seq: SequenceBlocks, num_tokens: int = 1) -> None:
        """Reserve room for `num_tokens` more tokens; raises CacheFullError (changing nothing) if L1 cannot."""
        self._check_seq(seq, "append")
        if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise UsageError(f"append() takes a number of tokens >= 0, got {num_tokens!r}")
        need = self.blocks_needed(seq.num_tokens + num_tokens) - len(seq.slots)
        if need > 0:
            slots = self.tiers.take_l1(need)
            seq.slots += slots
            seq.entries += [None] * need
        seq.num_tokens += int(num_tokens)

    @guarded
    def adopt(self, seq: SequenceBlocks, tokens) -> int:
        """Take the blocks right after the sequence's committed prefix from the cache instead of
        computing them, where the cache holds them now (a `prefetch` of `match.tail` landed, or
        another request computed them): L1 copies are shared, L2 ones loaded into the sequence's
        own slots. Returns how many blocks; their tokens count as computed. The last token of
        `tokens` is never taken (its logits must be computed).
        """
        self._check_seq(seq, "adopt")
        self.tiers.reap()
        bs = self.block_size
        tb = token_bytes(tokens)
        end = min((len(tb) // 4 - 1) // bs, len(seq.slots), len(seq.hashes))
        self._check_extends(seq, tb[4 * seq.committed * bs : 4 * end * bs], seq.committed * bs, "adopt")
        start = i = seq.committed
        from_l2: list[tuple[int, BlockEntry]] = []
        while i < end and seq.entries[i] is None and seq.slots[i] >= 0:
            entry, _ = self.index.lookup(seq.hashes[i], seq.hashes[i - 1] if i else 0, seq.ns,
                                         tb[i * 4 * bs : (i + 1) * 4 * bs])
            if entry is None:
                break
            if entry.l1 >= 0:  # share it; the private slot we had reserved for it goes back
                self.index.pin(entry)
                self.tiers.give_l1([seq.slots[i]])
                seq.slots[i] = entry.l1
                if entry.loading is not None and not entry.loading.done():
                    seq.pending.append(entry.loading)
            else:
                from_l2.append((i, entry))
            seq.entries[i] = entry
            i += 1
        load = self.tiers.load_pinned([e for _, e in from_l2], [seq.slots[j] for j, _ in from_l2])
        if load is not DONE:
            seq.pending.append(load)
        self.tiers.used(seq.entries[start:i], seq.priority)
        seq.committed = i
        return i - start

    def _check_extends(self, seq: SequenceBlocks, tb: bytes, start: int, call: str) -> None:
        """`tb`, the token_bytes of positions start.., must equal what the sequence knows there;
        what it did not know yet is added (the tokens generated since)."""
        known = seq.token_bytes
        overlap = max(0, min(len(tb), len(known) - 4 * start))
        if tb[:overlap] != known[4 * start : 4 * start + overlap]:
            given = np.frombuffer(tb[:overlap], dtype="<i4")
            first = start + int(np.argmax(given != np.frombuffer(known, dtype="<i4")[start : start + len(given)]))
            raise UsageError(f"{call}() got a token at position {first} that differs from the sequence's: pass "
                             "the tokens it was allocated for, followed by those generated since")
        known += tb[overlap:]

    @guarded
    def commit(self, seq: SequenceBlocks, tokens) -> int:
        """Enter the sequence's newly full blocks into the index, so other requests can share them.

        `tokens`: the sequence's tokens whose KV is written (prompt and generated so far). The
        tokens of the blocks entered now must equal those the sequence was allocated for, where
        it knows them (UsageError otherwise); earlier blocks were checked when they were entered.
        Returns the number of blocks committed now.
        """
        self._check_seq(seq, "commit")
        bs = self.block_size
        full = min(len(tokens), seq.num_tokens) // bs
        start = seq.committed
        if full <= start:
            return 0
        tb = token_bytes(tokens[start * bs : full * bs])
        self._check_extends(seq, tb, start * bs, "commit")
        if len(seq.hashes) < full:
            known_hashes = len(seq.hashes)
            tail = token_bytes(tokens[known_hashes * bs : full * bs])
            seq.hashes += hash_blocks(tail, bs, seq.ns, parent=seq.hashes[-1] if known_hashes else 0)
        new = []
        for i in range(start, full):
            h, parent = seq.hashes[i], seq.hashes[i - 1] if i else 0
            blk = tb[(i - start) * 4 * bs : (i - start + 1) * 4 * bs]
            entry, collided = self.index.lookup(h, parent, seq.ns, blk)
            if seq.slots[i] < 0 or collided or (entry is not None and entry.l1 >= 0):
                continue  # someone else holds this block (or its hash): ours stays private
            if entry is None:
                entry = self.index.create(h, parent, seq.ns, blk, seq.priority, pos=i)
                new.append(entry)
            self.index.pin(entry)
            self.index.place(entry, "l1", seq.slots[i])
            seq.entries[i] = entry
        seq.committed = full
        if seq.saving is not None:
            self._saved(seq, new, full)
        self.tiers.stored(new)  # under write-through, copies down what a layer-by-layer save did not
        return full - start

    def _saved(self, seq: SequenceBlocks, new: list[BlockEntry], full: int) -> None:
        """Commit of blocks that `save_layer` copied: the copy is finished (the layers not saved
        yet go now, after the forward that wrote them) and the new entries live in the L2 slots
        it filled; slots of blocks that stayed private or were not committed are given back."""
        save, seq.saving = seq.saving, None
        layers = self.layout.num_layers
        l1_slots = [seq.slots[i] for i in save.blocks]
        if save.layers < layers:
            save.moved = self.tiers.save_layers(l1_slots, save.l2_slots, range(save.layers, layers))
        at = dict(zip(save.blocks, save.l2_slots))
        placed = [(e, at.pop(e.pos)) for e in new if e.pos in at]
        if placed:
            self.tiers.copied_down([e for e, _ in placed], [slot for _, slot in placed], save.moved)
        if at:
            self._drop_save(save, list(at.values()))

    def _drop_save(self, save: LayerSave, l2_slots: list[int]) -> None:
        """Give back L2 slots a layer-by-layer save filled for nothing, once its copy has ended (an
        L3 read may write them from another thread next, and the copy reads the sequence's L1
        slots). A host wait, on a rare path: blocks another request entered first, or not committed."""
        save.moved.synchronize()
        self.tiers.give_l2(l2_slots)

    @guarded
    def fork(self, seq: SequenceBlocks, n: int, num_tokens: int) -> list[SequenceBlocks]:
        """Up to `n` new sequences that begin as the first `num_tokens` tokens of `seq` (parallel
        sampling: n choices of one prompt, computed and stored once).

        Their KV must be written already, or queued on the current stream. Every full block is
        shared, not copied: an indexed one is pinned once more per new sequence, a private one
        is counted in `_shared` and goes back to the free list with its last holder. The partial
        last block is copied on the device into a fresh block of each new sequence (copy on
        write: each writes its own next tokens there). Fewer than `n` when L1 has no room for
        those copies; none when `seq` streams from L2 (its siblings then go through `allocate`).
        """
        self._check_seq(seq, "fork")
        full, partial = divmod(num_tokens, self.block_size)
        if n <= 0 or seq.offloaded or len(seq.slots) < full + (partial > 0):
            return []
        fresh = self.tiers.take_l1(n, partial=True) if partial else []
        count = len(fresh) if partial else n
        if fresh:
            self.tiers.copy_l1([seq.slots[full]] * len(fresh), fresh)
        slots, entries = seq.slots[:full], seq.entries[:full]
        for _ in range(count):
            for slot, entry in zip(slots, entries):
                if entry is None:
                    self._shared[slot] = self._shared.get(slot, 0) + 1
                else:
                    self.index.pin(entry)
        return [
            SequenceBlocks(
                ns=seq.ns, priority=seq.priority, slots=slots + fresh[i : i + 1],
                entries=entries + [None] * (partial > 0), hashes=seq.hashes[:full],
                committed=min(seq.committed, full), num_tokens=num_tokens,
                num_cached_tokens=seq.num_cached_tokens, pending=list(seq.pending),
                token_bytes=seq.token_bytes[: 4 * num_tokens], owner=self,
            )
            for i in range(count)
        ]

    def _give_private(self, slots: list[int]) -> None:
        """Private L1 slots a sequence lets go of: free unless a forked sibling still holds them."""
        if self._shared:
            free = []
            for s in slots:
                holders = self._shared.get(s)
                if holders is None:
                    free.append(s)
                elif holders == 1:
                    del self._shared[s]
                else:
                    self._shared[s] = holders - 1
            slots = free
        self.tiers.give_l1(slots)

    @guarded
    def free(self, seq: SequenceBlocks) -> None:
        """Release everything `seq` holds: shared blocks become evictable (tail first), private ones free."""
        self._check_seq(seq, "free")
        if seq.saving is not None:  # saved layer by layer but never committed
            self._drop_save(seq.saving, seq.saving.l2_slots)
            seq.saving = None
        k = seq.offloaded
        if k:
            self.streamer.synchronize()  # its L2 slots may be read by a streamed load in flight
        private = []
        for slot, entry in zip(reversed(seq.slots[k:]), reversed(seq.entries[k:])):
            if entry is None:
                private.append(slot)
            else:
                self.index.unpin(entry)
        self._give_private(private)
        for slot, entry in zip(reversed(seq.l2_slots), reversed(seq.entries[:k])):
            if entry is None:
                self.tiers.give_l2([slot])
            else:
                self.index.release_l2([entry])
        seq.slots, seq.entries, seq.l2_slots, seq.freed = [], [], [], True

    # ------------------------------------------------------------------ sequences larger than L1

    @guarded
    def offload(self, seq: SequenceBlocks, num_blocks: int) -> int:
        """Move the oldest `num_blocks` L1 blocks of `seq` to L2, freeing their L1 room.

        The blocks must hold computed KV (full blocks before the sequence's next token). Shared
        blocks stay indexed (now unpinned in L1, held in L2); private ones move to a private L2
        slot. Returns how many moved: fewer when L2 has no room left.
        """
        self._check_seq(seq, "offload")
        if self.l2 is None or num_blocks <= 0:
            return 0
        first = seq.offloaded
        todo = range(first, min(first + num_blocks, len(seq.slots)))
        self.tiers.write_down([e for i in todo if (e := seq.entries[i]) is not None])
        private = [i for i in todo if seq.entries[i] is None]
        private_l2 = dict(zip(private, self.tiers.take_l2(len(private))))
        # Offloaded blocks stay a prefix: stop at the first block that found no room in L2.
        n = next((j for j, i in enumerate(todo) if not self._has_l2_copy(seq.entries[i], i in private_l2)), len(todo))
        moved = todo[:n]
        self.tiers.give_l2([slot for i, slot in private_l2.items() if i not in moved])
        copies = [(seq.slots[i], private_l2[i]) for i in moved if seq.entries[i] is None]
        if copies:
            self.tiers.copy_down([a for a, _ in copies], [b for _, b in copies])
            self.tiers.count("l2", len(copies), into=True)
        for i in moved:
            e = seq.entries[i]
            if e is None:
                seq.l2_slots.append(private_l2[i])
            else:
                self.index.hold_l2([e])
                self.index.unpin(e)
                seq.l2_slots.append(e.l2)
        self._give_private([seq.slots[i] for i in moved if seq.entries[i] is None])
        if copies:
            self.tiers.fence()  # the freed L1 slots are reused only after the copies out of them
        for i in moved:
            seq.slots[i] = -1
        return n

    @staticmethod
    def _has_l2_copy(entry: BlockEntry | None, private_slot: bool) -> bool:
        return private_slot if entry is None else entry.l2 >= 0

    @guarded
    def stream(self, seqs: list[SequenceBlocks]) -> LayerStream:
        """Start assembling the KV of `seqs` (streamed sequences) layer by layer for one step.

        Returns the step's LayerStream: its `plan.block_tables` [len(seqs), width] index the
        staging buffer that `layer_kv(layer, pool)` fills (see streaming.py).
        """
        for seq in seqs:
            self._check_seq(seq, "stream")
        plan = StreamPlan.build(seqs, self.device)
        self.tiers.count("l2", plan.l2_blocks, into=False)
        mover = self.tiers.mover
        return self.streamer.start(plan, mover.last if mover is not None else DONE)

    @guarded
    def block_table(
        self, seqs: list[SequenceBlocks], width: int | None = None, device: str | torch.device | None = None
    ) -> torch.Tensor:
        """[len(seqs), width] int32 on `device` (default: the cache's); rows padded with -1."""
        for seq in seqs:
            self._check_seq(seq, "block_table")
        width = width if width is not None else max((len(s.slots) for s in seqs), default=0)
        table = fill_block_table([s.slots for s in seqs], np.empty((len(seqs), width), dtype=np.int32))
        return torch.from_numpy(table).to(device if device is not None else self.device, non_blocking=True)

    # ------------------------------------------------------------------ per-layer hooks

    @guarded
    def wait_for_layer(self, layer: int, seqs: list[SequenceBlocks]) -> None:
        """Order the current stream after the L2 loads of layer `layer` of `seqs`' blocks, and no
        more (no host sync): call it before that layer's attention, in place of `seq.wait()`, so
        that the first layers compute while the later ones still load. Loads go in
        LOAD_LAYER_GROUPS groups of layers (transfer.py), so waiting for layer 0 waits for its group."""
        if not 0 <= layer < self.layout.num_layers:
            raise UsageError(f"wait_for_layer() takes a layer in 0..{self.layout.num_layers - 1}, got {layer}")
        for seq in seqs:
            self._check_seq(seq, "wait_for_layer")
            for load in seq.pending:
                load.wait_layer(layer)

    @guarded
    def save_layer(self, layer: int, seqs: list[SequenceBlocks]) -> None:
        """Copy layer `layer` of the blocks this step fills to L2 now, right after the forward
        wrote them (call it after that layer's K/V write, layers in order from 0), so that the
        copy down overlaps the rest of the forward; `commit` then enters the blocks in L1 and L2
        (and, write-through, L3) without another copy. The step's full blocks are those up to
        the room `append` made (`seq.num_tokens`). Only write-through copies down at commit:
        under write-back and selective, blocks go down later, and this does nothing; nor does it
        when L2 holds another format (fp8), whose blocks are converted whole at commit."""
        if not 0 <= layer < self.layout.num_layers:
            raise UsageError(f"save_layer() takes a layer in 0..{self.layout.num_layers - 1}, got {layer}")
        for seq in seqs:
            self._check_seq(seq, "save_layer")
        if self.l2 is None or self.config.write_policy != "write_through" or self.tiers.mover.l2_planes is None:
            return
        l1_slots, l2_slots, saves = [], [], []
        for seq in seqs:
            save = seq.saving
            if save is None and layer == 0:
                bs = self.block_size
                blocks = [i for i in range(seq.committed, seq.num_tokens // bs) if seq.slots[i] >= 0]
                slots = self.tiers.take_l2(len(blocks))  # fewer when L2 is full: the rest go down at commit
                save = seq.saving = LayerSave(blocks[: len(slots)], slots) if slots else None
            if save is None:
                continue
            if save.layers != layer:
                raise UsageError(f"save_layer() takes the layers in order from 0: this sequence's next is "
                                 f"{save.layers}, got {layer}")
            l1_slots += [seq.slots[i] for i in save.blocks]
            l2_slots += save.l2_slots
            saves.append(save)
        if not saves:
            return
        moved = self.tiers.save_layers(l1_slots, l2_slots, range(layer, layer + 1))
        for save in saves:
            save.layers, save.moved = layer + 1, moved
