"""redis: the Redis L3 store (`redis://[:password@]host:port/db?ttl=3600&timeout=2&prefix=tierkv`).

One key per block, `<prefix>:<32 hex>`, value = codec object. Lookups are one pipelined EXISTS
round trip, reads MGET and writes pipelined SET in chunks run in parallel on a few
connections. A dead or slow Redis is a counted miss (socket timeouts, no client-side retries;
a short back-off skips calls while it is down) and the client reconnects once it is back.
Objects above the server's proto-max-bulk-len are refused before sending. Never logs the password.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..layout import KVLayout
from .codec import BlockId, DecodeError, decode_into, encode, key_hex, payload_offset
from .l3 import Breaker, L3Store, UrlOptions

log = logging.getLogger(__name__)
T = TypeVar("T")

_CHUNK_BYTES = 32 << 20  # per MGET / SET pipeline: well under client-query-buffer-limit (1 GB)
_DEFAULT_BULK_LIMIT = 512 << 20  # Redis' default proto-max-bulk-len, used when CONFIG is not allowed


class _Unavailable(Exception):
    """Raised inside the store when the breaker says to skip the call."""


class RedisStore(L3Store):
    name = "redis"

    def __init__(self, url: str, layout: KVLayout) -> None:
        opts = UrlOptions(url, ("ttl", "timeout", "connect_timeout", "prefix", "threads", "max_object"))
        self.ttl = opts.get("ttl", 0, int) or None
        timeout = opts.get("timeout", 2.0, float)
        self.prefix = opts.get("prefix", "tierkv", str)
        threads = opts.get("threads", 4, int)
        self._max_object = opts.get("max_object", 0, UrlOptions.size) or None
        super().__init__(layout, url, threads)
        parts = urlsplit(url)
        self._r = redis.Redis.from_url(
            urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")),
            socket_timeout=timeout,
            socket_connect_timeout=opts.get("connect_timeout", min(timeout, 1.0), float),
            # No hidden retries: a slow answer must become a miss within `timeout`, and the
            # breaker below decides when to try again.
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            max_connections=threads + 2,
        )
        self.object_size = payload_offset(layout) + layout.bytes_per_block
        self._breaker = Breaker()
        self._limit_lock = threading.Lock()
        self._warned_large = False

    def _key(self, h: int) -> str:
        return f"{self.prefix}:{key_hex(h)}"

    def _call(self, fn: Callable[[], T]) -> T:
        """Run one round trip; classify failures for stats and the breaker, then re-raise."""
        if not self._breaker.allow():
            self._stats.error("unavailable")
            raise _Unavailable()
        try:
            out = fn()
        except redis.TimeoutError:
            self._stats.error("timeout")
            self._breaker.failure()
            raise
        except (redis.ConnectionError, OSError):
            self._stats.error("io")
            self._breaker.failure()
            raise
        except redis.RedisError:
            self._stats.error("io")
            raise
        self._breaker.success()
        return out

    def _bulk_limit(self) -> int:
        """The largest value this Redis accepts (proto-max-bulk-len), asked once it answers."""
        if self._max_object is None:
            with self._limit_lock:
                if self._max_object is None:
                    try:
                        got = self._r.config_get("proto-max-bulk-len")
                        self._max_object = int(got.get("proto-max-bulk-len", _DEFAULT_BULK_LIMIT))
                    except redis.ResponseError:  # CONFIG renamed or denied (managed Redis)
                        self._max_object = _DEFAULT_BULK_LIMIT
        return self._max_object

    def _chunks(self, n: int) -> list[range]:
        per = max(1, _CHUNK_BYTES // self.object_size)
        return [range(i, min(n, i + per)) for i in range(0, n, per)]

    # -- L3Store ------------------------------------------------------------------------
    def _contains(self, hashes: list[int]) -> list[bool]:
        def run() -> list[Any]:
            pipe = self._r.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self._key(h))
            return pipe.execute()

        try:
            return [bool(x) for x in self._call(run)]
        except (_Unavailable, redis.RedisError, OSError):
            return [False] * len(hashes)

    def _by_chunks(self, n: int, work, deadline: float | None = None) -> list[bool]:
        """work(range) on each chunk of n items in parallel; a chunk that failed whole is all misses."""
        chunks = self._chunks(n)
        done = self._parallel(work, [(r,) for r in chunks], deadline)
        ok = [False] * n
        for r, chunk_ok in zip(chunks, done):
            if chunk_ok:
                ok[r.start : r.stop] = chunk_ok
        return ok

    def _get(self, ids: list[BlockId], outs: list[memoryview], deadline: float | None) -> list[bool]:
        return self._by_chunks(len(ids), lambda r: self._get_chunk(ids, outs, r), deadline)

    def _get_chunk(self, ids: list[BlockId], outs: list[memoryview], r: range) -> list[bool] | bool:
        try:
            values = self._call(lambda: self._r.mget([self._key(ids[i].hash) for i in r]))
        except (_Unavailable, redis.RedisError, OSError):
            return False
        ok = []
        bad = []
        for i, value in zip(r, values):
            if value is None:
                ok.append(False)
                continue
            try:
                decode_into(self.layout, ids[i], value, outs[i])
                ok.append(True)
            except DecodeError as err:
                log.warning("redis L3 %s: dropping %s (%s)", self.url, key_hex(ids[i].hash), err)
                self._stats.error(err.kind)
                bad.append(self._key(ids[i].hash))
                ok.append(False)
        if bad:
            try:
                self._r.delete(*bad)  # a bad object would fail every reader: remove it once
            except redis.RedisError:
                pass
        return ok

    def _put(self, ids: list[BlockId], payloads: list[memoryview]) -> list[bool]:
        try:
            limit = self._call(self._bulk_limit)
        except (_Unavailable, redis.RedisError, OSError):
            return [False] * len(ids)
        if self.object_size > limit:
            # Every block of a layout has the same size: refuse all, before sending any bytes.
            if not self._warned_large:
                self._warned_large = True
                log.warning("redis L3 %s: blocks of %d bytes exceed the server's limit of %d bytes; not storing",
                            self.url, self.object_size, limit)
            self._stats.error("too_large", len(ids))
            return [False] * len(ids)
        return self._by_chunks(len(ids), lambda r: self._put_chunk(ids, payloads, r))

    def _put_chunk(self, ids: list[BlockId], payloads: list[memoryview], r: range) -> list[bool] | bool:
        def run() -> list[Any]:
            pipe = self._r.pipeline(transaction=False)
            for i in r:
                pipe.set(self._key(ids[i].hash), encode(self.layout, ids[i], payloads[i]), ex=self.ttl)
            return pipe.execute(raise_on_error=False)

        try:
            results = self._call(run)
        except (_Unavailable, redis.RedisError, OSError):
            return False
        ok = []
        for res in results:
            if isinstance(res, Exception):  # e.g. OOM: maxmemory reached with noeviction
                log.warning("redis L3 %s: SET refused: %s", self.url, res)
                self._stats.error("io")
                ok.append(False)
            else:
                ok.append(bool(res))
        return ok

    def _close(self) -> None:
        self._r.close()
        self._r.connection_pool.disconnect()
