"""Tiering: where a block goes when its tier fills up, and the moves that follow.

Owns the pools (L1 device, L2 host), the movers (L1<->L2 on a CUDA stream, L2<->L3 on threads),
and the index's tier bookkeeping: the one owner of every tier's slots (free lists, room, pins of
loaded blocks, eviction order), demotion and copy-down by write policy, and the per-tier
load-time estimates behind load-or-recompute. What talks to L3 (lookups, reads into L2, writes,
taking in what the L3 threads did) is its base class, TieringL3 (tiering_l3.py).

Every L1/L2 byte move goes through `_move`. Under tensor parallelism rank 0 records them
(`moves`) and the other ranks `replay` them on their own pools, whose slots mirror rank 0's.
Rank 0 alone talks to L3, in whole-model blocks (`l3_layout`): an `exchange` (the engine's
HeadExchange) brings the other ranks' KV heads of an L2 slot to a write and takes theirs of a read
back to them; the moves those need travel first (`_l3_ticket`), and a read's landing is a point in
the moves that the other ranks wait for (`L3_LANDED`).

One caller at a time: the cache's guard (guard.py) serialises every call that gets here. This
file never knows about sequences or requests.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from . import kernels
from .config import CacheConfig, require_l2_for_l3
from .errors import CacheFullError, ConfigError
from .events import BlockEvents
from .guard import Guard
from .index import BlockEntry, BlockIndex
from .l3_mover import L3Job, L3Mover
from .layout import KVLayout, stored_layout
from .metrics import CacheCounters
from .tiers import DevicePool, HostPool
from .tiers.engine_blocks import EngineBlocks
from .tiers.open import open_store
from .tiers.pool import blocks_for
from .recorded_moves import COPIES, COPY_L1, FENCE, L1_TO_L2, L2_TO_L1, L2_TO_L1_FULL, EngineMover, copy
from .transfer import DONE, BlockMover, Transfer, in_flight
from .tiering_l3 import TieringL3

log = logging.getLogger(__name__)

# L1 when CacheConfig.l1 is None (the one place this default lives; the engine relies on it):
DEFAULT_CPU_L1 = 2**30  # on CPU: 1 GiB
GPU_L1_FRACTION = 0.8  # on a GPU: this share of the memory free when the cache is made, after
ACTIVATION_RESERVE = 4 * 2**30  # leaving this much for activations and the allocator
SPARE_SHARE = 64  # L1 keeps 1/SPARE_SHARE of its slots free ahead of need (Tiering.spare)


def default_l1_bytes(device: torch.device) -> int:
    """L1's size when CacheConfig.l1 is None: on a GPU, GPU_L1_FRACTION of the memory free now
    (the cache is made after the weights, so it takes most of what they left), after
    ACTIVATION_RESERVE; DEFAULT_CPU_L1 on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(int((free - ACTIVATION_RESERVE) * GPU_L1_FRACTION), 0)
    return DEFAULT_CPU_L1


def no_room_for_default_l1(device: torch.device, block_bytes: int) -> ConfigError:
    """The error for a default L1 (`default_l1_bytes`) that holds no block: the GPU is all but full."""
    free = torch.cuda.mem_get_info(device)[0]
    return ConfigError(f"L1 defaults to {GPU_L1_FRACTION:.0%} of the GPU memory free after the weights and "
                       f"{ACTIVATION_RESERVE >> 30} GiB kept for activations, but only {free / 2**30:.1f} GiB are free "
                       f"on {device} (other processes hold the rest): set l1 to the bytes L1 may take (at least one "
                       f"block, {block_bytes} bytes), or free GPU memory")


class Tiering(TieringL3):
    def __init__(self, layout: KVLayout, config: CacheConfig, device: torch.device, exchange=None,
                 guard: Guard | None = None, l1: DevicePool | None = None) -> None:
        """`l1`: an engine's own KV buffers as L1 (DevicePool.of_buffers); by default tierkv makes
        its pool, of CacheConfig.l1 bytes."""
        self.layout, self.config, self.device = layout, config, device
        self.guard = guard if guard is not None else Guard()  # the cache's: held by every call that gets here
        # how L2 holds a block: L1's layout, or fp8 + scales (config.kv_offload_dtype)
        self.offload = stored_layout(layout, config.kv_offload_dtype)
        # how L3 holds one: the same, but of every KV head under tensor parallelism (`exchange`)
        self.exchange = exchange
        self.l3_layout = self.offload if exchange is None else exchange.split.whole
        if exchange is not None and exchange.split.part != self.offload:
            raise ConfigError(f"the tensor-parallel L3 exchange splits blocks into {exchange.split.part}, "
                              f"but this rank's L2 holds {self.offload}")
        if l1 is None:
            l1_bytes = config.l1 if config.l1 is not None else default_l1_bytes(device)
            l1_blocks = blocks_for(l1_bytes, layout.bytes_per_block, "CacheConfig.l1")
            if l1_blocks == 0 and config.l1 is None and device.type == "cuda":  # other processes fill the GPU
                raise no_room_for_default_l1(device, layout.bytes_per_block)
            if l1_blocks == 0:
                raise ConfigError(f"CacheConfig.l1 must hold at least one block of {layout.bytes_per_block} bytes, got 0")
        l2_blocks = blocks_for(config.l2, self.offload.bytes_per_block, "CacheConfig.l2")
        require_l2_for_l3(config.l3, l2_blocks)  # a library user's CacheConfig: no EngineConfig checked it
        self.l1 = l1 if l1 is not None else DevicePool(layout, l1_blocks, device)
        # engine_owned: the engine's block ids and buffers are L1 (tiers/engine_blocks.py); every
        # L1<->L2 move is recorded for the engine to run, and tierkv keeps L2 and L3
        self.engine_owned = isinstance(self.l1, EngineBlocks)
        if self.engine_owned and not l2_blocks:
            raise ConfigError("with the engine's own L1 (engine_blocks=), tierkv keeps L2 and L3: give CacheConfig.l2 "
                              "at least one block")
        self.l2 = (HostPool(self.offload, l2_blocks, file=config.l2_file) if l2_blocks else None)
        try:
            self.mover = (EngineMover(self.offload.bytes_per_block) if self.engine_owned
                          else BlockMover(self.l1, self.l2) if self.l2 else None)
            self.l3 = (L3Mover([open_store(url, self.l3_layout) for url in config.l3], self.l2, exchange)
                       if config.l3 else None)
        except BaseException:  # a cache that failed to start holds no memory (nor a shared L2 file)
            if self.l2 is not None:
                self.l2.close()
            raise
        self.index = BlockIndex(config.eviction)
        self.counters = CacheCounters()
        self._fetching: dict[int, L3Job] = {}  # block hash -> the L3 read bringing it into L2
        # Write-through with an L3: new L1 blocks that L2 had no room to copy down (its slots held
        # by blocks on their way to L3), oldest first; `_catch_up` copies them once writes end.
        # An entry leaves when it is copied down or evicted from L1 (stats: `write_backlog_blocks`).
        self.owed: OrderedDict[int, BlockEntry] = OrderedDict()
        # Free L1 slots that copies may still be at: slot -> those copies (an evicted block's save
        # to L2, made as it left or by write-through just before; rarely also a load still writing
        # a block that a request let go of). A load may write such a slot at once: the copy stream
        # runs it after them. The compute stream waits for them first (take_l1). Waiting at
        # eviction instead made the next step wait for every load queued ahead of the save: ~22 ms
        # a load of 8K Llama-8B tokens on an H100.
        # (with whether one of those copies is a load: counted apart when the compute stream waits)
        self._busy: dict[int, tuple[list[Transfer], bool]] = {}
        # L1 keeps this many slots free beyond what a take needs, evicting early, so that the
        # compute stream's slots come from evictions whose saves have ended (`_sort_busy`): a
        # save queues behind every load on the copy stream, so waiting for the newest one made
        # decode steps idle ~20-35 ms a loading admission (bench_rounds' round 1, H100). Only
        # where evictions are saved (an L2 of tierkv's own), and 0 in an L1 of under 64 blocks.
        self.spare = self.l1.num_blocks // SPARE_SHARE if self.l2 is not None and not self.engine_owned else 0
        # Tensor parallelism, rank 0: every L1/L2 move since the last step, for the other ranks
        # to replay (see `_move`); None (the default) records nothing.
        self.moves: list[tuple[int, list[int], list[int]]] | None = None

    # ------------------------------------------------------------------ byte moves

    def _move(self, kind: int, src: list[int], dst: list[int]) -> Transfer:
        """Run one L1/L2 move (recorded first when `moves` is on): the one door every byte
        between L1 and L2, and within L1, goes through."""
        if self.moves is not None:
            self.moves.append((kind, src, dst))
        return self._apply(kind, src, dst)

    def _apply(self, kind: int, src: list[int], dst: list[int]) -> Transfer:
        if kind in COPIES:
            return copy(self.mover, kind, src, dst)
        if kind == COPY_L1:
            self._copy_l1(src, dst)
        elif kind == FENCE and self.mover is not None:
            self.mover.fence()
        return DONE  # L3_LANDED: nothing to move (the other ranks wait there: HeadFollower)

    def replay(self, moves: list[tuple[int, list[int], list[int]]]) -> None:
        """Repeat rank 0's moves on this rank's pools (same slots, this rank's KV heads), count
        their bytes, and order the current stream after them (the step that follows reads them)."""
        for kind, src, dst in moves:
            self._apply(kind, src, dst)
            if kind in COPIES:
                layers = self.layout.full_layers if kind == L2_TO_L1_FULL else None
                self.count("l2", len(src), into=kind == L1_TO_L2, layers=layers)
                self.count("l1", len(src), into=kind != L1_TO_L2, layers=layers)
        if moves and self.mover is not None:
            self.mover.fence()

    def copy_down(self, l1_slots: list[int], l2_slots: list[int]) -> Transfer:
        """Copy L1 blocks into L2 slots the caller took (a streamed sequence's private blocks)."""
        return self._move(L1_TO_L2, l1_slots, l2_slots)

    def copy_l1(self, src: list[int], dst: list[int]) -> None:
        """L1 block src[i] -> dst[i] in every layer, queued on the current stream."""
        self._move(COPY_L1, src, dst)

    def fence(self) -> None:
        """Order the current stream after every L1/L2 move so far (before an L1 slot they read is reused)."""
        self._move(FENCE, [], [])

    def _copy_l1(self, src: list[int], dst: list[int]) -> None:
        slots = [torch.tensor(s, dtype=torch.int64).to(self.device, non_blocking=True) for s in (src, dst)]
        kernels.copy_planes(self.l1.planes, slots[0], self.l1.planes, slots[1])

    # ------------------------------------------------------------------ L1

    def l1_room(self) -> int:
        """L1 slots to be had now: the free ones and those eviction can free."""
        return len(self.l1.free) + self.index.evictable("l1")

    def take_l1(self, n: int, partial: bool = False, loads: int = 0) -> list[int]:
        """`n` free L1 slots, evicting (and demoting) unpinned blocks as needed. Fewer only if
        `partial`. The first `loads` of them are for L2 -> L1 loads, the rest for the compute
        stream to write, which is ordered after any copy still at one of its slots. Evicts
        until `spare` slots stay free beside them."""
        short = n - len(self.l1.free)
        if short > self.index.evictable("l1") and not partial:
            raise CacheFullError(f"L1 needs {short} more blocks than can be evicted")
        if short + self.spare > 0:
            victims = []
            while len(victims) < short + self.spare and (e := self.index.victim("l1")) is not None:
                victims.append(e)
            self._evict_l1(victims)
        slots = self.l1.free.take(min(n, len(self.l1.free)))
        return self._sort_busy(slots, loads) if self._busy else slots

    def _sort_busy(self, slots: list[int], loads: int) -> list[int]:
        """`slots` with those a copy is still at among the first `loads` where they fit (a load
        queues behind that copy on the copy stream), each part in ascending order (runs of
        neighbours for the DMAs). Busy slots left for the compute stream are traded for free ones
        whose copies have ended, the longest free first; it waits for the copies at the rest."""
        busy = [s for s in slots if s in self._busy]
        if not busy:
            return slots
        idle = [s for s in slots if s not in self._busy]
        k = min(loads, len(busy))
        if len(busy) > k:
            settled = self.l1.free.take_oldest(len(busy) - k, self._settled())
            self.l1.free.give(busy[len(busy) - len(settled):])  # (still busy: loads take them first)
            busy, idle = busy[: len(busy) - len(settled)], idle + settled
        taken = [self._busy.pop(s) for s in busy[k:]]
        waits = in_flight(t for copies, _ in taken for t in copies)  # (each transfer queried once)
        if waits:  # counted by slot, as a load where one of its copies is (stats, /metrics)
            pending = set(waits)
            by_load = [loading for copies, loading in taken if not pending.isdisjoint(copies)]
            self.counters.slot_waits_on_loads += sum(by_load)
            self.counters.slot_waits_on_saves += len(by_load) - sum(by_load)
        for t in waits:
            t.wait()
        if waits and self.moves is not None:  # the other ranks replay no such wait: they fence here
            self.moves.append((FENCE, [], []))
        for s in busy[:k]:
            del self._busy[s]
        return sorted(busy[:k] + idle[: loads - k]) + sorted(busy[k:] + idle[loads - k :])

    def _settled(self) -> Callable[[int], bool]:
        """A test of whether no copy is at a free L1 slot any more (forgetting the copies of one
        where they have ended), asking each transfer once."""
        done = functools.cache(lambda t: t.done())

        def settled(slot: int) -> bool:
            if slot in self._busy:
                if not all(done(t) for t in self._busy[slot][0]):
                    return False
                del self._busy[slot]
            return True
        return settled

    def give_l1(self, slots: list[int]) -> None:
        """Private L1 slots (no index entry) go back to the free list."""
        self.l1.free.give(slots)

    def load_pinned(self, entries: list[BlockEntry], l1_slots: list[int]) -> Transfer:
        """Start copying L2 blocks `entries` into `l1_slots`, where they are placed and pinned for
        the caller; each entry's `loading` is the copy until it is done."""
        load = self.load_l2(entries, l1_slots)
        for e, slot in zip(entries, l1_slots):
            self.index.pin(e)
            self.index.place(e, "l1", slot)
            e.loading = load if load is not DONE else None
        return load

    def _evict_l1(self, victims: list[BlockEntry]) -> None:
        self.index.leaving_l1(victims)
        for e in victims:  # written down now if L2 has room, else dropped: owed no more
            self.owed.pop(e.hash, None)
        self.write_down([e for e in victims if e.l2 < 0 and self._admits(e)])
        freed = []
        done = functools.cache(lambda t: t.done())  # each transfer queried once: a load's blocks share one
        for e in victims:
            if e.l2 < 0:
                self.counters.tiers["l1"].drops += 1
            # in L1 with its mark still on, it was warmed (Admission.warm) and no sequence took it
            self.counters.warmed_unused += e.brought_from != ""
            # a copy still reading the block (its save to L2) or writing it (a load for a request
            # that let go of it) keeps the slot from the compute stream until it ends (take_l1)
            copies = (e.reading, e.loading) if e.reading is not None or e.loading is not None else ()
            busy = [t for t in dict.fromkeys(copies) if t is not None and not done(t)]
            loading = e.loading in busy
            slot = self.index.unplace(e, "l1")  # (forgets both)
            if busy:
                self._busy[slot] = (busy, loading)
            freed.append(slot)
        self.l1.free.give(freed[::-1])  # (stacked in eviction order, as one give() a slot would)
        self.counters.tiers["l1"].evictions += len(victims)

    def _admits(self, entry: BlockEntry) -> bool:
        """Whether the write policy lets `entry` into the next tier down when it is evicted."""
        if self.config.write_policy == "selective":
            return entry.hits >= self.config.selective_min_hits
        return True

    # ------------------------------------------------------------------ L2

    def write_down(self, entries: list[BlockEntry]) -> int:
        """Copy L1 blocks that L2 lacks into L2 (as many as L2 can take); returns how many."""
        if self.l2 is None:
            return 0
        entries = [e for e in entries if e.l2 < 0 and e.l1 >= 0]
        slots = self.take_l2(len(entries))
        entries = entries[: len(slots)]
        if entries:
            self.copied_down(entries, slots, self._move(L1_TO_L2, [e.l1 for e in entries], slots))
        return len(entries)

    def copied_down(self, entries: list[BlockEntry], l2_slots: list[int], moved: Transfer) -> None:
        """L1 blocks `entries` are copied into L2 `l2_slots` by `moved`: they live there now,
        and under write-through go on to L3."""
        for e, slot in zip(entries, l2_slots):
            self.index.place(e, "l2", slot)
            e.reading = moved
            self.owed.pop(e.hash, None)
        self.count("l2", len(entries), into=True)
        self.count("l1", len(entries), into=False)
        if self.l3 is not None and self.config.write_policy == "write_through":
            self._flush(entries, moved)

    def save_layers(self, l1_slots: list[int], l2_slots: list[int], layers: range) -> Transfer:
        """Copy `layers` of L1 blocks into L2 slots the caller took (a save issued layer by layer,
        as the forward writes them); the caller places them with `copied_down` once all are."""
        if self.moves is not None:
            raise ConfigError("layer-by-layer saves are not available under tensor parallelism")
        return self.mover.l1_to_l2(l1_slots, l2_slots, layers)

    def take_l2(self, n: int) -> list[int]:
        """Up to `n` free L2 slots. A victim that L3 admits but does not have yet is first
        written there and stays, held, until the write ends; one whose write failed, or that L3
        does not admit, goes at once (a dead L3 must not fill L2 with blocks waiting for it)."""
        while len(self.l2.free) < n and self._evict_l2():
            pass
        return self.l2.free.take(min(n, len(self.l2.free)))

    def give_l2(self, slots: list[int]) -> None:
        """Private L2 slots (no index entry) go back to the free list."""
        self.l2.free.give(slots)

    def _evict_l2(self, copies_only: bool = False) -> bool:
        """Give up the L2 policy's next victim, or start its L3 write; False when none is left.
        `copies_only`: only copies of L1 blocks (index.victim)."""
        e = self.index.victim("l2", copies_only)
        if e is None:
            return False
        if self.l3 is not None and e.l3 == "" and self._admits(e):
            self.index.place(e, "l2", e.l2)  # back in L2, held by the flush until written
            self._flush([e], self.mover.last)
            return True
        if e.l1 < 0 and e.l3 != "written":
            self.counters.tiers["l2"].drops += 1
        self.l2.free.give([self.index.unplace(e, "l2")])
        self.counters.tiers["l2"].evictions += 1
        return True

    def evict_all(self, tier: str) -> None:
        """Give up every block of `tier` that nothing holds, as memory pressure would: L1 blocks
        demote to L2 by the write policy, L2 blocks go to L3 first where it admits them. L3 writes
        that have ended are taken in first: until then they hold their blocks in L2."""
        self.reap()
        if tier == "l1":
            victims = []
            while (e := self.index.victim("l1")) is not None:
                victims.append(e)
            self._evict_l1(victims)
        elif self.l2 is not None:
            while self._evict_l2():
                pass

    def clear(self) -> bool:
        """Drop every L1 and L2 block, copying nothing down (L3 keeps what it has): a reset of the
        prefix cache, recorded as one AllBlocksCleared. Refused (False, nothing dropped) while a
        running sequence holds a block or an L3 write reads one, as vLLM refuses a reset while
        blocks are in use."""
        owed, self.owed = self.owed, OrderedDict()  # aside: no catch-up write may start before the check
        self.reap()
        if any(e.ref or e.held for e in self.index.entries.values()):
            self.owed = owed
            return False
        if self.mover is not None and not self.engine_owned:  # (the engine's copies hold their blocks)
            self.mover.last.synchronize()  # no copy may still read a slot given back
        slots = self.index.clear()
        self.l1.free.give(slots["l1"])
        if self.l2 is not None:
            self.l2.free.give(slots["l2"])
        return True

    @property
    def loads_layers(self) -> bool:
        """Whether a load can move some layers of a block alone (see BlockMover.loads_layers)."""
        return self.mover is not None and self.mover.loads_layers

    def load_l2(self, entries: list[BlockEntry], l1_slots: list[int], full_layers_only: bool = False) -> Transfer:
        """Start copying L2 blocks into L1 slots; the caller places the entries. `full_layers_only`:
        only the layout's full-attention layers (blocks that no sliding window reads any more;
        the caller keeps such blocks private, since their other layers are not there)."""
        if not entries:
            return DONE
        kind, layers = (L2_TO_L1_FULL, self.layout.full_layers) if full_layers_only else (L2_TO_L1, None)
        self.count("l2", len(entries), into=False, layers=layers)
        self.count("l1", len(entries), into=True, layers=layers)
        return self._move(kind, [e.l2 for e in entries], l1_slots)

    # ------------------------------------------------------------------ write policy

    def stored(self, new: list[BlockEntry], tier: str = "l1") -> None:
        """New blocks entered `tier` (L2 directly: a store() larger than L1): count them, and under
        write-through copy them down a tier now."""
        self.count(tier, len(new), into=True)
        self.counters.stored_blocks += len(new)
        if self.config.write_policy != "write_through":
            return
        if tier == "l1":
            self.write_down(new)
            if self.l3 is not None:  # what L2 had no room for goes once L3 writes end (_catch_up)
                self.owed.update((e.hash, e) for e in new if e.l2 < 0 and e.l1 >= 0)
        else:
            self.write_l3(new)

    def used(self, entries: list[BlockEntry], priority: int) -> None:
        """A request reused these blocks: update recency/frequency, and copy down what `selective` now admits."""
        for e in reversed(entries):  # tail first, so the head ends up most recent
            self.index.touch(e, priority)
        if self.config.write_policy == "selective":
            self.write_down([e for e in entries if e.hits == self.config.selective_min_hits])

    # ------------------------------------------------------------------ events, estimates, counters

    def listen(self, events: BlockEvents | None) -> None:
        """Record in `events` every block entering or leaving a tier from now on (None: stop)."""
        self.index.events = events
        for store in self.l3.stores if self.l3 is not None else ():
            store.events = events

    def load_seconds(self, tier: str, num_blocks: int) -> float:
        """Expected seconds to bring `num_blocks` of `tier` into L1 now."""
        if tier == "l1" or num_blocks == 0:
            return 0.0
        l2_time = self.mover.estimate_seconds(num_blocks) if self.mover else 0.0
        if tier == "l2":
            return l2_time
        return l2_time + self.l3.estimate_seconds(num_blocks)

    def count(self, tier: str, n: int, *, into: bool, layers: tuple[int, ...] | None = None) -> None:
        """Count `n` blocks into or out of `tier`, in the bytes that tier holds them in; `layers`:
        only those layers of each block moved."""
        c = self.counters.tiers[tier]
        layout = self.layout if tier == "l1" else self.offload if tier == "l2" else self.l3_layout
        nbytes = n * layout.bytes_per_block
        if layers is not None:
            nbytes = nbytes * len(layers) // self.layout.num_layers
        if into:
            c.blocks_in += n
            c.bytes_in += nbytes
        else:
            c.blocks_out += n
            c.bytes_out += nbytes

    def close(self, timeout: float | None = None) -> None:
        """Finish the moves in flight, write to L3 what the write policy still owes it (waiting at
        most `timeout` seconds; what is left is logged, never raised), and close the stores."""
        if self.engine_owned:
            self.mover.abandon()  # the engine reports nothing more
        if self.mover is not None:
            self.mover.last.synchronize()
        if self.l3 is None:
            self._close_shared_l2()
            return
        try:
            self.flush(timeout, owed_only=True)
        except Exception:  # a closing cache must still release its stores
            log.exception("flushing L3 at close failed")
        self.l3.close()
        self.reap()
        lost = self._unwritten(owed_only=True)
        if lost:
            log.warning("close(): %d blocks (%d tokens) that L3 lacks could not be written within %s s; other "
                        "processes will recompute them", len(lost), len(lost) * self.layout.block_size, timeout)
        self._close_shared_l2()

    def _close_shared_l2(self) -> None:
        """A shared memory L2 (CacheConfig.l2_file) goes with its cache: its file is removed."""
        if self.l2 is not None and self.l2.file is not None:
            self.l2.close()
