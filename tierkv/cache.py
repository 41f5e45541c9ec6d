"""TieredKVCache: the facade engines talk to.

Two ways in. The simple one, for engines that keep their own KV: `store` a prefix's KV, `match`
a prompt against every tier, `retrieve` the cached prefix back. The block-level one, for paged
engines whose attention reads the L1 pool directly: `allocate` a sequence (pins its L1 hits,
loads its L2 hits, reserves fresh blocks for the rest), `append` room for new tokens, `commit`
blocks as they fill, `free` at the end; `block_table` turns sequences into a kernel input. A
sequence larger than L1 `offload`s its oldest blocks to L2 and attention reads them through
`stream` (streaming.py), one layer at a time.

This file turns those calls into the index's bookkeeping and the Tiering's moves: which blocks
a sequence pins, shares or keeps private, and what it hands back. Which block is evicted,
demoted or copied down is decided in tiering.py (under the policies of policies.py), and block
bytes move in transfer.py; this file copies only the simple API's own tensors (store/retrieve).
It never knows about requests, scheduling or HTTP.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from .config import CacheConfig
from .errors import CacheFullError, ConfigError, ShapeError
from .hashing import hash_blocks, namespace, token_bytes
from .index import BlockEntry
from .layout import KVLayout
from .plan import AdmissionPlan, Match, tail_to_read, worth_loading
from .sequence import SequenceBlocks, fill_block_table
from .streaming import LayerStream, LayerStreamer, StreamPlan
from .tiering import Prefetch, Tiering
from .tiers.codec import BlockId
from .transfer import DONE

log = logging.getLogger(__name__)

DEFAULT_L3_DEADLINE_S = 5.0  # how long retrieve() waits for L3 reads before recomputing instead
SPILL_WAIT_S = 60.0  # how long store() waits, in all, for L3 writes to free L2 room for a spill


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


def _put_blocks(out: torch.Tensor, positions: list[int], blocks: torch.Tensor) -> None:
    """out[:, :, positions] = blocks, as one plain copy when the positions are all of out's blocks."""
    if len(positions) == out.shape[2]:
        out.copy_(blocks)
    else:
        out[:, :, torch.tensor(positions, device=out.device)] = blocks


class TieredKVCache:
    def __init__(
        self,
        layout: KVLayout,
        config: CacheConfig | None = None,
        device: str | torch.device | None = None,
        *,
        model: str = "",
        tp_rank: int = 0,
        exchange=None,
    ) -> None:
        self.layout = layout
        self.config = config = config if config is not None else CacheConfig()
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model, self.tp_rank = model, tp_rank
        self.block_size = layout.block_size
        # exchange: tensor parallel rank 0's way to the other ranks' KV heads (engine/head_exchange.py)
        self.tiers = Tiering(layout, config, self.device, exchange)
        # The parts engines and tests look at directly.
        self.l1, self.l2, self.index, self.counters = self.tiers.l1, self.tiers.l2, self.tiers.index, self.tiers.counters
        self.streamer = LayerStreamer(self.l1, self.l2) if self.l2 is not None else None
        # Private L1 slots that forked sequences share (`fork`): slot -> holders beyond the first.
        # Such a slot goes back to the free list with its last holder.
        self._shared: dict[int, int] = {}

    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def namespace(self, salt: str | None = None) -> bytes:
        # the format L3 stores: an fp8 cache and a bf16 one name their objects apart, and a
        # tensor-parallel engine (which stores every head) names them as a single-GPU one does
        return namespace(self.model, self.tiers.l3_layout.fingerprint, self.tp_rank, salt)

    # ------------------------------------------------------------------ lookups

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
        return Match(matched, by_tier, ns, tb, hashes, blocks, self.index.removals, tail)

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

    def store(self, tokens, kv: torch.Tensor, salt: str | None = None, *, priority: int = 0) -> int:
        """Cache the KV of the full blocks of `tokens`; returns how many leading tokens the cache now holds.

        kv: [layers, 2, len(tokens), kv_heads, head_dim] in the layout's dtype. Blocks already
        cached are skipped. What L1 cannot hold goes straight to L2 in chunks, and on to L3 as
        the write policy says (write-through at once, otherwise when L2 evicts it); when L2's room
        is held by blocks on their way to L3, store() waits for those writes. It keeps less only
        when no tier has room, and never by pushing out an earlier block of this same sequence.
        """
        self._refuse_under_tensor_parallel("store")
        self.tiers.reap()
        tb = token_bytes(tokens)
        expected = self.layout.kv_shape(len(tb) // 4)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != expected or kv.dtype != self.layout.dtype:
            got = f"{tuple(kv.shape)} {kv.dtype}" if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ShapeError(
                f"store() needs kv of shape {expected} [layers, 2, tokens, kv_heads, head_dim] "
                f"and dtype {self.layout.dtype}, got {got}"
            )
        bs = self.block_size
        ns = self.namespace(salt)
        hashes = hash_blocks(tb, bs, ns)
        present: list[BlockEntry] = []
        missing: list[int] = []  # block numbers to store
        parent = 0
        for i, h in enumerate(hashes):
            entry, collided = self.index.lookup(h, parent, ns, tb[i * 4 * bs : (i + 1) * 4 * bs])
            if collided:
                hashes = hashes[:i]
                break  # the hash is taken by another block: this chain cannot be indexed past here
            if entry is None:
                missing.append(i)
            else:
                present.append(entry)
            parent = h
        # this chain's blocks stay where they are while room is made for the rest of it
        in_l1 = [e for e in present if e.l1 >= 0]
        in_l2 = [e for e in present if e.l2 >= 0]
        for e in in_l1:
            self.index.pin(e)
        self.index.hold_l2(in_l2)
        # [layers, 2, tokens, h, d] -> [blocks, layers, 2, bs, h, d]
        L, _, _, H, D = kv.shape
        by_block = kv[:, :, : len(hashes) * bs].reshape(L, 2, len(hashes), bs, H, D).permute(2, 0, 1, 3, 4, 5)
        try:
            slots = self.tiers.take_l1(len(missing), partial=True)
            first, rest = missing[: len(slots)], missing[len(slots) :]
            if first:
                blocks = by_block[torch.tensor(first, device=kv.device)].to(self.device, non_blocking=True)
                self.l1.kv[:, torch.tensor(slots, device=self.device)] = blocks.transpose(0, 1)
                self.tiers.stored(self._enter(hashes, tb, ns, first, "l1", slots, priority))
            if rest and self.l2 is not None:
                self._spill(by_block, hashes, tb, ns, rest, priority, held=in_l2)
        finally:
            for e in in_l1:
                self.index.unpin(e)
            self.index.release_l2(in_l2)
        found = self.index.walk(hashes, ns, tb, bs)
        return (len(found) + self.tiers.l3_present(hashes[len(found) :], len(found))) * bs

    def _enter(self, hashes: list[int], tb: bytes, ns: bytes, blocks: list[int], tier: str, slots: list[int],
               priority: int) -> list[BlockEntry]:
        """Index entries for the chain's blocks `blocks`, whose KV is in `slots` of `tier`."""
        stride = 4 * self.block_size
        new = []
        for i, slot in zip(reversed(blocks), reversed(slots)):  # tail first: the tail is evicted first
            entry = self.index.create(hashes[i], hashes[i - 1] if i else 0, ns, tb[i * stride : (i + 1) * stride],
                                      priority, pos=i)
            self.index.place(entry, tier, slot)
            new.append(entry)
        return new[::-1]

    def _spill(self, by_block: torch.Tensor, hashes: list[int], tb: bytes, ns: bytes, blocks: list[int],
               priority: int, held: list[BlockEntry]) -> None:
        """Write blocks `blocks` of by_block [n, layers, 2, bs, h, d] straight into L2, a chunk at a
        time. `held`: this chain's entries held in L2, which the new ones join; when L2 is full of
        them, the earlier ones move on to L3 and leave `held` once L3 has them (the caller
        releases what is left)."""
        self.synchronize()  # L2 slots are written from the host only after every copy queued out of them
        end = time.monotonic() + SPILL_WAIT_S
        while blocks:
            slots = self.tiers.take_l2(len(blocks))
            if not slots:
                safe = [e for e in held if e.l3 == "written"]
                if safe:  # L2 may now make room with these: L3 holds them
                    self.index.release_l2(safe)
                    held[:] = [e for e in held if e.l3 != "written"]
                    continue
                self.tiers.write_l3(held)
                if self.tiers.wait_l3(end):
                    continue
                break  # no tier has room for the rest
            chunk, blocks = blocks[: len(slots)], blocks[len(slots) :]
            # in L2's format, converted on kv's device (fp8 there when L2 holds fp8)
            picked = by_block[torch.tensor(chunk, device=by_block.device)]
            self.l2.kv[torch.tensor(slots)] = self.tiers.mover.to_host(picked)
            new = self._enter(hashes, tb, ns, chunk, "l2", slots, priority)
            self.index.hold_l2(new)  # later chunks must not push these out
            held += new
            self.tiers.stored(new, "l2")

    def retrieve(self, tokens, salt: str | None = None, *, limit: int | None = None) -> tuple[int, torch.Tensor]:
        """(n, kv): the longest cached prefix of `tokens` (same `limit` rule as `match`) and its KV.

        kv: [layers, 2, n, kv_heads, head_dim] on the cache's device, read from whichever tier
        holds each block; L3 blocks are read first (waiting up to DEFAULT_L3_DEADLINE_S).
        """
        self._refuse_under_tensor_parallel("retrieve")
        m = self.match(tokens, salt, limit=limit)
        direct = None  # [k, L, 2, bs, H, D] on the device: L3 blocks that L2 had no room for
        if m.by_tier["l3"]:
            self.prefetch(m, DEFAULT_L3_DEADLINE_S).wait()
            m = self.match(tokens, salt, limit=limit)
            if m.by_tier["l3"]:
                first, end = self._l3_part(m)
                deadline = time.monotonic() + DEFAULT_L3_DEADLINE_S
                # the run may hold blocks that L2 keeps and L3 does not have yet (a spilled
                # store, or write-back): they are written first, so one read from L3 takes all
                pending = [e for h in m.hashes[first:end] if (e := self.index.entries.get(h)) is not None]
                self.tiers.write_l3(pending)
                while any(e.l3 == "writing" for e in pending) and self.tiers.wait_l3(deadline):
                    pass
                direct = self.tiers.read_l3(self._l3_ids(m, first, end), deadline)
        L, _, bs, H, D = self.layout.block_shape
        n = len(m.blocks)
        k = 0 if direct is None else direct.shape[0]
        out = torch.empty((L, 2, n + k, bs, H, D), dtype=self.layout.dtype, device=self.device)
        in_l1 = [i for i, e in enumerate(m.blocks) if e.l1 >= 0]
        in_l2 = [i for i, e in enumerate(m.blocks) if e.l1 < 0]
        for i in in_l1:
            if m.blocks[i].loading is not None:
                m.blocks[i].loading.wait()
        if in_l1:
            slots = torch.tensor([m.blocks[i].l1 for i in in_l1], device=self.device)
            # [L, k, 2, bs, H, D] -> [L, 2, k, bs, H, D]
            _put_blocks(out, in_l1, self.l1.kv[:, slots].transpose(1, 2))
        if in_l2:
            # [k, L, 2, bs, H, D] -> [L, 2, k, bs, H, D]
            l2_blocks = self.tiers.mover.read_l2([m.blocks[i].l2 for i in in_l2])
            _put_blocks(out, in_l2, l2_blocks.permute(1, 2, 0, 3, 4, 5))
        if k:
            out[:, :, n:] = direct.permute(1, 2, 0, 3, 4, 5).to(self.device)
        self.tiers.count("l1", len(in_l1), into=False)
        self.tiers.count("l2", len(in_l2), into=False)
        self.tiers.used(m.blocks, 0)
        return (n + k) * bs, out.view(L, 2, (n + k) * bs, H, D)

    def _refuse_under_tensor_parallel(self, name: str) -> None:
        # The whole-sequence API writes and reads the pools directly: the other ranks' pools,
        # which mirror this one move by move, would not see it.
        if self.tiers.moves is not None:
            raise ConfigError(f"{name}() is not available on a tensor-parallel engine's cache (each rank holds "
                              f"its own KV heads); use it with tensor_parallel_size=1")

    # ------------------------------------------------------------------ block-level API

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ admission

    @property
    def stream_window(self) -> int:
        """Most tokens a streamed sequence computes or keeps in L1 at once: half of L1, so that
        other requests still run beside it."""
        return stream_window_blocks(self.l1.num_blocks) * self.block_size

    def must_stream(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` (and its next token) is larger than all of L1, so
        that it streams its older blocks from L2 (when there is an L2)."""
        return self.l2 is not None and self.blocks_needed(num_tokens + 1) > self.l1.num_blocks

    def max_tokens(self) -> int:
        """The longest sequence the tiers can ever hold (see `max_sequence_tokens`)."""
        return max_sequence_tokens(self.l1.num_blocks, self.l2.num_blocks if self.l2 else 0, self.block_size)

    def plan(
        self, tokens, salt: str | None = None, *, budget: int, prefix_caching: bool = True,
        recompute_seconds_per_token: float | None = None, deadline_s: float = 1.0,
    ) -> AdmissionPlan:
        """How to admit `tokens` now, decided in one place (see AdmissionPlan).

        `budget`: tokens the step can still compute (a streamed sequence reserves L1 for its
        cached prefix and one chunk of at most that). `recompute_seconds_per_token`: the
        engine's measured prefill cost, for load-or-recompute (None: load whatever is cached).
        `deadline_s`: how long L3 reads may take before what has not arrived is recomputed.
        Changes nothing but the lookup counters; apply it with `prefetch` and `allocate`.
        """
        bs = self.block_size
        num_tokens = len(tokens)
        m = self.match(tokens, salt, limit=None if prefix_caching else 0,
                       recompute_seconds_per_token=recompute_seconds_per_token)
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

    def can_allocate(self, num_tokens: int, match: Match, *, stream: bool = False, reserve: int | None = None) -> bool:
        """Whether `allocate` with these arguments would succeed now."""
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

    def allocate(
        self, tokens, salt: str | None = None, *, priority: int = 0, match: Match | None = None,
        stream: bool = False, reserve: int | None = None,
    ) -> SequenceBlocks:
        """Reserve L1 blocks for `tokens`: cached prefix blocks are shared (L1) or loaded (L2), the rest is fresh.

        Uses what L1 and L2 hold now: L3 hits are brought up by `prefetch` first (or recomputed).
        Raises CacheFullError, changing nothing, when L1 cannot make room. Call `seq.wait()`
        before attention reads the sequence's blocks (L2 loads run asynchronously on CUDA).

        For sequences larger than L1: `reserve` limits the room taken now to the first `reserve`
        tokens (`append` adds more later), and `stream=True` leaves the leading cached blocks that
        L2 holds in L2, offloaded, instead of loading them (attention streams them).
        """
        m = match if match is not None else self.match(tokens, salt)
        self.tiers.reap()
        num_tokens = len(m.token_bytes) // 4
        if num_tokens == 0:
            raise ValueError("allocate() needs at least one token")
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
            l2_slots=[e.l2 for e in offloaded],
        )

    def can_append(self, seq: SequenceBlocks, num_tokens: int = 1) -> bool:
        need = self.blocks_needed(seq.num_tokens + num_tokens) - len(seq.slots)
        return need <= self.tiers.l1_room()

    def append(self, seq: SequenceBlocks, num_tokens: int = 1) -> None:
        """Reserve room for `num_tokens` more tokens; raises CacheFullError (changing nothing) if L1 cannot."""
        need = self.blocks_needed(seq.num_tokens + num_tokens) - len(seq.slots)
        if need > 0:
            slots = self.tiers.take_l1(need)
            seq.slots += slots
            seq.entries += [None] * need
        seq.num_tokens += num_tokens

    def adopt(self, seq: SequenceBlocks, tokens) -> int:
        """Take the blocks right after the sequence's committed prefix from the cache instead of
        computing them, where the cache holds them now (a `prefetch` of `match.tail` landed, or
        another request computed them): L1 copies are shared, L2 ones loaded into the sequence's
        own slots. Returns how many blocks; their tokens count as computed. The last token of
        `tokens` is never taken (its logits must be computed).
        """
        self.tiers.reap()
        bs = self.block_size
        tb = token_bytes(tokens)
        end = min((len(tb) // 4 - 1) // bs, len(seq.slots), len(seq.hashes))
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

    def commit(self, seq: SequenceBlocks, tokens) -> int:
        """Enter the sequence's newly full blocks into the index, so other requests can share them.

        `tokens`: the sequence's tokens whose KV is written (prompt and generated so far).
        Returns the number of blocks committed now.
        """
        bs = self.block_size
        full = min(len(tokens), seq.num_tokens) // bs
        start = seq.committed
        if full <= start:
            return 0
        tb = token_bytes(tokens[start * bs : full * bs])
        if len(seq.hashes) < full:
            known = len(seq.hashes)
            tail = token_bytes(tokens[known * bs : full * bs])
            seq.hashes += hash_blocks(tail, bs, seq.ns, parent=seq.hashes[-1] if known else 0)
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
        self.tiers.stored(new)
        return full - start

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
        full, partial = divmod(num_tokens, self.block_size)
        if n <= 0 or seq.freed or seq.offloaded or len(seq.slots) < full + (partial > 0):
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

    def free(self, seq: SequenceBlocks) -> None:
        """Release everything `seq` holds: shared blocks become evictable (tail first), private ones free."""
        if seq.freed:
            raise ValueError("free() of a sequence that was already freed")
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

    def offload(self, seq: SequenceBlocks, num_blocks: int) -> int:
        """Move the oldest `num_blocks` L1 blocks of `seq` to L2, freeing their L1 room.

        The blocks must hold computed KV (full blocks before the sequence's next token). Shared
        blocks stay indexed (now unpinned in L1, held in L2); private ones move to a private L2
        slot. Returns how many moved: fewer when L2 has no room left.
        """
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

    def stream(self, seqs: list[SequenceBlocks]) -> LayerStream:
        """Start assembling the KV of `seqs` (streamed sequences) layer by layer for one step.

        Returns the step's LayerStream: its `plan.block_tables` [len(seqs), width] index the
        staging buffer that `layer_kv(layer, pool)` fills (see streaming.py).
        """
        plan = StreamPlan.build(seqs, self.device)
        self.tiers.count("l2", plan.l2_blocks, into=False)
        mover = self.tiers.mover
        return self.streamer.start(plan, mover.last if mover is not None else DONE)

    def block_table(
        self, seqs: list[SequenceBlocks], width: int | None = None, device: str | torch.device | None = None
    ) -> torch.Tensor:
        """[len(seqs), width] int32 on `device` (default: the cache's); rows padded with -1."""
        width = width if width is not None else max((len(s.slots) for s in seqs), default=0)
        table = fill_block_table([s.slots for s in seqs], np.empty((len(seqs), width), dtype=np.int32))
        return torch.from_numpy(table).to(device if device is not None else self.device, non_blocking=True)

    # ------------------------------------------------------------------ lifecycle, reporting

    def synchronize(self) -> None:
        """Block until every L1<->L2 transfer issued so far is complete."""
        if self.tiers.mover is not None:
            self.tiers.mover.last.synchronize()

    def flush(self, timeout: float | None = None) -> bool:
        """Write every block that L3 lacks to L3 and wait (shutdown); True if all landed within `timeout`."""
        return self.tiers.flush(timeout)

    def evict(self, tier: str) -> None:
        """Empty `tier` ("l1" or "l2") of every block no running sequence holds, as memory pressure
        would (L1 demotes to L2 by the write policy, L2 writes to L3 first where it admits them).
        For operators and benchmarks: cached prefixes then hit the tier below."""
        if tier not in ("l1", "l2"):
            raise ValueError(f"evict() takes 'l1' or 'l2', got {tier!r}")
        self.tiers.evict_all(tier)

    def close(self) -> None:
        """Finish pending transfers and L3 writes, then release the L3 stores."""
        self.tiers.close()

    def stats(self) -> dict:
        self.tiers.reap()
        out = self.counters.as_dict()
        out["collisions"] = self.index.collisions
        out["blocks"] = len(self.index)
        for tier, pool in (("l1", self.l1), ("l2", self.l2)):
            cap = pool.num_blocks if pool is not None else 0
            used = cap - len(pool.free) if pool is not None else 0
            out["tiers"][tier].update(
                capacity_blocks=cap,
                used_blocks=used,
                evictable_blocks=self.index.evictable(tier),
                capacity_bytes=cap * (pool.layout.bytes_per_block if pool is not None else 0),
                used_bytes=used * (pool.layout.bytes_per_block if pool is not None else 0),
            )
        out["l3_stores"] = self.tiers.l3.stats() if self.tiers.l3 is not None else []
        return out
