"""l3: the interface every L3 store (disk, S3, Redis) offers, their shared bookkeeping, and open_store.

    store = open_store("file:///var/cache/tierkv?size=100GiB", layout)   # or s3://..., redis://...
    store.contains_many(hashes: list[int]) -> list[bool]        # one round trip per call
    store.get_many(ids: list[BlockId], outs: list[buffer], deadline: float | None = None) -> list[bool]
    store.put_many(ids: list[BlockId], payloads: list[buffer]) -> list[bool]
    store.estimate_load_seconds(num_blocks: int) -> float       # for load-or-recompute
    store.stats() -> dict;  store.close()

A buffer is a contiguous CPU tensor (an L2 slot), numpy array, bytearray or memoryview of
exactly layout.bytes_per_block bytes; reads land in it without an intermediate tensor. A get
returns True only when the object's header equals the BlockId asked for (hash, parent, namespace,
token ids), its layout matches and its checksum holds; on False the buffer's bytes are undefined.
`deadline` (time.monotonic() seconds) skips what has not started by then; get_many never returns
while a worker could still write into `outs`, so a slot is free for reuse once it returns.

Stores are thread-safe and never raise on a service or I/O failure: they count the error by
kind and answer a miss or a failed put. They raise only for caller bugs (wrong buffer size) and
for a bad URL at open time (ConfigError). Keys are `<32 hex of the chained hash>`, so the
namespace (model, layout, TP rank, salt) travels in the key and two models never collide.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from ..config import parse_size, redact_url, validate_l3_url
from ..errors import ConfigError
from ..layout import KVLayout
from .codec import BlockId, byte_view, key_hex

__all__ = ["BlockId", "L3Store", "StoreStats", "key_hex", "open_store", "redact_url"]

log = logging.getLogger(__name__)
T = TypeVar("T")

ERROR_KINDS = (
    "checksum",  # payload bytes differ from the header's checksum
    "truncated",  # object shorter than its header says
    "layout",  # another layout, block size or format version
    "mismatch",  # header names another block (hash collision or misnamed object)
    "garbage",  # not a tierkv object at all
    "io",  # OS or service error (connection refused, EIO, EROFS, ENOSPC, HTTP 5xx...)
    "timeout",  # the service did not answer within the store's timeout
    "too_large",  # object above the store's limits (Redis proto-max-bulk-len, disk budget)
    "unavailable",  # skipped: the service failed moments ago and is being given time to return
)


class UrlOptions:
    """The query options of an L3 URL, read once each; unknown options are a ConfigError."""

    def __init__(self, url: str, known: Sequence[str]) -> None:
        self.url = redact_url(url)
        self._q = {k: v[-1] for k, v in parse_qs(urlsplit(url).query, keep_blank_values=True).items()}
        unknown = sorted(set(self._q) - set(known))
        if unknown:
            raise ConfigError(f"L3 URL {self.url} has unknown options {unknown}; accepted: {sorted(known)}")

    def get(self, name: str, default: T, kind: Callable[[str], T]) -> T:
        if name not in self._q:
            return default
        try:
            return kind(self._q[name])
        except (ValueError, ConfigError):
            raise ConfigError(f"L3 URL {self.url}: option {name}={self._q[name]!r} is not valid") from None

    @staticmethod
    def boolean(v: str) -> bool:
        if v.lower() in ("1", "true", "yes", "on"):
            return True
        if v.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(v)

    @staticmethod
    def size(v: str) -> int:
        return parse_size(v)


UNMEASURED_READ_BPS = 1e9  # bytes/s assumed of a store nothing has been read from yet


class StoreStats:
    """Counters and running estimates of one store; every method is thread-safe.

    Latency is an EWMA of small round trips (lookups); bandwidth an EWMA of bytes per second of
    get_many/put_many batches. Both start unknown; until the first read, estimate_load_seconds
    assumes UNMEASURED_READ_BPS, a pace every local disk and nearby network store beats (the cache
    loads a small probe meanwhile, so that a first measurement comes).
    """

    ALPHA = 0.2  # weight of the newest sample: reacts within ~5 batches, smooths single spikes

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {"hits": 0, "misses": 0, "puts": 0, "put_failures": 0, "lookups": 0,
                       "bytes_read": 0, "bytes_written": 0}
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self.latency_s: float | None = None
        self.read_Bps: float | None = None
        self.write_Bps: float | None = None

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self.counts[k] += v

    def error(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.errors[kind] += n

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)

    def sample_latency(self, seconds: float) -> None:
        with self._lock:
            self.latency_s = self._ewma(self.latency_s, seconds)

    def sample_bandwidth(self, nbytes: int, seconds: float, write: bool) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            if write:
                self.write_Bps = self._ewma(self.write_Bps, nbytes / seconds)
            else:
                self.read_Bps = self._ewma(self.read_Bps, nbytes / seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counts, "errors": dict(self.errors), "latency_s": self.latency_s,
                    "read_bandwidth_Bps": self.read_Bps, "write_bandwidth_Bps": self.write_Bps}


class Breaker:
    """After a service failure, skip calls for a short, growing wait instead of paying a timeout
    on every lookup while it is down; the first call after the wait probes it again."""

    def __init__(self, min_wait: float = 0.2, max_wait: float = 5.0) -> None:
        self.min_wait, self.max_wait = min_wait, max_wait
        self._wait = 0.0
        self._until = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        return time.monotonic() >= self._until

    def failure(self) -> None:
        with self._lock:
            self._wait = min(self.max_wait, max(self.min_wait, self._wait * 2))
            self._until = time.monotonic() + self._wait

    def success(self) -> None:
        if self._wait:
            with self._lock:
                self._wait, self._until = 0.0, 0.0


class L3Store(ABC):
    """Base of the disk, S3 and Redis stores: argument checks, stats, the worker pool.

    Subclasses implement _contains, _get and _put on already-validated arguments; they may raise
    anything, which is counted as an io error and answered as misses.
    """

    name: str = "l3"

    def __init__(self, layout: KVLayout, url: str, threads: int) -> None:
        self.layout = layout
        self.url = redact_url(url)
        self._stats = StoreStats()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix=f"tierkv-{self.name}")
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, {self.layout.fingerprint})"

    # -- public API -----------------------------------------------------------------------
    def contains_many(self, hashes: Sequence[int]) -> list[bool]:
        """Which of `hashes` the store holds (a hint: a later get may still miss)."""
        if not hashes or self._closed:
            return [False] * len(hashes)
        t0 = time.monotonic()
        try:
            found = self._contains(list(hashes))
        except Exception as err:  # a store must never take the engine down
            log.warning("%s: lookup failed: %s", self.url, err)
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
        if not ids or self._closed:
            return [False] * len(ids)
        t0 = time.monotonic()
        try:
            ok = self._get(list(ids), views, deadline)
        except Exception as err:
            log.warning("%s: read failed: %s", self.url, err)
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
        if not ids or self._closed:
            return [False] * len(ids)
        t0 = time.monotonic()
        try:
            ok = self._put(list(ids), views)
        except Exception as err:
            log.warning("%s: write failed: %s", self.url, err)
            self._stats.error("io")
            ok = [False] * len(ids)
        done = sum(ok)
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
        return {"name": self.name, "url": self.url, **self._stats.snapshot(), **self._extra_stats()}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._close()

    # -- for subclasses -------------------------------------------------------------------
    def _check_buffer(self, buf: Any) -> memoryview:
        view = byte_view(buf)
        if len(view) != self.layout.bytes_per_block:
            raise ValueError(f"buffer of {len(view)} bytes; {self.layout.fingerprint} blocks are {self.layout.bytes_per_block}")
        return view

    def _parallel(self, fn: Callable[..., bool], args: list[tuple], deadline: float | None = None) -> list[bool]:
        """fn(*a) for each a on the pool; False for what raised or had not started by `deadline`.

        Waits for every started call before returning (they may be writing into caller buffers).
        """
        if deadline is not None and time.monotonic() >= deadline:
            return [False] * len(args)
        if len(args) == 1 and deadline is None:
            return [self._guard(fn, *args[0])]
        futures: list[Future[bool]] = [self._pool.submit(self._guard, fn, *a) for a in args]
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
        return [False if f.cancelled() else f.result() for f in futures]

    def _guard(self, fn: Callable[..., bool], *args: Any) -> bool:
        try:
            return fn(*args)
        except Exception as err:
            log.warning("%s: %s failed: %s", self.url, getattr(fn, "__name__", "call"), err)
            self._stats.error("io")
            return False

    def _extra_stats(self) -> dict[str, Any]:
        return {}

    def _close(self) -> None:
        pass

    @abstractmethod
    def _contains(self, hashes: list[int]) -> list[bool]: ...

    @abstractmethod
    def _get(self, ids: list[BlockId], outs: list[memoryview], deadline: float | None) -> list[bool]: ...

    @abstractmethod
    def _put(self, ids: list[BlockId], payloads: list[memoryview]) -> list[bool]: ...


def open_store(url: str, layout: KVLayout) -> L3Store:
    """The store a URL names: file:///dir?size=..., s3://bucket/prefix?endpoint=..., redis[s]://host:port/db.

    Raises ConfigError for a URL that cannot work (unknown scheme or option, missing client
    library); a service that is down at open time is not an error (its calls miss until it is up).
    """
    validate_l3_url(url, "L3 URL")
    scheme = urlsplit(url).scheme
    try:
        if scheme == "file":
            from .disk import DiskStore

            return DiskStore(url, layout)
        if scheme == "s3":
            from .s3 import S3Store

            return S3Store(url, layout)
        from .redis import RedisStore

        return RedisStore(url, layout)
    except ModuleNotFoundError as err:
        extra = "s3" if scheme == "s3" else "redis"
        raise ConfigError(f"L3 URL {redact_url(url)} needs {err.name}: pip install 'tierkv[{extra}]'") from None
