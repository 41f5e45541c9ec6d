"""TieredKVCache: the facade engines talk to.

Two ways in. The simple one, for engines that keep their own KV: `store` a prefix's KV, `match`
a prompt against every tier, `retrieve` the cached prefix back. The block-level one, for paged
engines, is PagedCache's: `admit` or `allocate` a sequence (admission.py), `append` room,
`commit` blocks as they fill, `free` at the end (paged.py), with LayerMoves' per-layer hooks
and offloads on top (layer_moves.py).

This file builds the cache (the Tiering under it, the guard that serialises calls), copies the
simple API's own tensors (store/retrieve), and runs the lifecycle: flush, evict, close, stats.
Which block is evicted, demoted or copied down is decided in tiering.py, and block bytes move in
transfer.py. It never knows about requests, scheduling or HTTP.

Thread model: every public call holds the cache's one lock (guard.py), so threads may share a
cache; every call after `close()` raises CacheClosedError.
"""

from __future__ import annotations

import logging
import time

import torch

from .config import CacheConfig
from .errors import ConfigError, ShapeError, UsageError
from .events import BlockEvents
from .guard import Guard, guarded
from .hashing import hash_blocks, token_bytes
from .index import BlockEntry
from .layout import KVLayout
from .admission import DEFAULT_L3_DEADLINE_S, max_sequence_tokens, stream_window_blocks
from .layer_moves import LayerMoves
from .plan import Match
from .sequence import SequenceBlocks
from .streaming import LayerStreamer
from .prefetch import Prefetch
from .tiering import Tiering
from .tiers import DevicePool
from .tiers.engine_blocks import EngineBlocks
from .transfer import in_flight

__all__ = ["TieredKVCache", "SequenceBlocks", "Match", "Prefetch", "max_sequence_tokens", "stream_window_blocks"]

log = logging.getLogger(__name__)

SPILL_WAIT_S = 60.0  # how long store() waits, in all, for L3 writes to free L2 room for a spill
CLOSE_FLUSH_TIMEOUT_S = 30.0  # how long close() waits for L3 to take the blocks the write policy owes it


def _put_blocks(out: torch.Tensor, positions: list[int], blocks: torch.Tensor) -> None:
    """out[:, :, positions] = blocks, as one plain copy when the positions are all of out's blocks."""
    if len(positions) == out.shape[2]:
        out.copy_(blocks)
    else:
        out[:, :, torch.tensor(positions, device=out.device)] = blocks


class TieredKVCache(LayerMoves):
    def __init__(
        self,
        layout: KVLayout,
        config: CacheConfig | None = None,
        device: str | torch.device | None = None,
        *,
        model: str = "",
        tp_rank: int = 0,
        kv_caches=None,
        kv_layout: str = "tierkv",
        exchange=None,
        engine_blocks: int | None = None,
        kv_format: str = "",
    ) -> None:
        """`model` names the weights whose KV this is: the L3 tiers are shared between processes
        and machines, and blocks are named by it, so a cache with an L3 needs one (the Hub id
        and revision, a path, or `tierkv.engine.loader`'s fingerprint of the weights).

        `kv_caches`: the engine's own paged KV tensors, to use as L1 instead of a pool of
        tierkv's (CacheConfig.l1 stays unset): blocks then move between them and L2/L3 where they
        are. `kv_layout` names their layout (tiers.gpu.KV_LAYOUTS): "vllm" (one tensor per layer
        [2, N, block_size, kv_heads, head_dim], a list or a dict in layer order), "flashinfer_nhd"
        ([N, 2, block_size, kv_heads, head_dim] per layer), "flashinfer_hnd" ([N, 2, kv_heads,
        block_size, head_dim] per layer) or "tierkv" (one tensor [layers, N, 2, block_size,
        kv_heads, head_dim]). Block slot s of the cache is block s of those tensors.

        `engine_blocks`: the engine owns L1 (its block manager, its buffers, perhaps in other
        processes): the number of KV blocks it has. tierkv then keeps L2 and L3 only; `allocate`
        and `append` take the engine's block ids (`slots=`), and every L1<->L2 copy is recorded
        for the engine to run: `take_moves()` each step, `moves_done(n)` once it ran them (see
        docs/custom_engine.md). `kv_format` names what the engine's pages hold when it is not
        K and V per token and head (vLLM's CPU pages pack K for the vector unit)."""
        self.layout = layout
        self.config = config = config if config is not None else CacheConfig()
        if config.l3 and not (isinstance(model, str) and model.strip()):
            raise ConfigError("a TieredKVCache with an L3 (CacheConfig.l3) needs model=: a name for the weights "
                              "(e.g. the Hub id and revision), since L3 is shared between processes and machines "
                              "and two models with the same KV layout would read each other's blocks")
        l1 = None
        if engine_blocks is not None:
            if kv_caches is not None or config.l1 is not None:
                raise ConfigError("engine_blocks= says the engine owns L1: pass neither kv_caches nor CacheConfig.l1")
            l1 = EngineBlocks(layout, engine_blocks, kv_format)
        elif kv_caches is not None:
            if config.l1 is not None:
                raise ConfigError("CacheConfig.l1 sizes tierkv's own L1 pool; with kv_caches the engine's buffers "
                                  "are L1: leave CacheConfig.l1 unset")
            l1 = DevicePool.of_buffers(layout, kv_caches, kv_layout)
            if device is not None and torch.device(device).type != l1.device.type:
                l1.release()
                raise ConfigError(f"device={device!r} but the kv_caches are on {l1.device}")
            device = l1.device
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model, self.tp_rank = model, tp_rank
        self.block_size = layout.block_size
        self._guard = Guard()
        try:
            # exchange: tensor parallel rank 0's way to the other ranks' KV heads (engine/head_exchange.py)
            self.tiers = Tiering(layout, config, self.device, exchange, guard=self._guard, l1=l1)
        except BaseException:
            if l1 is not None:  # a cache that failed to start holds no buffers
                l1.release()
            raise
        # The parts engines and tests look at directly.
        self.l1, self.l2, self.index, self.counters = self.tiers.l1, self.tiers.l2, self.tiers.index, self.tiers.counters
        self.streamer = LayerStreamer(self.l1, self.l2) if self.l2 is not None else None
        # Private L1 slots that forked sequences share (`fork`): slot -> holders beyond the first.
        # Such a slot goes back to the free list with its last holder.
        self._shared: dict[int, int] = {}
        self._engine_saving: set[int] = set()  # engine-owned L1: hashes being copied into L2 (paged.commit)
        self._live: dict[SequenceBlocks, None] = {}  # sequences allocated and not freed, oldest first

    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the simple API

    @guarded
    def store(self, tokens, kv, salt: str | None = None, *, priority: int = 0) -> int:
        """Cache the KV of the full blocks of `tokens`; returns how many leading tokens the cache now holds.

        kv: [layers, 2, len(tokens), kv_heads, head_dim] in the layout's dtype, or a pair (k, v)
        of [layers, len(tokens), kv_heads, head_dim] each (a 2-layer layout takes only the pair:
        there a tensor [2, 2, ...] could be either order). Blocks already cached are skipped.
        What L1 cannot hold goes straight to L2 in chunks, and on to L3 as the write policy says
        (write-through at once, otherwise when L2 evicts it); when L2's room is held by blocks on
        their way to L3, store() waits for those writes. It keeps less only when no tier has
        room, and never by pushing out an earlier block of this same sequence.
        """
        self._refuse_engine_blocks("store")
        self._refuse_under_tensor_parallel("store")
        tb = token_bytes(tokens)
        kv = self._kv_tensor(kv, len(tb) // 4)
        self.tiers.reap()
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
        self.index.pin_all(in_l1)
        self.index.hold_l2(in_l2)
        # [layers, 2, tokens, h, d] -> [blocks, layers, 2, bs, h, d]
        L, _, _, H, D = kv.shape
        by_block = kv[:, :, : len(hashes) * bs].reshape(L, 2, len(hashes), bs, H, D).permute(2, 0, 1, 3, 4, 5)
        try:
            slots = self.tiers.take_l1(len(missing), partial=True)
            first, rest = missing[: len(slots)], missing[len(slots) :]
            if first:
                self.l1.write(slots, by_block[torch.tensor(first, device=kv.device)])
                self.tiers.stored(self._enter(hashes, tb, ns, first, "l1", slots, priority))
            if rest and self.l2 is not None:
                self._spill(by_block, hashes, tb, ns, rest, priority, held=in_l2)
        finally:
            self.index.unpin_all(in_l1)
            self.index.release_l2(in_l2)
        found = self.index.walk(hashes, ns, tb, bs)
        return (len(found) + self.tiers.l3_present(hashes[len(found) :], len(found))) * bs

    def _kv_tensor(self, kv, num_tokens: int) -> torch.Tensor:
        """`kv` as store() takes it, checked against the layout axis by axis: [layers, 2, T, H, D]."""
        L, _, _, H, D = self.layout.block_shape
        dtype = self.layout.dtype
        pair_shape = (L, num_tokens, H, D)
        if isinstance(kv, (tuple, list)):
            if len(kv) != 2 or not all(isinstance(t, torch.Tensor) and tuple(t.shape) == pair_shape and
                                       t.dtype == dtype for t in kv):
                got = [f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in kv]
                raise ShapeError(f"store() takes kv as a pair (k, v) of {pair_shape} [layers, tokens, kv_heads, "
                                 f"head_dim] in {dtype}, got {got}")
            return torch.stack(tuple(kv), dim=1)  # [L, 2, T, H, D]
        expected = self.layout.kv_shape(num_tokens)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != expected or kv.dtype != dtype:
            got = f"{tuple(kv.shape)} {kv.dtype}" if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ShapeError(f"store() needs kv of shape {expected} [layers, 2, tokens, kv_heads, head_dim] "
                             f"and dtype {dtype}, or a pair (k, v) of {pair_shape}; got {got}")
        if L == 2:
            raise ShapeError(f"with a 2-layer layout a kv tensor of shape {expected} could be [layers, 2, ...] or "
                             f"[2, layers, ...]; pass the pair (k, v) instead, each {pair_shape} [layers, tokens, "
                             "kv_heads, head_dim]")
        return kv

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

    @guarded
    def retrieve(self, tokens, salt: str | None = None, *, limit: int | None = None) -> tuple[int, torch.Tensor]:
        """(n, kv): the longest cached prefix of `tokens` (same `limit` rule as `match`) and its KV.

        kv: [layers, 2, n, kv_heads, head_dim] on the cache's device, read from whichever tier
        holds each block; L3 blocks are read first (waiting up to DEFAULT_L3_DEADLINE_S).
        """
        self._refuse_engine_blocks("retrieve")
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
        for load in in_flight(m.blocks[i].loading for i in in_l1):
            load.wait()
        if in_l1:
            # [k, L, 2, bs, H, D] -> [L, 2, k, bs, H, D]
            _put_blocks(out, in_l1, self.l1.read([m.blocks[i].l1 for i in in_l1]).permute(1, 2, 0, 3, 4, 5))
        if in_l2:
            # [k, L, 2, bs, H, D] -> [L, 2, k, bs, H, D]
            l2_blocks = self.tiers.mover.read_l2([m.blocks[i].l2 for i in in_l2])
            _put_blocks(out, in_l2, l2_blocks.permute(1, 2, 0, 3, 4, 5))
        if k:
            out[:, :, n:] = direct.permute(1, 2, 0, 3, 4, 5).to(self.device)
        self.tiers.count("l1", len(in_l1), into=False)
        self.tiers.count("l2", len(in_l2), into=False)
        self._count_hits(m.query_tokens, [m.blocks[i] for i in in_l1], [m.blocks[i] for i in in_l2], direct_l3=k)
        self.tiers.used(m.blocks, 0)
        return (n + k) * bs, out.view(L, 2, (n + k) * bs, H, D)

    def _refuse_under_tensor_parallel(self, name: str) -> None:
        # The whole-sequence API writes and reads the pools directly: the other ranks' pools,
        # which mirror this one move by move, would not see it.
        if self.tiers.moves is not None:
            raise ConfigError(f"{name}() is not available on a tensor-parallel engine's cache (each rank holds "
                              f"its own KV heads); use it with tensor_parallel_size=1")

    # ------------------------------------------------------------------ an engine-owned L1

    @guarded
    def take_moves(self) -> tuple[int, list[tuple[int, list[int], list[int]]]]:
        """With engine_blocks: the L1<->L2 copies recorded since the last call, for the engine to
        run on its buffers (recorded_moves.run_moves), as (batch number, [(kind, src slots, dst slots)]):
        kind L2_TO_L1 (loads into its blocks: run them before the forward that reads them) or
        L1_TO_L2 (saves: run them after the forward that writes them). Report the batch with
        `moves_done` once its copies are complete; until then its L2 slots stay held."""
        self._require_engine_blocks("take_moves")
        return self.tiers.mover.take()

    @guarded
    def moves_done(self, number: int) -> None:
        """With engine_blocks: every batch up to `number` has been run; saved blocks enter L2 (and,
        write-through, go on to L3), and the L2 blocks loaded from are released."""
        self._require_engine_blocks("moves_done")
        self.tiers.mover.reported(number)

    def _require_engine_blocks(self, name: str) -> None:
        if not self.tiers.engine_owned:
            raise UsageError(f"{name}() is for a cache made with engine_blocks= (the engine owns L1); this cache "
                             "runs its own copies")

    # ------------------------------------------------------------------ lifecycle, reporting

    @guarded
    def synchronize(self) -> None:
        """Block until every L1<->L2 transfer issued so far is complete."""
        if self.tiers.mover is not None:
            self.tiers.mover.last.synchronize()

    @guarded
    def flush(self, timeout: float | None = None) -> bool:
        """Write every block that L3 lacks to L3 and wait (shutdown); True if all landed within `timeout`."""
        return self.tiers.flush(timeout)

    @guarded
    def evict(self, tier: str) -> None:
        """Empty `tier` ("l1" or "l2") of every block no running sequence holds, as memory pressure
        would (L1 demotes to L2 by the write policy, L2 writes to L3 first where it admits them).
        For operators and benchmarks: cached prefixes then hit the tier below. An L2 block stays
        while its L3 write runs: `flush()` waits for those, and another evict("l2") lets them go."""
        if tier not in ("l1", "l2"):
            raise UsageError(f"evict() takes 'l1' or 'l2', got {tier!r}")
        self.tiers.evict_all(tier)

    @guarded
    def clear(self) -> bool:
        """Drop every L1 and L2 block, writing nothing down (L3 keeps what it holds): a reset of
        the prefix cache, recorded as AllBlocksCleared for `listen`ers. Returns False, dropping
        nothing, while a running sequence holds a block or an L3 write reads one."""
        return self.tiers.clear()

    @guarded
    def listen(self, events: BlockEvents | None) -> None:
        """Record in `events` every block that enters or leaves a tier from now on, with its token
        ids (KV-cache events; tierkv-serve publishes them over ZMQ); None stops recording."""
        self.tiers.listen(events)

    def close(self, timeout: float = CLOSE_FLUSH_TIMEOUT_S) -> None:
        """Finish pending transfers, give L3 the blocks the write policy still owes it (write-back
        and selective ones that never left L1/L2), waiting at most `timeout` seconds and logging
        what it could not write, then release the L3 stores. Every later call raises
        CacheClosedError; closing again does nothing."""
        with self._guard.lock:
            if self._guard.closed:
                return
            try:
                self.tiers.close(timeout)
            finally:
                self._guard.closed = True
                self.l1.release()  # the buffers may serve another cache now

    @guarded
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
        # write-through: L1 blocks still waiting for room in L2 to go on to L3 (Tiering.owed)
        out["tiers"]["l3"]["write_backlog_blocks"] = len(self.tiers.owed)
        # each L3 read's estimated against actual time, queued to landed (the last few, and the mean ratio)
        out["l3_reads"] = self.tiers.l3.read_stats() if self.tiers.l3 is not None else None
        return out
