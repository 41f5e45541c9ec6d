"""service: what an L3 store keeps beside its objects: the options of its URL, its counters and
running estimates (StoreStats), a breaker that stops calling a service that just failed, its
health (whether it answers, and why not), and the rate of its WARNING lines.

Shared by every store through L3Store (l3.py). Holds no I/O and knows nothing of blocks or
chunks; it must never import a store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from ..config import parse_size, redact_url
from ..errors import ConfigError

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


WARN_EVERY_S = 10.0  # a store logs at most one WARNING line per this many seconds (Warnings)

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
                       "bytes_read": 0, "bytes_written": 0,
                       "orphans": 0}  # blocks not written: their chunk's earlier blocks were in no object
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


class Warnings:
    """The WARNING lines of one store about its blocks and calls: at most one per WARN_EVERY_S,
    the next one saying how many were held back. A read-only disk, a service that is down or a
    run of damaged objects fails block after block, and a line for each drowned the log (a
    read-only disk: 129 lines in 30 s). Changes of health (Health) are logged apart, always."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._every = WARN_EVERY_S
        self._lock = threading.Lock()
        self._next = 0.0
        self._held = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._held += 1
                return
            held, self._held, self._next = self._held, 0, now + self._every
        if held:
            msg, args = msg + " (%d more warnings of this store since the last one, not logged)", (*args, held)
        self._log.warning(msg, *args)


class Health:
    """Whether a store answers, and why not. Parts of it (a Redis node, an S3 endpoint, a disk's
    writes, its lookups) fail and answer again; the store is degraded while any part fails.
    Logs one WARNING line when the store becomes degraded and one when it is healthy again, never
    one per failed call. `what` names the store in those lines (no credentials)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log, self.what = logger, what
        self._failing: dict[str, str] = {}  # part -> why
        self._since = 0.0  # when the store became degraded
        self._lock = threading.Lock()

    @property
    def healthy(self) -> bool:
        return not self._failing

    def failing(self) -> set[str]:
        """The parts that fail now."""
        with self._lock:
            return set(self._failing)

    def problems(self) -> list[str]:
        """What fails now, one line a part ([] when healthy)."""
        with self._lock:
            return [f"{part} {why}" for part, why in self._failing.items()]

    def failed(self, part: str, why: str) -> None:
        """`part` failed; `why` completes the sentence "<part> <why>" ("lookups", "take longer than 0.5 s")."""
        if part in self._failing:  # the common case while a service is down: no lock
            return
        with self._lock:
            if part in self._failing:
                return
            first = not self._failing
            self._failing[part] = why
            if first:
                self._since = time.monotonic()
        if first:
            self._log.warning("%s: %s %s: degraded until it answers again", self.what, part, why)

    def answered(self, part: str) -> None:
        """A call to `part` succeeded (cheap when it was not failing: called on every success)."""
        if part not in self._failing:
            return
        with self._lock:
            if part not in self._failing:
                return
            del self._failing[part]
            if self._failing:
                return
            down = time.monotonic() - self._since
        self._log.warning("%s: answers again: healthy after %.1f s degraded", self.what, down)


class Breaker:
    """After a service failure, skip calls for a short, growing wait instead of paying a timeout
    on every lookup while it is down; the first call after the wait probes it again. With a
    `health`, its failures and successes are those of `part` of the store."""

    def __init__(self, min_wait: float = 0.2, max_wait: float = 5.0, health: Health | None = None,
                 part: str = "the service") -> None:
        self.min_wait, self.max_wait = min_wait, max_wait
        self.health, self.part = health, part
        self._wait = 0.0
        self._until = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        return time.monotonic() >= self._until

    def failure(self, err: BaseException | None = None) -> None:
        with self._lock:
            self._wait = min(self.max_wait, max(self.min_wait, self._wait * 2))
            self._until = time.monotonic() + self._wait
        if self.health is not None:
            self.health.failed(self.part, "does not answer" + (f" ({describe(err)})" if err is not None else ""))

    def success(self) -> None:
        if self._wait:
            with self._lock:
                self._wait, self._until = 0.0, 0.0
        if self.health is not None:
            self.health.answered(self.part)


def describe(err: BaseException) -> str:
    """An error in a few words for a log line or /health: its type and the start of its message."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:160]}" if text else type(err).__name__
