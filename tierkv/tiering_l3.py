"""TieringL3: the part of Tiering (tiering.py) that talks to L3: lookups, reads into L2, writes
out of L1 and L2, write-through's catch-up, and `reap()`, which takes in what the L3 threads did.

A base class of Tiering, split off so that each file holds one side of the hierarchy; it owns no
state of its own: the pools, the index, the counters and the movers are Tiering's (annotated
below), and it takes and gives L2 slots through Tiering's `take_l2`, `give_l2`, `write_down` and
`_evict_l2`. The L3
threads (l3_mover.py) never touch the index: they work on L2 slots held for them and report back
through `reap()`. Under tensor parallelism rank 0 alone comes here (`_l3_ticket`). This file
never knows about sequences or requests.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from .config import CacheConfig
from .guard import Guard
from .index import BlockEntry, BlockIndex
from .l3_mover import L3Job, L3Mover
from .layout import KVLayout
from .metrics import CacheCounters
from .prefetch import Prefetch
from .recorded_moves import L3_LANDED, EngineMover
from .tiers import DevicePool, HostPool
from .tiers.codec import BlockId
from .transfer import DONE, BlockMover, Transfer

# Write-through's catch-up (`_catch_up`): the most blocks it copies down at once, and it starts
# again only once every L3 job has ended, so it never holds more of L2 than this for its writes.
CATCH_UP_BLOCKS = 128


def block_id(e: BlockEntry) -> BlockId:
    return BlockId(e.hash, e.parent, e.ns, e.tokens, e.pos)


class TieringL3:
    # Tiering's, set in its __init__
    config: CacheConfig
    guard: Guard
    l1: DevicePool
    l2: HostPool | None
    l3: L3Mover | None
    l3_layout: KVLayout  # how L3 holds a block (every KV head under tensor parallelism)
    offload: KVLayout  # how L2 holds one
    index: BlockIndex
    counters: CacheCounters
    mover: BlockMover | EngineMover | None  # L1<->L2 (EngineMover: recorded for the engine to run)
    exchange: object | None  # the engine's HeadExchange under tensor parallelism
    engine_owned: bool
    moves: list[tuple[int, list[int], list[int]]] | None
    owed: OrderedDict[int, BlockEntry]
    _fetching: dict[int, L3Job]

    def l3_present(self, hashes: list[int], first_pos: int = 0, usable: int | None = None) -> int:
        """How many leading `hashes` (a chain's blocks from position `first_pos`), up to `usable`
        of them, some L3 store holds. Hashes past `usable` (the prompt's last blocks, which a
        match leaves to compute) are looked up too: a chunk object is named after its last
        block, so they find the chunk that holds the usable end. Probes in growing parts (16,
        64, 256, ... blocks, ending on chunk boundaries) so a cold prompt costs one small round
        trip and a long hit a handful. A block L1 or L2 holds counts too (one that L2 had no
        room to copy down, after a parent that went on to L3): fetching the L3 ones makes the
        whole run reachable, so the run goes on past it."""
        if self.l3 is None:
            return 0
        usable = len(hashes) if usable is None else min(usable, len(hashes))
        K = self.l3.chunk_blocks
        found, size = 0, 16
        while found < usable:
            end = -(-(first_pos + found + size) // K) * K - first_pos  # up to a chunk boundary
            part = hashes[found:end]
            present = [p or h in self.index.entries for p, h in zip(self.l3.contains(part, first_pos + found), part)]
            run = next((i for i, p in enumerate(present) if not p), len(present))
            found += run
            if run < len(present):
                break
            size *= 4
        return min(found, usable)

    def _flush(self, entries: list[BlockEntry], after: Transfer) -> None:
        """Write L2 blocks to every L3 store in the background; they stay held in L2 until done."""
        # written ones are in L3 already (a chunk object still takes them whole: _with_chunk_heads)
        entries = self._with_chunk_heads([e for e in entries if e.l3 not in ("writing", "written")])
        if not entries:
            return
        for e in entries:
            e.l3 = "writing"
        held = [e for e in entries if e.l2 >= 0]
        self.index.hold_l2(held)
        # a chunk's head still only in L1 goes as a host copy taken now (its slot may be reused)
        bufs = [e.l2 if e.l2 >= 0 else self._host_copy(e) for e in entries]
        self.l3.put([block_id(e) for e in entries], bufs, after, entries, self._l3_ticket()).held = held

    def _l3_ticket(self) -> int | None:
        """Tensor parallel: send the moves made so far to the other ranks now, and return how many
        they have been sent in all. An L3 job's exchange waits until they repeated that many: those
        moves fill the slots a write reads, and finish with the slots a read fills."""
        if self.exchange is None:
            return None
        moves = self.moves or []
        if self.moves:
            self.moves = []
        return self.exchange.push(moves)

    def _host_copy(self, e: BlockEntry) -> torch.Tensor:
        """L1 block `e` as one contiguous host block in L2's format (ordered after the writes queued into the slot)."""
        return self.mover.to_host(self.l1.read([e.l1]))[0]

    def _with_chunk_heads(self, entries: list[BlockEntry]) -> list[BlockEntry]:
        """`entries` and, before each, the earlier blocks of its L3 chunk that L2 or L1 holds and
        no write in flight has: a chunk object is written whole from its first block, so writing
        them together saves reading the chunk's head back from L3 (the store's other way to
        extend a chunk), and under write-back, which evicts a chain's tail first (its head may
        still be in L1), is the only way the tail is stored at all. In chain order, each block once."""
        K = self.l3.chunk_blocks
        out: dict[int, BlockEntry] = {}
        for e in entries:
            head = []
            p = e
            while p.pos % K and (q := self.index.entries.get(p.parent)) is not None and q.hash not in out:
                # an L1 block still being loaded is not there yet; under tensor parallelism only
                # L2 slots can be written (the other ranks hold their heads there, not in a copy)
                in_l1 = q.l1 >= 0 and q.loading is None and self.exchange is None
                if not (q.l2 >= 0 or in_l1) or q.l3 == "writing" or q.pos != p.pos - 1:
                    break
                head.append(q)
                p = q
            for q in reversed(head):
                out[q.hash] = q
            out[e.hash] = e
        return list(out.values())

    def prefetch(self, ids: list[BlockId], deadline: float | None, priority: int = 0) -> Prefetch:
        """Start reading the blocks `ids` (a chain's L3 part, in order) into fresh L2 slots."""
        self.reap()
        ids = [b for b in ids if b.hash not in self.index.entries and b.hash not in self._fetching]
        slots = self.take_l2(len(ids)) if ids and self.l3 is not None else []
        if not slots:
            return Prefetch()
        ids = ids[: len(slots)]
        # a slot taken here may have been given back while a load out of it is still in flight
        # (allocate releases its L2 hits right after issuing their loads): the read waits for
        # the copies issued so far. The engine's own copies (engine_owned) release their L2
        # slots only once reported, so there is nothing to wait for.
        after = DONE if self.engine_owned else self.mover.last
        job = self.l3.get(ids, slots, deadline, priority, self._l3_ticket(), after)
        for b in ids:
            self._fetching[b.hash] = job
        return Prefetch(job, self.l3, self.guard, self.reap)

    def read_l3(self, ids: list[BlockId], deadline: float | None) -> torch.Tensor:
        """The leading blocks of `ids` read straight from L3, bypassing L2: [k, *block_shape] in
        L1's dtype on L1's device (dequantised there when L3 holds fp8). Not under tensor
        parallelism (L3 holds every rank's heads; the whole-sequence API is refused there)."""
        assert self.exchange is None, "read_l3 reads into this rank's L1 alone"
        shape, dtype = self.offload.block_storage
        out = torch.empty((len(ids), *shape), dtype=dtype)
        ok = self.l3.read(ids, list(out), deadline)
        k = next((i for i, hit in enumerate(ok) if not hit), len(ok))
        self.count("l3", k, into=False)
        self.counters.tiers["l3"].errors += len(ids) - sum(ok)
        return self.mover.from_host(out[:k])

    def reap(self) -> None:
        """Take in what the L3 threads finished: written blocks are released, read blocks land in L2."""
        if self.l3 is None:
            return
        for job in self.l3.finished_jobs():
            if job.kind == "put":
                self._written(job)
            else:
                self._landed(job)
        if self.owed:
            self._catch_up()

    def _catch_up(self) -> None:
        """Write-through: copy down, oldest first, the L1 blocks L2 had no room for when they were
        made, so that they reach L3 now rather than when L1 evicts them (into an L2 perhaps full
        again, where they are dropped unwritten; or written while requests read L3). Only once
        every L3 job has ended (a read needs L2's room more, and this holds at most CATCH_UP_BLOCKS
        of it), and only into free slots and those of L2's copies of L1 blocks, which cost nothing
        to give up."""
        if self.l3.in_flight or not (self.l2.free or self.index.l2_copies):
            return
        batch = []
        while self.owed and len(batch) < CATCH_UP_BLOCKS:
            h, e = self.owed.popitem(last=False)
            if self.index.entries.get(h) is e and e.l1 >= 0 and e.l2 < 0 and e.l3 == "":
                batch.append(e)  # (others left L1, or were copied down or written since)
        while len(self.l2.free) < len(batch) and self._evict_l2(copies_only=True):
            pass
        copied = self.write_down(batch[: len(self.l2.free)])  # into free slots: evicts nothing else
        for e in reversed(batch[copied:]):  # the rest wait, first in line
            self.owed[e.hash] = e
            self.owed.move_to_end(e.hash, last=False)

    def _written(self, job: L3Job) -> None:
        c = self.counters.tiers["l3"]
        for e, ok in zip(job.entries, job.ok):
            e.l3 = "written" if ok else "failed"
            c.blocks_in += ok
            c.bytes_in += ok * self.l3_layout.bytes_per_block
            c.errors += not ok
        self.index.release_l2(job.held)

    def _landed(self, job: L3Job) -> None:
        """Index the leading blocks that arrived; a block after a miss would be unreachable: drop it."""
        arrived, broken = 0, False
        for bid, slot, ok in zip(job.ids, job.slots, job.ok):
            self._fetching.pop(bid.hash, None)
            broken = broken or not ok
            if not broken and bid.hash not in self.index.entries:
                e = self.index.create(bid.hash, bid.parent, bid.ns, bid.tokens, job.priority, pos=bid.pos)
                e.l3, e.brought_from = "written", "l3"
                self.index.place(e, "l2", slot)
                arrived += 1
            else:
                self.give_l2([slot])
        c = self.counters.tiers["l3"]
        c.blocks_out += arrived
        c.bytes_out += arrived * self.l3_layout.bytes_per_block
        c.errors += job.tried - sum(job.ok)  # (blocks skipped past a deadline are no errors)
        job.landed = True
        if self.exchange is not None:
            self._move(L3_LANDED, [job.number], [])

    def flush(self, timeout: float | None = None, owed_only: bool = False) -> bool:
        """Write every block that L3 lacks (L1 and L2) to L3 and wait; True if all landed in time.
        `owed_only`: only those the write policy sends to L3 (selective: enough hits)."""
        if self.l3 is None:
            return True
        end = None if timeout is None else time.monotonic() + timeout
        self.reap()
        dirty = self._unwritten(owed_only)  # failures get one more try
        in_l2 = [e for e in dirty if e.l2 >= 0]
        self._flush(in_l2, self.mover.last)
        only_l1 = [e for e in dirty if e.l2 < 0]
        while only_l1:  # through L2 in batches of what it can take while earlier batches drain
            # write-through's catch-up (when a write ends) may have copied some down meanwhile:
            # those are written from L2 now, not waited for as if they still needed room there
            moved = [e for e in only_l1 if e.l2 >= 0]
            if moved:
                self._flush(moved, self.mover.last)
                only_l1 = [e for e in only_l1 if e.l2 < 0 and e.l1 >= 0]
                continue
            done = self.write_down(only_l1[: max(1, len(self.l2.free))])
            if self.config.write_policy != "write_through":
                self._flush(only_l1[:done], self.mover.last)
            only_l1 = only_l1[done:]
            if done == 0 and not self.wait_l3(end):
                return False
        while any(e.l3 == "writing" for e in self.index.entries.values()):
            if not self.wait_l3(end):
                return False
        return True

    def _unwritten(self, owed_only: bool) -> list[BlockEntry]:
        """Indexed blocks L3 does not hold (or whose write failed); `owed_only`: those the policy admits."""
        return [e for e in self.index.entries.values()
                if e.l3 in ("", "failed") and (not owed_only or self._admits(e))]

    def wait_l3(self, end: float | None) -> bool:
        """Wait for one L3 job to finish and reap it; False once `end` has passed."""
        remaining = None if end is None else end - time.monotonic()
        if self.l3 is None or (remaining is not None and remaining <= 0) or self.l3.in_flight == 0:
            return False  # out of time, or nothing left that could free an L2 slot
        self.l3.wait_any(remaining)
        self.reap()
        return True

    def write_l3(self, entries: list[BlockEntry]) -> None:
        """Start writing the L2 blocks among `entries` that L3 lacks (a failed write is tried again)."""
        if self.l3 is not None:
            self._flush([e for e in entries if e.l2 >= 0 and e.l3 in ("", "failed")], DONE)
