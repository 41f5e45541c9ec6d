"""TieredKVCache: the facade engines talk to.

Two ways in. The simple one, for engines that keep their own KV: `store` a prefix's KV, `match`
a prompt against every tier, `retrieve` the cached prefix back. The block-level one, for paged
engines whose attention reads the L1 pool directly: `allocate` a sequence (pins its L1 hits,
loads its L2 hits, reserves fresh blocks for the rest), `append` room for new tokens, `commit`
blocks as they fill, `free` at the end; `block_table` turns sequences into a kernel input.

Here is where tiers meet policies: which block is evicted, demoted or copied down. This file
never knows about requests, scheduling or HTTP, and never moves bytes itself (transfer.py does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from . import kernels
from .config import CacheConfig
from .errors import CacheFullError, ConfigError, ShapeError
from .hashing import hash_blocks, namespace, token_bytes
from .index import BlockEntry, BlockIndex
from .layout import KVLayout
from .metrics import CacheCounters
from .tiers import DevicePool, HostPool
from .tiers.pool import blocks_for
from .transfer import DONE, BlockMover, Transfer

log = logging.getLogger(__name__)

DEFAULT_CPU_L1 = 2**30


@dataclass(slots=True)
class Match:
    """The longest cached prefix of a prompt. `tokens` is a multiple of the block size."""

    tokens: int
    by_tier: dict[str, int]  # tokens served by each tier: {"l1": .., "l2": .., "l3": ..}
    ns: bytes = field(repr=False)
    token_bytes: bytes = field(repr=False)
    hashes: list[int] = field(repr=False)  # chained hashes of every full block of the prompt
    blocks: list[BlockEntry] = field(repr=False)  # the matched blocks, in order


@dataclass(slots=True, eq=False)
class SequenceBlocks:
    """The L1 blocks one running sequence holds. Made by `allocate`, released by `free`."""

    ns: bytes
    priority: int
    slots: list[int]  # L1 slot of each block, in token order: the sequence's block table
    entries: list[BlockEntry | None]  # the index entry each slot belongs to; None = private to this sequence
    hashes: list[int]  # chained hashes known so far (at least those of the committed blocks)
    committed: int  # leading blocks already committed to the index
    num_tokens: int  # tokens the slots are reserved for
    num_cached_tokens: int  # prefix tokens that came from the cache at allocation
    pending: list[Transfer]  # loads into these slots still in flight
    freed: bool = False

    def wait(self) -> None:
        """Order the current CUDA stream after the loads into this sequence's blocks (no host sync)."""
        for t in self.pending:
            t.wait()
        self.pending = [t for t in self.pending if not t.done()]

    def slot_of(self, position: int, block_size: int) -> int:
        return self.slots[position // block_size] * block_size + position % block_size


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
    ) -> None:
        self.layout = layout
        self.config = config = config if config is not None else CacheConfig()
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if config.l3:
            raise ConfigError("CacheConfig.l3 is not supported yet: L3 tiers are not wired into the cache; use l3=[]")
        self.model, self.tp_rank = model, tp_rank
        self.block_size = layout.block_size
        l1_bytes = config.l1 if config.l1 is not None else self._default_l1()
        l1_blocks = blocks_for(l1_bytes, layout.bytes_per_block, "CacheConfig.l1")
        if l1_blocks == 0:
            raise ConfigError(f"CacheConfig.l1 must hold at least one block of {layout.bytes_per_block} bytes, got 0")
        self.l1 = DevicePool(layout, l1_blocks, self.device)
        l2_blocks = blocks_for(config.l2, layout.bytes_per_block, "CacheConfig.l2")
        self.l2 = HostPool(layout, l2_blocks) if l2_blocks else None
        self.mover = BlockMover(self.l1, self.l2) if self.l2 else None
        self.index = BlockIndex(config.eviction)
        self.counters = CacheCounters()

    def _default_l1(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free // 2
        return DEFAULT_CPU_L1

    def namespace(self, salt: str | None = None) -> bytes:
        return namespace(self.model, self.layout.fingerprint, self.tp_rank, salt)

    # ------------------------------------------------------------------ lookups

    def match(self, tokens, salt: str | None = None, *, limit: int | None = None) -> Match:
        """The longest prefix of `tokens` whose full blocks some tier holds.

        At most `limit` tokens count; by default len(tokens) - 1, because the last token of a
        prompt must be computed to get its logits. Pass limit=len(tokens) to match everything.
        """
        tb = token_bytes(tokens)
        n = len(tb) // 4
        limit = max(n - 1, 0) if limit is None else max(0, min(limit, n))
        ns = self.namespace(salt)
        hashes = hash_blocks(tb, self.block_size, ns)
        blocks = self.index.walk(hashes[: limit // self.block_size], ns, tb, self.block_size)
        by_tier = {"l1": 0, "l2": 0, "l3": 0}
        for e in blocks:
            by_tier[e.tier()] += self.block_size
        matched = len(blocks) * self.block_size
        c = self.counters
        c.queries += 1
        c.query_tokens += limit
        c.hit_tokens += matched
        for tier, hit in by_tier.items():
            c.tiers[tier].hit_tokens += hit
        return Match(matched, by_tier, ns, tb, hashes, blocks)

    def store(self, tokens, kv: torch.Tensor, salt: str | None = None, *, priority: int = 0) -> int:
        """Cache the KV of the full blocks of `tokens`; returns how many leading tokens the cache now holds.

        kv: [layers, 2, len(tokens), kv_heads, head_dim] in the layout's dtype. Blocks already
        cached are skipped. When L1 is all pinned, only the blocks that fit are stored.
        """
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
                break  # the hash is taken by another block: this chain cannot be indexed past here
            if entry is None:
                missing.append(i)
            else:
                present.append(entry)
            parent = h
        held = [e for e in present if e.l1 >= 0]
        for e in held:  # keep this chain's L1 blocks while making room for the rest of it
            self.index.pin(e)
        try:
            slots = self._take_l1(len(missing), partial=True)
        finally:
            for e in held:
                self.index.unpin(e)
        missing = missing[: len(slots)]
        if missing:
            L, _, T, H, D = kv.shape
            # [layers, 2, tokens, h, d] -> [layers, blocks, 2, bs, h, d]
            blocks = kv[:, :, : len(hashes) * bs].reshape(L, 2, len(hashes), bs, H, D).transpose(1, 2)
            src = blocks[:, torch.tensor(missing, device=kv.device)].to(self.device, non_blocking=True)
            self.l1.kv[:, torch.tensor(slots, device=self.device)] = src
        new = []
        for i, slot in zip(reversed(missing), reversed(slots)):  # tail first: the tail is evicted first
            parent = hashes[i - 1] if i else 0
            entry = self.index.create(hashes[i], parent, ns, tb[i * 4 * bs : (i + 1) * 4 * bs], priority)
            self.index.place(entry, "l1", slot)
            new.append(entry)
        self._count_in("l1", len(new))
        self.counters.stored_blocks += len(new)
        if self.config.write_policy == "write_through":
            self._write_down(new[::-1])
        return len(self.index.walk(hashes, ns, tb, bs)) * bs

    def retrieve(self, tokens, salt: str | None = None, *, limit: int | None = None) -> tuple[int, torch.Tensor]:
        """(n, kv): the longest cached prefix of `tokens` (same `limit` rule as `match`) and its KV.

        kv: [layers, 2, n, kv_heads, head_dim] on the cache's device, read from whichever tier holds each block.
        """
        m = self.match(tokens, salt, limit=limit)
        L, _, bs, H, D = self.layout.block_shape
        n = len(m.blocks)
        out = torch.empty((L, 2, n, bs, H, D), dtype=self.layout.dtype, device=self.device)
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
            _put_blocks(out, in_l2, self.mover.read_l2([m.blocks[i].l2 for i in in_l2]).permute(1, 2, 0, 3, 4, 5))
        self._count_out("l1", len(in_l1))
        self._count_out("l2", len(in_l2))
        self._use(m.blocks, 0)
        return n * bs, out.view(L, 2, n * bs, H, D)

    # ------------------------------------------------------------------ block-level API

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int, match: Match) -> bool:
        """Whether `allocate` of a sequence of `num_tokens` with this match would succeed now."""
        return self._shortfall(num_tokens, match.blocks) <= 0

    def _shortfall(self, num_tokens: int, blocks: list[BlockEntry]) -> int:
        l1_hits = [e for e in blocks if e.l1 >= 0]
        need = self.blocks_needed(num_tokens) - len(l1_hits)
        available = len(self.l1.free) + self.index.evictable("l1") - sum(1 for e in l1_hits if e.ref == 0)
        return need - available

    def allocate(
        self, tokens, salt: str | None = None, *, priority: int = 0, match: Match | None = None
    ) -> SequenceBlocks:
        """Reserve L1 blocks for `tokens`: cached prefix blocks are shared (L1) or loaded (L2), the rest is fresh.

        Raises CacheFullError, changing nothing, when L1 cannot make room. Call `seq.wait()`
        before attention reads the sequence's blocks (L2 loads run asynchronously on CUDA).
        """
        m = match if match is not None else self.match(tokens, salt)
        blocks = self.index.walk(m.hashes[: len(m.blocks)], m.ns, m.token_bytes, self.block_size)
        num_tokens = len(m.token_bytes) // 4
        if num_tokens == 0:
            raise ValueError("allocate() needs at least one token")
        short = self._shortfall(num_tokens, blocks)
        if short > 0:
            raise CacheFullError(f"a sequence of {num_tokens} tokens needs {short} more L1 blocks than can be freed")
        l1_hits = [e for e in blocks if e.l1 >= 0]
        l2_hits = [e for e in blocks if e.l1 < 0]
        for e in l1_hits:
            self.index.pin(e)
        self.index.hold(l2_hits, "l2")  # the evictions below must not drop what we are about to load
        fresh = self._take_l1(self.blocks_needed(num_tokens) - len(l1_hits))
        self.index.release(l2_hits, "l2")
        load = self._load_l2([e.l2 for e in l2_hits], fresh[: len(l2_hits)])
        for e, slot in zip(l2_hits, fresh):
            self.index.pin(e)
            self.index.place(e, "l1", slot)
            e.loading = load if load is not DONE else None
        pending = [e.loading for e in blocks if e.loading is not None and not e.loading.done()]
        self._use(blocks, priority)
        rest = fresh[len(l2_hits) :]
        return SequenceBlocks(
            ns=m.ns,
            priority=priority,
            slots=[e.l1 for e in blocks] + rest,
            entries=[*blocks, *([None] * len(rest))],
            hashes=list(m.hashes),
            committed=len(blocks),
            num_tokens=num_tokens,
            num_cached_tokens=len(blocks) * self.block_size,
            pending=pending,
        )

    def can_append(self, seq: SequenceBlocks, num_tokens: int = 1) -> bool:
        need = self.blocks_needed(seq.num_tokens + num_tokens) - len(seq.slots)
        return need <= len(self.l1.free) + self.index.evictable("l1")

    def append(self, seq: SequenceBlocks, num_tokens: int = 1) -> None:
        """Reserve room for `num_tokens` more tokens; raises CacheFullError (changing nothing) if L1 cannot."""
        need = self.blocks_needed(seq.num_tokens + num_tokens) - len(seq.slots)
        if need > 0:
            slots = self._take_l1(need)
            seq.slots += slots
            seq.entries += [None] * need
        seq.num_tokens += num_tokens

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
            if collided or (entry is not None and entry.l1 >= 0):
                continue  # someone else holds this block (or its hash): ours stays private
            if entry is None:
                entry = self.index.create(h, parent, seq.ns, blk, seq.priority)
                new.append(entry)
            self.index.pin(entry)
            self.index.place(entry, "l1", seq.slots[i])
            seq.entries[i] = entry
        seq.committed = full
        self._count_in("l1", len(new))
        self.counters.stored_blocks += len(new)
        if self.config.write_policy == "write_through":
            self._write_down(new)
        return full - start

    def free(self, seq: SequenceBlocks) -> None:
        """Release everything `seq` holds: shared blocks become evictable (tail first), private ones free."""
        if seq.freed:
            raise ValueError("free() of a sequence that was already freed")
        private = []
        for slot, entry in zip(reversed(seq.slots), reversed(seq.entries)):
            if entry is None:
                private.append(slot)
            else:
                self.index.unpin(entry)
        self.l1.free.give(private)
        seq.slots, seq.entries, seq.freed = [], [], True

    def block_table(self, seqs: list[SequenceBlocks], width: int | None = None) -> torch.Tensor:
        """[len(seqs), width] int32 on the cache's device; rows padded with -1."""
        width = width if width is not None else max((len(s.slots) for s in seqs), default=0)
        table = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for row, s in enumerate(seqs):
            table[row, : len(s.slots)] = torch.tensor(s.slots[:width], dtype=torch.int32)
        return table.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ tier movement

    def _take_l1(self, n: int, partial: bool = False) -> list[int]:
        """`n` free L1 slots, evicting (and demoting) unpinned blocks as needed. Fewer only if `partial`."""
        short = n - len(self.l1.free)
        if short > 0:
            if short > self.index.evictable("l1") and not partial:
                raise CacheFullError(f"L1 needs {short} more blocks than can be evicted")
            victims = []
            while len(victims) < short and (e := self.index.victim("l1")) is not None:
                victims.append(e)
            self._evict_l1(victims)
        return self.l1.free.take(min(n, len(self.l1.free)))

    def _evict_l1(self, victims: list[BlockEntry]) -> None:
        demote = [e for e in victims if e.l2 < 0 and self._admits_l2(e)]
        copied = self._write_down(demote)
        for e in victims:
            if e.l2 < 0:
                self.counters.tiers["l1"].drops += 1
            self.l1.free.give([self.index.unplace(e, "l1")])
        self.counters.tiers["l1"].evictions += len(victims)
        if copied:
            self.mover.fence()  # the freed slots are reused only after the copies out of them

    def _admits_l2(self, entry: BlockEntry) -> bool:
        if self.config.write_policy == "selective":
            return entry.hits >= self.config.selective_min_hits
        return True

    def _write_down(self, entries: list[BlockEntry]) -> int:
        """Copy L1 blocks that L2 lacks into L2 (as many as L2 can take); returns how many."""
        if self.l2 is None:
            return 0
        entries = [e for e in entries if e.l2 < 0 and e.l1 >= 0]
        slots = self._take_l2(len(entries))
        entries = entries[: len(slots)]
        if entries:
            self.mover.l1_to_l2([e.l1 for e in entries], slots)
            for e, slot in zip(entries, slots):
                self.index.place(e, "l2", slot)
            self._count_in("l2", len(entries))
            self._count_out("l1", len(entries))
        return len(entries)

    def _take_l2(self, n: int) -> list[int]:
        """Up to `n` free L2 slots, dropping L2's victims as needed."""
        while len(self.l2.free) < n and (e := self.index.victim("l2")) is not None:
            if e.l1 < 0:
                self.counters.tiers["l2"].drops += 1
            self.l2.free.give([self.index.unplace(e, "l2")])
            self.counters.tiers["l2"].evictions += 1
        return self.l2.free.take(min(n, len(self.l2.free)))

    def _load_l2(self, l2_slots: list[int], l1_slots: list[int]) -> Transfer:
        if not l2_slots:
            return DONE
        self._count_out("l2", len(l2_slots))
        self._count_in("l1", len(l2_slots))
        return self.mover.l2_to_l1(l2_slots, l1_slots)

    def _use(self, entries: list[BlockEntry], priority: int) -> None:
        """A request reused these blocks: update recency/frequency, and copy down what `selective` now admits."""
        for e in reversed(entries):  # tail first, so the head ends up most recent
            self.index.touch(e, priority)
        if self.config.write_policy == "selective":
            self._write_down([e for e in entries if e.hits == self.config.selective_min_hits])

    def _count_in(self, tier: str, n: int) -> None:
        c = self.counters.tiers[tier]
        c.blocks_in += n
        c.bytes_in += n * self.layout.bytes_per_block

    def _count_out(self, tier: str, n: int) -> None:
        c = self.counters.tiers[tier]
        c.blocks_out += n
        c.bytes_out += n * self.layout.bytes_per_block

    # ------------------------------------------------------------------ reporting

    def synchronize(self) -> None:
        """Block until every transfer issued so far is complete."""
        if self.mover is not None:
            self.mover.last.synchronize()

    def stats(self) -> dict:
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
                capacity_bytes=cap * self.layout.bytes_per_block,
                used_bytes=used * self.layout.bytes_per_block,
            )
        return out
