"""l3: the interface every L3 store (disk, S3, Redis) offers, its lookups with a timeout, its
health and its shared bookkeeping; chunk objects are chunks.py's. The stores subclass L3Store;
open.py picks one by URL (so this file imports no store); service.py holds what every store
keeps beside its objects (URL options, stats, a breaker, its health).

    store = open_store("file:///var/cache/tierkv?size=100GiB", layout)   # or s3://..., redis://...
    store.contains_many(hashes: list[int], first_pos=0, timeout=None) -> list[bool]   # a prefix-closed hint
    store.get_many(ids: list[BlockId], outs: list[buffer], deadline: float | None = None) -> list[bool]
    store.put_many(ids: list[BlockId], payloads: list[buffer]) -> list[bool]
    store.estimate_load_seconds(num_blocks: int) -> float       # for load-or-recompute
    store.stats() -> dict;  store.health;  store.close()

A buffer is a contiguous CPU tensor (an L2 slot), numpy array, bytearray or memoryview of
exactly layout.bytes_per_block bytes; reads land in it without an intermediate tensor. A get
returns True only when the stored record's header equals the BlockId asked for (hash, parent,
namespace, token ids, chain position), its layout matches and its checksum holds; on False the
buffer's bytes are undefined. `deadline` (time.monotonic() seconds) skips what has not started
by then; get_many never returns while a worker could still write into `outs`, so a slot is free
for reuse once it returns.

Chunk objects (disk, S3), how they are named and looked up (by probing on S3), and the
bookkeeping for them: chunks.py (ChunkObjects, mixed into L3Store).

Health (service.Health). A slow or hung store must never stall the engine, whose thread looks
blocks up: a lookup given a `timeout` (the cache passes `lookup_timeout`, a URL option every store
takes, default LOOKUP_TIMEOUT_S) runs on the store's lookup thread, and one that misses it is a
miss, marks the store's lookups degraded and is left to finish alone. While it runs, lookups miss
at once; after it, each lookup starts a probe (a real lookup, in the background) and misses, until
a probe answers in time while no other part of the store fails. So a hung store costs the engine
one timeout, then nothing. Stores also mark a service that fails (S3, a Redis node: its Breaker)
and a disk whose writes fail. `stats()` says `healthy` and what is wrong (`degraded`); a change of
health is one WARNING line each way, and the per-block WARNINGs are rate-limited (service.Warnings).
The hop to the lookup thread costs ~25 us a lookup (2-vCPU VM; a disk lookup of 16 blocks takes
30-70 us itself). Why 0.5 s: a lookup takes under a millisecond on Redis and a few on nearby S3
(two HEADs, at most four rounds of them when probing), and a step of the engine tens of ms on a
GPU: a lookup ten times slower than remote S3's is a store in trouble, and waiting for it once
costs less than a false alarm on a slow network.

A store with `events` set records each block it stored (and the disk store each object it
evicted) there, under its `medium`; `shared` says whether other processes and machines read it.

Stores are thread-safe and never raise on a service or I/O failure: they count the error by
kind and answer a miss or a failed put. They raise only for caller bugs (wrong buffer size, no
chain position for a chunked store) and for a bad URL at open time (ConfigError). Names start
with the chained hash, so the namespace (model, layout, TP rank, salt) travels in the name and
two models never collide.

Backends implement whole-object I/O by name (_stat, _read, _write, _delete); everything about
chunks lives in chunks.py and codec.py. A backend that still implements the per-block methods
(_contains, _get, _put; the Redis store) keeps one object per block through the same API.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from ..config import redact_url
from ..errors import ConfigError
from ..events import BlockEvents, store_medium
from ..layout import KVLayout
from .chunks import DEFAULT_CHUNK_TOKENS, ChunkObjects
from .codec import BlockId, byte_view, key_hex, payload_offset, record_size
from .service import UNMEASURED_READ_BPS, Health, StoreStats, UrlOptions, Warnings

__all__ = ["BlockId", "L3Store", "key_hex"]

log = logging.getLogger(__name__)
T = TypeVar("T")

LOOKUP_TIMEOUT_S = 0.5  # how long the cache waits for a store's lookup (URL option lookup_timeout; why: above)
COMMON_OPTIONS = ("lookup_timeout",)  # URL options every store takes, read here
_LOOKUPS = "lookups"  # the part of a store's health that lookup timeouts fail


class L3Store(ChunkObjects, ABC):
    """Base of the disk, S3 and Redis stores: argument checks, stats, the worker pool, chunks.

    A chunked backend implements _stat, _read, _write and _delete on whole objects by name; a
    per-block backend implements _contains, _get and _put on already-validated arguments. Either
    may raise anything, which is counted as an io error and answered as misses.
    """

    name: str = "l3"
    align: int = 1  # records in an object start at multiples of this (disk: the page size)
    # Lookups by probe_prefix instead of one check per chunk: for stores whose checks are network
    # round trips (S3), not local stat calls (disk, exact at a few microseconds each).
    probe_lookup: bool = False
    shared: bool = False  # read by other processes and machines too (S3, Redis), not this machine's own

    def __init__(self, layout: KVLayout, url: str, threads: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 opts: UrlOptions | None = None) -> None:
        """`opts`: the store's URL options, for the COMMON_OPTIONS (their defaults without it)."""
        self.layout = layout
        self.url = redact_url(url)
        self.address = self.url.split("?")[0]  # names the store in logs, /health and metrics: no options
        self.lookup_timeout = LOOKUP_TIMEOUT_S if opts is None else opts.get("lookup_timeout", LOOKUP_TIMEOUT_S, float)
        if not self.lookup_timeout > 0:
            raise ConfigError(f"L3 URL {self.url}: lookup_timeout={self.lookup_timeout} must be above 0 (seconds)")
        self._init_chunks(layout, self.url, chunk_tokens)
        self.record_size = record_size(layout, self.align)
        self._offset = payload_offset(layout, self.align)
        self._stats = StoreStats()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix=f"tierkv-{self.name}")
        # lookups with a timeout run here, one at a time: one late lookup is all a hung store costs
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix=f"tierkv-{self.name}-lookup")
        self._late: Future | None = None  # a lookup past its timeout, not finished yet
        self._late_lock = threading.Lock()
        store_log = logging.getLogger(type(self).__module__)
        self.health = Health(store_log, f"{self.name} L3 {self.address}")
        self._warn = Warnings(store_log)  # per-block and per-call WARNING lines, rate-limited
        self._closed = False
        self.events: BlockEvents | None = None  # where stores and evictions are recorded, if anywhere
        # every process sharing the store names it alike: its URL, without credentials or options
        self.medium = store_medium(self.shared, self.url.split("?")[0].replace("***@", ""))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, {self.layout.fingerprint})"

    # -- public API -----------------------------------------------------------------------
    def contains_many(self, hashes: Sequence[int], first_pos: int = 0, timeout: float | None = None) -> list[bool]:
        """Which of `hashes` (a chain's blocks from position `first_pos` on) the store holds.

        A hint: a later get may still miss. A probing store (S3) answers True for a leading run
        and False after it, and may report a hole inside the run (chunks.py).
        `timeout`: seconds to wait for the answer, off the calling thread; a lookup past it is a
        miss and marks the store's lookups degraded (see "Health" in the module docstring). None:
        in this thread."""
        if not hashes or self._closed:
            return [False] * len(hashes)
        if timeout is None:
            return self._contains_now(list(hashes), first_pos)
        with self._late_lock:
            late = self._late is not None and not self._late.done()
            probe = not late and _LOOKUPS in self.health.failing()
            if not late:
                self._late = None
                job = self._lookups.submit(self._timed_lookup, list(hashes), first_pos, timeout)
                if probe:
                    self._late = job  # answers for itself (_timed_lookup); nobody waits for it
        if late or probe:
            self._stats.error("unavailable")
            return [False] * len(hashes)
        try:
            return job.result(timeout)
        except FutureTimeout:
            with self._late_lock:
                self._late = job
            self.health.failed(_LOOKUPS, f"take longer than {timeout:g} s")
            self._stats.error("timeout")
            return [False] * len(hashes)

    def _timed_lookup(self, hashes: list[int], first_pos: int, timeout: float) -> list[bool]:
        """A lookup on the lookup thread. Lookups answer again once one takes at most `timeout`
        while nothing else of the store fails: a probe that is fast only because a breaker skips
        the calls of a hung service has not heard from it, and trusted, the next lookup would wait
        for that service again."""
        t0 = time.monotonic()
        found = self._contains_now(hashes, first_pos)
        if not self.health.healthy and time.monotonic() - t0 <= timeout and self.health.failing() <= {_LOOKUPS}:
            self.health.answered(_LOOKUPS)
        return found

    def _contains_now(self, hashes: list[int], first_pos: int) -> list[bool]:
        t0 = time.monotonic()
        try:
            found = self._lookup(hashes, first_pos) if self.chunked else self._contains(hashes)
        except Exception as err:  # a store must never take the engine down
            self._warn("%s: lookup failed: %s", self.url, err)
            self._stats.error("io")
            found = [False] * len(hashes)
        self._stats.add(lookups=1)
        self._stats.sample_latency(time.monotonic() - t0)
        return found

    def get_many(self, ids: Sequence[BlockId], outs: Sequence[Any], deadline: float | None = None) -> list[bool]:
        """Read blocks into `outs`; True where the block was found and verified."""
        if len(ids) != len(outs):
            raise ValueError(f"get_many: {len(ids)} ids but {len(outs)} output buffers")
        views = [self._check_buffer(o) for o in outs]
        self._check_positions(ids)
        if not ids or self._closed:
            return [False] * len(ids)
        t0 = time.monotonic()
        try:
            ok = self._get_chunks(list(ids), views, deadline) if self.chunked else self._get(list(ids), views, deadline)
        except Exception as err:
            self._warn("%s: read failed: %s", self.url, err)
            self._stats.error("io")
            ok = [False] * len(ids)
        hits = sum(ok)
        nbytes = hits * self.layout.bytes_per_block
        self._stats.add(hits=hits, misses=len(ok) - hits, bytes_read=nbytes)
        self._stats.sample_bandwidth(nbytes, time.monotonic() - t0, write=False)
        return ok

    def put_many(self, ids: Sequence[BlockId], payloads: Sequence[Any]) -> list[bool]:
        """Store blocks; True where the block is now durably in the store."""
        if len(ids) != len(payloads):
            raise ValueError(f"put_many: {len(ids)} ids but {len(payloads)} payloads")
        views = [self._check_buffer(p) for p in payloads]
        for bid in ids:
            # A mislabeled block would poison a store shared by many processes: refuse it here.
            if len(bid.ns) != 16 or len(bid.tokens) != 4 * self.layout.block_size or not bid.chain_ok():
                raise ValueError(f"put_many: BlockId {key_hex(bid.hash)} is not the chained hash of its parent/ns/tokens")
            if bid.pos == 0 and bid.parent != 0:
                raise ValueError(f"put_many: BlockId {key_hex(bid.hash)} at position 0 has a parent")
        self._check_positions(ids)
        if not ids or self._closed:
            return [False] * len(ids)
        t0 = time.monotonic()
        try:
            ok = self._put_chunks(list(ids), views) if self.chunked else self._put(list(ids), views)
        except Exception as err:
            self._warn("%s: write failed: %s", self.url, err)
            self._stats.error("io")
            ok = [False] * len(ids)
        done = sum(ok)
        if not self.chunked:  # (a chunked store records each object as it is written: _put_run)
            self._record_stored([bid for bid, stored in zip(ids, ok) if stored])
        nbytes = done * self.layout.bytes_per_block
        self._stats.add(puts=done, put_failures=len(ok) - done, bytes_written=nbytes)
        self._stats.sample_bandwidth(nbytes, time.monotonic() - t0, write=True)
        return ok

    @property
    def read_measured(self) -> bool:
        """Whether a read has measured this store's bandwidth yet."""
        return self._stats.read_Bps is not None

    def estimate_load_seconds(self, num_blocks: int) -> float:
        """Expected seconds to get `num_blocks` now (round trip + bytes / bandwidth).

        Before the first read the bandwidth is UNMEASURED_READ_BPS, not anything writes showed:
        writes land in the page cache and say nothing of how fast reads come from the device.
        """
        s = self._stats
        latency = s.latency_s or 0.0
        return latency + num_blocks * self.layout.bytes_per_block / (s.read_Bps or UNMEASURED_READ_BPS)

    def stats(self) -> dict[str, Any]:
        """Counters and estimates; `healthy` and, when not, what is wrong (`degraded`). Never
        waits on the service: a scrape of a hung store answers at once."""
        return {"name": self.name, "url": self.url, "store": self.address, "chunk_blocks": self.chunk_blocks,
                "healthy": self.health.healthy, "degraded": self.health.problems(),
                **self._stats.snapshot(), **self._extra_stats()}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._lookups.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self._close()

    def _record_stored(self, ids: list[BlockId]) -> None:
        if self.events is not None:
            for bid in ids:
                self.events.stored(self.medium, bid.hash, bid.parent, bid.tokens)


    # -- for subclasses -------------------------------------------------------------------
    def _check_buffer(self, buf: Any) -> memoryview:
        view = byte_view(buf)
        if len(view) != self.layout.bytes_per_block:
            raise ValueError(f"buffer of {len(view)} bytes; {self.layout.fingerprint} blocks are {self.layout.bytes_per_block}")
        return view

    def _map(self, fn: Callable[..., T], args: list[tuple], default: T, deadline: float | None = None) -> list[T]:
        """fn(*a) for each a on the pool; `default` for what raised or had not started by `deadline`.

        Waits for every started call before returning (they may be writing into caller buffers).
        """
        if deadline is not None and time.monotonic() >= deadline:
            return [default] * len(args)
        if len(args) == 1 and deadline is None:
            return [self._guard(fn, default, *args[0])]
        futures: list[Future[T]] = [self._pool.submit(self._guard, fn, default, *a) for a in args]
        if deadline is not None:
            for f in futures:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    f.result(timeout=remaining)
                except Exception:  # timeout or cancelled: handled below
                    break
            for f in futures:
                f.cancel()  # only succeeds on calls that have not started: safe to drop
        return [default if f.cancelled() else f.result() for f in futures]

    def _parallel(self, fn: Callable[..., bool], args: list[tuple], deadline: float | None = None) -> list[bool]:
        """_map with False for what failed or did not start."""
        return self._map(fn, args, False, deadline)

    def _guard(self, fn: Callable[..., T], default: T, *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as err:
            self._warn("%s: %s failed: %s", self.url, getattr(fn, "__name__", "call"), err)
            self._stats.error("io")
            return default

    def _extra_stats(self) -> dict[str, Any]:
        return {}

    def _close(self) -> None:
        pass

    # Per-block backends (one object per block).
    def _contains(self, hashes: list[int]) -> list[bool]:
        raise NotImplementedError

    def _get(self, ids: list[BlockId], outs: list[memoryview], deadline: float | None) -> list[bool]:
        raise NotImplementedError

    def _put(self, ids: list[BlockId], payloads: list[memoryview]) -> list[bool]:
        raise NotImplementedError
