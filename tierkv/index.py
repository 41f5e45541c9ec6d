"""The block index: chained hash -> where that block lives, and the longest-prefix walk.

One dict from hash to BlockEntry. An entry records which tiers hold the block (its L1 and L2
slots), how many running sequences pin it in L1, and what the eviction policies need. A prefix
walk is a run of dict hits that stops at the first miss. Each entry keeps the block's parent
hash, namespace and token ids, and a hit counts only if they equal the query's, so a hash
collision (accidental or crafted by another tenant) is a miss, never someone else's KV.
Each block placed in or taken out of a tier is recorded in `events` when someone listens.
L2 gives up first its copies of blocks that L1 holds too (least recently used first), before
its policy's choice: such a copy adds nothing that L1 lacks, while a block held in L2 alone is a
hit that would otherwise be lost. Without this, every block loaded up from L2 (and every block read up
from L3 through L2) stays in both tiers, and L2 holds less that L1 does not.
This file does bookkeeping only: it never touches tensors or moves data.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .events import TIER_MEDIUM, BlockEvents
from .policies import EvictionPolicy, make_policy

TIERS = ("l1", "l2")


@dataclass(slots=True, eq=False)
class BlockEntry:
    hash: int
    parent: int  # hash of the previous block in the chain, 0 for a first block
    ns: bytes  # namespace digest (model, layout, TP rank, salt)
    tokens: bytes  # the block's token ids, little-endian int32
    priority: int = 0
    l1: int = -1  # slot in the L1 pool, -1 when not there
    l2: int = -1  # slot in the L2 pool, -1 when not there
    ref: int = 0  # running sequences holding it in L1; never evicted from L1 while > 0
    hits: int = 0  # times a request reused it (selective write policy)
    loading: Any = None  # Transfer filling its L1 slot, None once known complete
    reading: Any = None  # Transfer copying its L1 slot down to L2: the slot is reused only after it
    held: int = 0  # holds on its L2 slot (an L3 write in flight, a load being set up); not evictable from L2 while > 0
    l3: str = ""  # what this process knows of it in L3: "", "writing", "written" (or read from there), "failed"
    pos: int = -1  # position in its chain (0 = first block): L3 stores group blocks into chunks by it
    # the tier it was read up from ahead of any request and not used since ("l3": into L2 by a
    # prefetch; "l2": into L1 by Admission.warm): its first use counts as a hit of that tier
    brought_from: str = ""

    def slot(self, tier: str) -> int:
        return self.l1 if tier == "l1" else self.l2

    def tier(self) -> str:
        """The fastest tier holding the block."""
        return "l1" if self.l1 >= 0 else "l2"

    def matches(self, parent: int, ns: bytes, tokens) -> bool:
        return self.parent == parent and self.ns == ns and self.tokens == tokens


@dataclass(slots=True)
class BlockIndex:
    eviction: str = "lru"
    entries: dict[int, BlockEntry] = field(default_factory=dict)
    policies: dict[str, EvictionPolicy] = field(default_factory=dict)
    collisions: int = 0
    removals: int = 0  # entries dropped from the index so far: a walk done before is still valid while unchanged
    events: BlockEvents | None = None  # where tier changes are recorded, when someone publishes them
    # hashes of blocks L1 and L2 both hold, least recently used first: L2's first victims (stale
    # ones, no longer in both or held, are skipped when reached)
    l2_copies: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.policies = {tier: make_policy(self.eviction) for tier in TIERS}

    def __len__(self) -> int:
        return len(self.entries)

    def walk(self, hashes: list[int], ns: bytes, tokens: bytes, block_size: int) -> list[BlockEntry]:
        """Entries of the longest prefix of `hashes` held in some tier (stops at the first miss)."""
        stride = 4 * block_size
        found: list[BlockEntry] = []
        parent = 0
        for i, h in enumerate(hashes):
            entry = self.entries.get(h)
            if entry is None:
                break
            # bytes slices compare with one memcmp: twice as fast as a memoryview here
            if not entry.matches(parent, ns, tokens[i * stride : (i + 1) * stride]):
                self.collisions += 1
                break
            found.append(entry)
            parent = h
        return found

    def lookup(self, h: int, parent: int, ns: bytes, tokens) -> tuple[BlockEntry | None, bool]:
        """(entry, collided): the entry for `h` if it holds exactly this block."""
        entry = self.entries.get(h)
        if entry is None:
            return None, False
        if entry.matches(parent, ns, tokens):
            return entry, False
        self.collisions += 1
        return None, True

    def create(self, h: int, parent: int, ns: bytes, tokens: bytes, priority: int = 0, pos: int = -1) -> BlockEntry:
        entry = BlockEntry(h, parent, ns, bytes(tokens), priority, pos=pos)
        self.entries[h] = entry
        return entry

    def place(self, entry: BlockEntry, tier: str, slot: int) -> None:
        """`entry` now lives in `slot` of `tier`; pinned there if it has L1 references."""
        if self.events is not None and entry.slot(tier) < 0:  # not a block put back where it was
            self.events.stored(TIER_MEDIUM[tier], entry.hash, entry.parent, entry.tokens)
        if tier == "l1":
            entry.l1 = slot
        else:
            entry.l2 = slot
        pinned = tier == "l1" and entry.ref > 0
        self.policies[tier].insert(entry.hash, priority=entry.priority, pinned=pinned)
        self._note_copy(entry)

    def leaving_l1(self, entries: list[BlockEntry]) -> None:
        """`entries` are being evicted from L1: their L2 slots are no copies now but the blocks
        themselves, so L2 must not give them up to make room for the others' demotion."""
        for e in entries:
            self.l2_copies.pop(e.hash, None)

    def _note_copy(self, entry: BlockEntry) -> None:
        """Queue `entry`'s L2 slot as a first victim if L1 holds the block too."""
        if entry.l1 >= 0 and entry.l2 >= 0 and not entry.held:
            self.l2_copies[entry.hash] = None
            self.l2_copies.move_to_end(entry.hash)

    def unplace(self, entry: BlockEntry, tier: str) -> int:
        """`entry` leaves `tier`; returns the slot it held. An entry in no tier leaves the index."""
        slot = entry.slot(tier)
        self.policies[tier].remove(entry.hash)
        if self.events is not None:
            self.events.removed(TIER_MEDIUM[tier], entry.hash)
        if tier == "l1":
            entry.l1, entry.loading, entry.reading = -1, None, None
        else:
            entry.l2 = -1
        if entry.l1 < 0 and entry.l2 < 0:
            del self.entries[entry.hash]
            self.removals += 1
        return slot

    def clear(self) -> dict[str, list[int]]:
        """Forget every entry at once (one AllBlocksCleared, not a removal per block); returns the
        slots they held, by tier. The caller makes sure nothing holds them."""
        slots = {tier: [s for e in self.entries.values() if (s := e.slot(tier)) >= 0] for tier in TIERS}
        self.removals += len(self.entries)
        self.entries.clear()
        self.policies = {tier: make_policy(self.eviction) for tier in TIERS}
        self.l2_copies.clear()
        if self.events is not None:
            self.events.cleared()
        return slots

    def victim(self, tier: str, copies_only: bool = False) -> BlockEntry | None:
        """The next block `tier` gives up, already out of its policy, or None: in L2, a copy of
        an L1 block first (see the module docstring), else the policy's choice (`copies_only`:
        None instead)."""
        while tier == "l2" and self.l2_copies:
            h, _ = self.l2_copies.popitem(last=False)
            e = self.entries.get(h)
            if e is not None and e.l1 >= 0 and e.l2 >= 0 and not e.held:
                self.policies["l2"].remove(h)
                return e
        if copies_only:
            return None
        h = self.policies[tier].evict()
        if h is None:
            return None
        return self.entries[h]  # unplace() will remove() it again: a no-op for an evicted key

    def pin(self, entry: BlockEntry) -> None:
        entry.ref += 1
        if entry.ref == 1:
            self.policies["l1"].pin(entry.hash)

    def unpin(self, entry: BlockEntry) -> None:
        assert entry.ref > 0, "unpin of a block that is not pinned"
        entry.ref -= 1
        if entry.ref == 0:
            self.policies["l1"].unpin(entry.hash)

    def pin_all(self, entries: list[BlockEntry]) -> None:
        for e in entries:
            self.pin(e)

    def unpin_all(self, entries: list[BlockEntry]) -> None:
        """Unpin a chain's `entries` tail first: an unpin counts as a use, so the chain's head ends
        up most recent and pressure evicts its tail before its head (a shorter hit, not none)."""
        for e in reversed(entries):
            self.unpin(e)

    def hold_l2(self, entries: list[BlockEntry]) -> None:
        """Keep `entries` in L2 (out of its eviction order) until as many `release_l2` calls."""
        for e in entries:
            e.held += 1
            if e.held == 1:
                self.policies["l2"].pin(e.hash)

    def release_l2(self, entries: list[BlockEntry]) -> None:
        for e in entries:
            assert e.held > 0, "release of an L2 block that is not held"
            e.held -= 1
            if e.held == 0 and e.l2 >= 0:
                self.policies["l2"].unpin(e.hash)
                self._note_copy(e)

    def touch(self, entry: BlockEntry, priority: int = 0) -> None:
        # (called for every block of every admission: the tiers spelled out, not looped over)
        entry.hits += 1
        entry.priority = max(entry.priority, priority)
        h = entry.hash
        if entry.l1 >= 0:
            self.policies["l1"].touch(h, priority=priority)
        if entry.l2 >= 0:
            self.policies["l2"].touch(h, priority=priority)
        if h in self.l2_copies:  # a copy in use goes last among the copies
            self.l2_copies.move_to_end(h)

    def evictable(self, tier: str) -> int:
        return len(self.policies[tier])
