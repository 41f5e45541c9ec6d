"""PagedCache: the life of a running sequence's blocks.

A sequence comes from admission (admission.py: `admit`, `allocate`); here it grows (`append`),
enters its full blocks in the index (`commit`), takes blocks others computed (`adopt`), forks
(`fork`), lets go of the blocks its windows have left (`release`), and gives everything back
(`free`); `live_sequences` lists those not given back yet, `block_table` their slots. The moves a
step overlaps with its forward (per-layer loads and saves, sequences larger than L1) are
LayerMoves' (layer_moves.py), on top of this. Where the engine owns
L1 (engine_blocks=), the same calls take its block ids, and its copies are recorded for it to
run (`take_moves`). TieredKVCache (cache.py) is this plus the simple API, lifecycle and stats.

Every public method runs under the cache's guard (guard.py) and checks its arguments before it
changes anything: a freed or foreign sequence, or tokens that do not extend one, raise UsageError
and leave the cache as it was. Which block is evicted or copied down is decided in tiering.py,
and bytes move in transfer.py; this file never knows about requests, scheduling or HTTP.
"""

from __future__ import annotations

import numpy as np
import torch

from .admission import Admission
from .errors import UsageError
from .guard import guarded
from .hashing import hash_blocks, token_bytes
from .index import BlockEntry
from .sequence import LayerSave, SequenceBlocks, fill_block_table
from .transfer import in_flight

COPY_CHUNK = 128  # blocks a commit enters before it tells the tiers (see commit)


class PagedCache(Admission):
    """The block-level API a paged engine speaks, on top of admission."""

    _shared: dict[int, int]  # private L1 slots forked sequences share: slot -> holders beyond the first
    _engine_saving: set[int]  # engine-owned L1: hashes of blocks the engine is copying into L2 now

    # ------------------------------------------------------------------ a running sequence

    def _refuse_engine_blocks(self, call: str) -> None:
        # calls that copy, share or move blocks inside tierkv's own L1, which it does not hold
        # when the engine owns L1
        if self.tiers.engine_owned:
            raise UsageError(f"{call}() works on tierkv's own L1, and this cache's L1 is the engine's (engine_blocks=): "
                             "save and load blocks with allocate(slots=), commit and take_moves")

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
    def append(self, seq: SequenceBlocks, num_tokens: int = 1, slots: list[int] | None = None) -> None:
        """Reserve room for `num_tokens` more tokens; raises CacheFullError (changing nothing) if L1
        cannot. Where the engine owns L1, `slots` are the block ids it added for them (none when
        the sequence's blocks already hold them)."""
        self._check_seq(seq, "append")
        if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise UsageError(f"append() takes a number of tokens >= 0, got {num_tokens!r}")
        need = self.blocks_needed(seq.num_tokens + num_tokens) - len(seq.slots)
        if self.tiers.engine_owned:
            slots = self._engine_slots(slots or [], "append")
            if len(slots) < need:
                raise UsageError(f"append() of {num_tokens} tokens needs {need} more block ids (slots=), got {len(slots)}")
            seq.slots += slots
            seq.entries += [None] * len(slots)
            seq.num_tokens += int(num_tokens)
            return
        if slots is not None:
            raise UsageError("append(slots=) is for a cache whose L1 the engine owns (engine_blocks=)")
        if need > 0:
            slots = self.tiers.take_l1(need)
            seq.slots += slots
            seq.entries += [None] * need
        seq.num_tokens += int(num_tokens)

    @guarded
    def adopt(self, seq: SequenceBlocks, tokens, upto: int | None = None) -> int:
        """Take the blocks right after the sequence's committed prefix from the cache instead of
        computing them, where the cache holds them now (a `prefetch` of `match.tail` landed, or
        another request computed them): L1 copies are shared, L2 ones loaded into the sequence's
        own slots. A sequence that lets go of what its windows have left (`lets_go`) takes only
        the blocks its window reads from where the taking ends, and lets go of those before.
        `upto`: take exactly the blocks up to block `upto`, or nothing (`adoptable` says which
        ends work now: a cache per layer group takes the same ones in every group). Returns how
        many blocks it moved past; their tokens count as computed. The last token of `tokens`
        is never taken (its logits must be computed).
        """
        self._check_seq(seq, "adopt")
        self.tiers.reap()
        start, held = self._held(seq, tokens)
        ends = self._adoptable(seq, start, held, None if upto is None else [upto])
        if not ends:
            return 0
        stop = ends[0]
        first, entries = self._taken(start, held, stop)
        if self.lets_go and first > seq.released:  # the window leaves these behind: let go of them, untaken
            self.release(seq, first)
            seq.slots += [-1] * (first - len(seq.slots))
            seq.entries += [None] * (first - len(seq.entries))
            seq.released = first
        shared = [e for e in entries if e.l1 >= 0]
        for e in shared:
            self.index.pin(e)
        from_l2 = [(i, e) for i, e in enumerate(entries, start=first) if e.l1 < 0]
        self.index.hold_l2([e for _, e in from_l2])  # the slots taken below must not evict them
        beyond = sum(1 for i, _ in from_l2 if i >= len(seq.slots))  # slots the loads below write
        fresh = iter(self.tiers.take_l1(beyond, loads=beyond))
        for i, e in enumerate(entries, start=first):
            slot = e.l1 if e.l1 >= 0 else (seq.slots[i] if i < len(seq.slots) else next(fresh))
            if i < len(seq.slots):
                if e.l1 >= 0:  # shared: the private slot reserved for it goes back
                    self.tiers.give_l1([seq.slots[i]])
                seq.slots[i], seq.entries[i] = slot, e
            else:
                seq.slots.append(slot)
                seq.entries.append(e)
        taken = [e for _, e in from_l2]
        loads = [e.loading for e in shared]  # a shared block may still be landing for someone else
        loads.append(self.tiers.load_pinned(taken, [seq.slots[i] for i, _ in from_l2]))
        self.index.release_l2(taken)
        # (blocks let go of untaken, as allocate's window hits: counted with L1)
        skipped = [None] * (first - start)
        for tier, n in self._count_hits(None, [*skipped, *shared], taken).items():
            seq.cached_by_tier[tier] += n  # cached tokens too, past num_cached_tokens
        seq.pending = in_flight([*seq.pending, *loads])
        self.tiers.used(entries, seq.priority)
        seq.committed = stop
        seq.num_tokens = max(seq.num_tokens, stop * self.block_size)
        return stop - start

    @guarded
    def adoptable(self, seq: SequenceBlocks, tokens, ends: list[int] | None = None) -> list[int]:
        """The block ends, furthest first, up to which `adopt(seq, tokens, upto=end)` would take
        what it needs now (among `ends`; by default every end past the committed prefix)."""
        self._check_seq(seq, "adoptable")
        self.tiers.reap()
        start, held = self._held(seq, tokens)
        return self._adoptable(seq, start, held, ends)

    def _held(self, seq: SequenceBlocks, tokens) -> tuple[int, list[BlockEntry | None]]:
        """Where `seq` would take blocks from (past its committed and let-go prefix), and the
        entry the cache holds now of each block from there to the prompt's last full block
        (None: not held). A sequence that does not let go of blocks takes none past its slots,
        and only a run from the start: the walk stops at the first miss."""
        bs = self.block_size
        tb = token_bytes(tokens)
        start = max(seq.committed, seq.released)
        end = (len(tb) // 4 - 1) // bs
        if not self.lets_go:
            end = min(end, len(seq.slots))
        if end <= start:
            return start, []
        self._check_extends(seq, tb[4 * start * bs : 4 * end * bs], start * bs, "adopt")
        self._hash_to(seq, tokens, end)
        held: list[BlockEntry | None] = []
        for i in range(start, end):
            entry, _ = self.index.lookup(seq.hashes[i], seq.hashes[i - 1] if i else 0, seq.ns,
                                         tb[i * 4 * bs : (i + 1) * 4 * bs])
            if entry is None and not self.lets_go:
                break
            held.append(entry)
        return start, held

    def _taken(self, start: int, held: list[BlockEntry | None], stop: int) -> tuple[int, list[BlockEntry | None]]:
        """The first block an adoption that ends at block `stop` takes, and the entries of the
        blocks it takes: all from `start`, or, letting go of blocks, those its window reads."""
        first = max(start, self.layout.first_block_read(stop * self.block_size)) if self.lets_go else start
        return first, held[first - start : stop - start]

    def _adoptable(self, seq: SequenceBlocks, start: int, held: list[BlockEntry | None],
                   ends: list[int] | None) -> list[int]:
        """`adoptable` from `_held`'s answer: ends whose blocks are all held, where L1 has room
        for the slots the taking adds, and where letting go of blocks can be done now."""
        ends = range(start + len(held), start, -1) if ends is None else ends
        ends = [stop for stop in ends if start < stop <= start + len(held)]
        if not self.lets_go:  # held is a run from the start, into slots the sequence has
            return ends
        out = []
        for stop in ends:
            first, entries = self._taken(start, held, stop)
            if any(e is None for e in entries):
                continue
            if first > seq.released and (in_flight(seq.pending) or seq.offloaded or seq.saving is not None):
                continue  # (release could not let go of them now)
            new = sum(1 for i, e in enumerate(entries, start=first) if e.l1 < 0 and i >= len(seq.slots))
            pinned = sum(1 for e in entries if e.l1 >= 0 and e.ref == 0)  # evictable now, not once taken
            if new and new > self.tiers.l1_room() - pinned:
                continue
            out.append(stop)
        return out

    def _hash_to(self, seq: SequenceBlocks, tokens, end: int) -> None:
        """Extend `seq.hashes` to its first `end` blocks of `tokens` (the sequence's, from position
        0): a sequence allocated without a lookup hashes as it commits or adopts."""
        known, bs = len(seq.hashes), self.block_size
        if known < end:
            tail = token_bytes(tokens[known * bs : end * bs])
            seq.hashes += hash_blocks(tail, bs, seq.ns, parent=seq.hashes[-1] if known else 0)

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
            if seq.saving is not None:  # the step filled no block: what its save copied is not needed
                self._saved(seq, [])
            return 0
        tb = token_bytes(tokens[start * bs : full * bs])
        self._check_extends(seq, tb, start * bs, "commit")
        self._hash_to(seq, tokens, full)
        if self.tiers.engine_owned:
            self._save_engine_blocks(seq, tb, start, full)
            seq.committed = full
            return full - start
        new, told = [], 0  # told: how many of `new` the tiers were told of (under write-through
        # they copy them down then: telling them every COPY_CHUNK blocks starts the first copy
        # while the rest are entered, so that a long prompt's bookkeeping hides behind its copy)
        for i in range(start, full):
            h, parent = seq.hashes[i], seq.hashes[i - 1] if i else 0
            blk = tb[(i - start) * 4 * bs : (i - start + 1) * 4 * bs]
            entry, collided = self.index.lookup(h, parent, seq.ns, blk)
            if seq.slots[i] < 0 or collided or (entry is not None and entry.l1 >= 0):
                continue  # someone else holds this block (or its hash): ours stays private
            if entry is None:
                entry = self.index.create(h, parent, seq.ns, blk, seq.priority, pos=i)
                if seq.in_l3[0] <= i < seq.in_l3[1]:
                    entry.l3 = "written"  # recomputed, though L3 has it: nothing to write
                new.append(entry)
            self.index.pin(entry)
            self.index.place(entry, "l1", seq.slots[i])
            seq.entries[i] = entry
            if len(new) - told >= COPY_CHUNK and seq.saving is None:  # a layer-by-layer save: _saved first
                self.tiers.stored(new[told:])
                told = len(new)
        seq.committed = full
        if seq.saving is not None:
            self._saved(seq, new)
        self.tiers.stored(new[told:])  # under write-through, copies down what a layer-by-layer save did not
        return full - start

    def _save_engine_blocks(self, seq: SequenceBlocks, tb: bytes, start: int, full: int) -> None:
        """commit() where the engine owns L1: blocks start..full-1 (their tokens `tb`) that no tier
        holds or is saving are copied into fresh L2 slots by the engine (`take_moves`), and enter
        the index, in L2, once it reports the copy done: until then a lookup must not find them
        (a load issued before the copy would read the slot empty). What L2 has no room for now
        is not saved."""
        bs, todo = self.block_size, []
        for i in range(start, full):
            h, parent = seq.hashes[i], seq.hashes[i - 1] if i else 0
            blk = tb[(i - start) * 4 * bs : (i - start + 1) * 4 * bs]
            if seq.slots[i] < 0:
                continue  # the engine keeps no block here (a sliding window left it): nothing to copy
            entry, collided = self.index.lookup(h, parent, seq.ns, blk)
            if entry is None and not collided and h not in self._engine_saving:
                todo.append((i, h, parent, blk))
        slots = self.tiers.take_l2(len(todo)) if todo else []
        todo = todo[: len(slots)]
        if not todo:
            return
        self.tiers.copy_down([seq.slots[i] for i, *_ in todo], slots)
        for _, h, *_ in todo:
            self._engine_saving.add(h)
        ns, priority, in_l3 = seq.ns, seq.priority, seq.in_l3

        def saved() -> None:
            new = []
            for (i, h, parent, blk), slot in zip(todo, slots):
                self._engine_saving.discard(h)
                if h in self.index.entries:  # arrived meanwhile (an L3 read): ours is not needed
                    self.tiers.give_l2([slot])
                    continue
                e = self.index.create(h, parent, ns, blk, priority, pos=i)
                if in_l3[0] <= i < in_l3[1]:
                    e.l3 = "written"  # recomputed, though L3 has it: nothing to write
                self.index.place(e, "l2", slot)
                new.append(e)
            self.tiers.stored(new, tier="l2")

        self.tiers.mover.after(saved)

    def _saved(self, seq: SequenceBlocks, new: list[BlockEntry]) -> None:
        """The end of a step that `save_layer` copied: the blocks it commits (`new`) live in the L2
        slots the save filled (their layers not copied yet go now, after the forward that wrote
        them); the save's other slots, of blocks that stayed private or that the step did not
        fill (a chunk that ends inside them), are given back. Every commit ends the save, so no
        copy outlives the step that took it: a later commit never places one taken too early."""
        save, seq.saving = seq.saving, None
        at = dict(zip(save.blocks, save.l2_slots))
        placed = [(e, at.pop(e.pos)) for e in new if e.pos in at]
        if placed:
            l2_slots = [slot for _, slot in placed]
            layers = self.layout.num_layers
            if save.copied < layers:
                save.moved = self.tiers.save_layers([seq.slots[e.pos] for e, _ in placed], l2_slots,
                                                    range(save.copied, layers))
            self.tiers.copied_down([e for e, _ in placed], l2_slots, save.moved)
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
        self._refuse_engine_blocks("fork")
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
            for slot, entry in zip(slots[seq.released :], entries[seq.released :]):  # (released: -1)
                if entry is None:
                    self._shared[slot] = self._shared.get(slot, 0) + 1
                else:
                    self.index.pin(entry)
        forks = [
            SequenceBlocks(
                ns=seq.ns, priority=seq.priority, slots=slots + fresh[i : i + 1],
                entries=entries + [None] * (partial > 0), hashes=seq.hashes[:full],
                committed=min(seq.committed, full), num_tokens=num_tokens,
                num_cached_tokens=seq.num_cached_tokens, pending=list(seq.pending),
                token_bytes=seq.token_bytes[: 4 * num_tokens], cached_by_tier=dict(seq.cached_by_tier),
                owner=self, in_l3=seq.in_l3, released=min(seq.released, full),
            )
            for i in range(count)
        ]
        self._live.update(dict.fromkeys(forks))
        return forks

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
    def live_sequences(self) -> list[SequenceBlocks]:
        """The sequences allocated (`allocate`, `admit`, `fork`) and not freed yet, oldest first:
        each holds blocks until `free`, so an engine with no request running should see none
        (a leak check)."""
        return list(self._live)

    @guarded
    def free(self, seq: SequenceBlocks) -> None:
        """Release everything `seq` holds: shared blocks become evictable (tail first), private ones free."""
        self._check_seq(seq, "free")
        # Loads into its blocks may still be in flight (a sequence freed before it computed): the
        # current stream, which writes into whatever reuses those slots next, must come after them.
        seq.wait()
        if seq.saving is not None:  # saved layer by layer but never committed
            self._drop_save(seq.saving, seq.saving.l2_slots)
            seq.saving = None
        k = seq.offloaded
        if k:
            self.streamer.synchronize()  # its L2 slots may be read by a streamed load in flight
        if self.tiers.engine_owned:  # the engine's blocks are its own to free; tierkv pinned none
            seq.slots, seq.entries, seq.freed = [], [], True
            del self._live[seq]
            return
        held = max(k, seq.released)  # (a sequence either streams or lets go of blocks: never both)
        slots, entries = seq.slots[held:], seq.entries[held:]
        self.index.unpin_all([e for e in entries if e is not None])
        self._give_private([s for s, e in zip(reversed(slots), reversed(entries)) if e is None])
        for slot, entry in zip(reversed(seq.l2_slots), reversed(seq.entries[:k])):
            if entry is None:
                self.tiers.give_l2([slot])
            else:
                self.index.release_l2([entry])
        seq.slots, seq.entries, seq.l2_slots, seq.freed = [], [], [], True
        del self._live[seq]

    @guarded
    def release(self, seq: SequenceBlocks, first_needed: int) -> int:
        """Let go of the blocks of `seq` before block `first_needed`, which no query of it reads
        any more (every layer's window has left them: `KVLayout.first_block_read`). A committed
        block stays cached in L1, evictable and demoted like any other; a private one's slot is
        freed. Their slots read -1 from then on (attention starts at its window). Returns how
        many it let go of now: none of a streamed sequence (its blocks stay a prefix in L2),
        while loads into its blocks are in flight, or where the engine owns L1 (it frees its own)."""
        self._check_seq(seq, "release")
        start = seq.released
        end = min(first_needed, len(seq.slots))
        if seq.saving is not None:  # a layer-by-layer save reads the blocks past the committed ones
            end = min(end, seq.committed)
        if end <= start or seq.offloaded or self.tiers.engine_owned or in_flight(seq.pending):
            return 0
        private = []
        for i in range(start, end):
            entry = seq.entries[i]
            if entry is None:
                private.append(seq.slots[i])
            else:
                self.index.unpin(entry)
            seq.slots[i], seq.entries[i] = -1, None
        self._give_private(private)
        seq.released = end
        return end - start

    def let_go(self, seq: SequenceBlocks, first_query: int, streams: bool = False) -> int:
        """`release` the blocks of `seq` that no layer reads once its queries start at position
        `first_query` (every layer windowed: `KVLayout.first_block_read`); none of a sequence that
        streams (`streams`: its older blocks go to L2 instead). Returns how many it let go of."""
        first = self.layout.first_block_read(first_query)
        return self.release(seq, first) if first > seq.released and not streams else 0

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
