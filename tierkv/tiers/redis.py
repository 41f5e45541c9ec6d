"""redis: the Redis L3 store, on one server or on a Redis Cluster.

    redis://[:password@]host:port/db?ttl=3600&timeout=2&prefix=tierkv       one server (rediss:// for TLS)
    redis+cluster://[:password@]host:port,host:port/?ttl=3600&timeout=2    a cluster (rediss+cluster:// for TLS)

One key per block, value = codec object. On one server the key is `<prefix>:<32 hex>`. In a
cluster it is `<prefix>:{<tag>}`: Redis Cluster places a key by the part in braces only, so keys
with one tag share a slot and a node; `slot_tag` is the one place that says what belongs
together. The hosts of a cluster URL are seeds: the store learns the others from them (redis-py's
RedisCluster), sends each key to the node that serves its slot, and after a MOVED/ASK reply or a
failed node asks the cluster for its slot map again.

Bulk traffic (EXISTS lookups, GET reads, SET writes) is pipelined per node, in chunks of at most
_CHUNK_BYTES, on a few connections in parallel. It is framed here in RESP on redis-py's own
pooled connections (redis-py connects, authenticates, selects the db, speaks TLS): a read's
payload is received straight into the caller's buffer and a write sends the caller's buffer as
it is. redis-py's parsers (hiredis too) would first build one bytes object per value, a copy.

hiredis is not a dependency, measured (64 MiB reads in 4 MiB pipelines on 4 connections,
loopback, 2-CPU VM, 2 MiB and 360 KiB blocks): it makes redis-py's own pipelines (GET, then check
and copy each bytes value) 1.4-2x faster, yet they stay 15-30% slower than this path, and here it
would parse only handshakes and small replies: with or without it this path reads at one speed.

Never raises on a service failure: a dead, slow or resharding node is a counted miss or failed
put (socket timeouts, no client-side retries, a short back-off per node while it is down) and
the client reconnects once it is back. Never serves a payload whose header and checksum were not
checked; never sends an object above the server's proto-max-bulk-len; never logs the password.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.crc import key_slot
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from ..config import redis_cluster_nodes
from ..layout import KVLayout
from .codec import (BlockId, DecodeError, check_payload, decode_header, decode_into, encode_header, key_hex,
                    payload_offset)
from .l3 import COMMON_OPTIONS, L3Store
from .service import Breaker, UrlOptions

log = logging.getLogger(__name__)
T = TypeVar("T")

# Per pipeline. Redis runs every command of a pipeline it has received before it sends a reply,
# copying each value into reply buffers of its own. With 32 MiB pipelines those buffers were fresh
# memory each time (loopback, per GB read: ~160K page faults, 0.6 s of server CPU) and the client
# waited while they filled; with 4 MiB ones the server reuses its buffers (no faults, 0.3 s) and
# sends one pipeline while it prepares the next. A block larger than this goes alone.
_CHUNK_BYTES = 4 << 20
_DEFAULT_BULK_LIMIT = 512 << 20  # Redis' default proto-max-bulk-len, used when CONFIG is not allowed
_REFRESH_WAIT = 1.0  # seconds between two reloads of a cluster's slot map
_READ_BUFFER = 64 << 10  # reply framing and small replies; payloads bypass it
# Error replies after which the slot map may be stale: resharding, failover, cluster down.
_TOPOLOGY_ERRORS = (b"MOVED", b"ASK", b"CLUSTERDOWN", b"TRYAGAIN")

# What a call to a Redis server may raise when the service, not the caller, is at fault.
SERVICE_ERRORS = (redis.RedisError, RedisClusterException, OSError)


def slot_tag(h: int) -> str:
    """The hash tag of block `h`'s key: keys with the same tag live on one cluster node.

    Every block is its own object today, so its own hash is its tag (blocks spread evenly over
    the nodes). When blocks are grouped into chunk objects, this returns the chunk's name, so
    that a chunk's keys keep to one node and one pipeline.
    """
    return key_hex(h)


def _part(node: str) -> str:
    """How a node's failures are named in the store's health ("node 10.0.0.5:6379", "cluster")."""
    return node if node == "cluster" else f"node {node}"


def _command(*args: bytes) -> bytes:
    """One RESP command of small arguments."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


class _Unavailable(Exception):
    """Raised inside the store when a node's breaker says to skip the call."""


class _Replies:
    """Reads RESP replies from a connected socket; a bulk payload can go straight into a buffer.

    Socket errors come out as redis.TimeoutError / redis.ConnectionError, anything that is not
    RESP as redis.InvalidResponse; after any of them the connection must be dropped.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_READ_BUFFER)
        self._start = self._end = 0

    def _recv_into(self, view: memoryview) -> int:
        try:
            n = self._sock.recv_into(view)
        except socket.timeout:
            raise redis.TimeoutError("timeout reading from Redis") from None
        except OSError as err:
            raise redis.ConnectionError(f"error reading from Redis: {err}") from None
        if n == 0:
            raise redis.ConnectionError("Redis closed the connection")
        return n

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # keep the unread tail, make room after it
            tail = self._end - self._start
            self._buf[:tail] = self._buf[self._start : self._end]
            self._start, self._end = 0, tail
        if self._end == len(self._buf):
            raise redis.InvalidResponse("reply line longer than the read buffer")
        self._end += self._recv_into(memoryview(self._buf)[self._end :])

    def line(self) -> tuple[bytes, bytes]:
        """The next reply's type byte and the rest of its first line."""
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start : i])
                self._start = i + 2
                if not line:
                    raise redis.InvalidResponse("empty reply line")
                return line[:1], line[1:]
            self._fill()

    def read_into(self, out: memoryview) -> None:
        """Fill `out` with the next len(out) bytes: what is buffered, then straight from the socket."""
        n = min(len(out), self._end - self._start)
        out[:n] = self._buf[self._start : self._start + n]
        self._start += n
        while n < len(out):
            n += self._recv_into(out[n:])

    def read(self, n: int) -> bytearray:
        data = bytearray(n)
        self.read_into(memoryview(data))
        return data

    def end_of_bulk(self) -> None:
        if self.read(2) != b"\r\n":
            raise redis.InvalidResponse("bulk reply not followed by CRLF")


class RedisStore(L3Store):
    name = "redis"
    shared = True

    def __init__(self, url: str, layout: KVLayout) -> None:
        opts = UrlOptions(url, ("ttl", "timeout", "connect_timeout", "prefix", "threads", "max_object", *COMMON_OPTIONS))
        self.ttl = opts.get("ttl", 0, int) or None
        timeout = opts.get("timeout", 2.0, float)
        self.prefix = opts.get("prefix", "tierkv", str)
        threads = opts.get("threads", 4, int)
        self._max_object = opts.get("max_object", 0, UrlOptions.size) or None
        super().__init__(layout, url, threads, opts=opts)
        parts = urlsplit(url)
        self.cluster = parts.scheme.endswith("+cluster")
        client_opts = dict(
            socket_timeout=timeout,
            socket_connect_timeout=opts.get("connect_timeout", min(timeout, 1.0), float),
            # Per node: the workers plus the callers' own threads (engine, L3 reader and writer),
            # which run single-batch calls inline. Running out would read as a node failure.
            max_connections=threads + 8,
        )
        if self.cluster:
            # Built on first use: a cluster that is down when the store opens is a miss, not an error.
            self._cluster_args = dict(
                startup_nodes=[ClusterNode(h, p) for h, p in redis_cluster_nodes(url)],
                username=unquote(parts.username) if parts.username else None,
                password=unquote(parts.password) if parts.password is not None else None,
                ssl=parts.scheme.startswith("rediss"),
                # Serve the slots that are covered even while others are not (a node is down).
                require_full_coverage=False,
                **client_opts,
            )
            self._rc: redis.RedisCluster | None = None
            self._stale = False
            self._next_refresh = 0.0
            self._topology_lock = threading.Lock()
        else:
            self._r = redis.Redis.from_url(
                urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")),
                # No hidden retries: a slow answer must become a miss within `timeout`, and the
                # breaker decides when to try again.
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
                **client_opts,
            )
            self._node_name = f"{parts.hostname}:{parts.port or 6379}"
        self.offset = payload_offset(layout)
        self.object_size = self.offset + layout.bytes_per_block
        self._breakers: dict[str, Breaker] = {}
        self._limits: dict[str, int] = {}  # node -> its proto-max-bulk-len
        self._warned: set[str] = set()

    # -- keys and nodes ---------------------------------------------------------------------
    def _key(self, h: int) -> bytes:
        if self.cluster:
            return f"{self.prefix}:{{{slot_tag(h)}}}".encode()
        return f"{self.prefix}:{key_hex(h)}".encode()

    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    def _call(self, node: str, fn: Callable[[], T]) -> T:
        """Run one round trip to `node`; classify failures for stats and its breaker, then re-raise."""
        breaker = self._breakers.get(node) or self._breakers.setdefault(node, Breaker(health=self.health,
                                                                                      part=_part(node)))
        if not breaker.allow():
            self._stats.error("unavailable")
            raise _Unavailable()
        try:
            out = fn()
        except redis.TimeoutError as err:
            self._stats.error("timeout")
            breaker.failure(err)
            self._node_failed()
            raise
        except (redis.ConnectionError, RedisClusterException, OSError) as err:
            self._stats.error("io")
            breaker.failure(err)
            self._node_failed()
            raise
        except redis.RedisError:
            self._stats.error("io")
            raise
        breaker.success()
        return out

    def _node_failed(self) -> None:
        """A node failed: in a cluster, another may have taken over its slots."""
        if self.cluster:
            self._stale = True

    def _cluster(self) -> redis.RedisCluster:
        """The cluster client, made on first use; its slot map reloaded when marked stale."""
        with self._topology_lock:
            if self._rc is None:
                self._rc = self._call("cluster", lambda: redis.RedisCluster(**self._cluster_args))
            elif self._stale and time.monotonic() >= self._next_refresh:
                # Not behind a breaker: _REFRESH_WAIT already spaces the attempts.
                self._stale = False
                self._next_refresh = time.monotonic() + _REFRESH_WAIT
                try:
                    self._rc.nodes_manager.initialize()
                except SERVICE_ERRORS as err:
                    self._stats.error("io")
                    self._stale = True  # keep using the old map; try again later
                    log.debug("redis L3 %s: reloading the slot map failed: %s", self.url, err)
                else:
                    self._forget_gone_nodes(set(self._rc.nodes_manager.nodes_cache))
            return self._rc

    def _forget_gone_nodes(self, live: set[str]) -> None:
        """Nodes the new slot map lacks get no call again, so none would clear their failure:
        forget them (a failover replaced a dead primary, say) in health and breakers."""
        for node in [n for n in self._breakers if n != "cluster" and n not in live]:
            self._breakers.pop(node, None)
            self.health.answered(_part(node))

    def _route(self, keys: list[bytes], per: int) -> list[tuple[str, redis.Redis, list[int]]]:
        """Batches of key indices, each for one node and of at most `per` keys.

        A key whose slot no node serves is in no batch (a miss). Raises when the cluster's slot
        map cannot be had at all.
        """
        if self.cluster:
            rc = self._cluster()
            by_node: dict[str, tuple[redis.Redis, list[int]]] = {}
            for i, k in enumerate(keys):
                try:
                    node = rc.nodes_manager.get_node_from_slot(key_slot(k))
                except RedisClusterException:  # slot not covered (yet): a miss
                    continue
                if node.name not in by_node:
                    by_node[node.name] = (rc.get_redis_connection(node), [])
                by_node[node.name][1].append(i)
            groups = [(name, client, idx) for name, (client, idx) in by_node.items()]
        else:
            groups = [(self._node_name, self._r, list(range(len(keys))))]
        return [(name, client, idx[i : i + per]) for name, client, idx in groups for i in range(0, len(idx), per)]

    def _batched(self, keys: list[bytes], per: int, work: Callable[[str, redis.Redis, list[int]], Any],
                 deadline: float | None = None) -> list[bool]:
        """work(node, client, indices) -> list[bool] on every batch, in parallel; what failed is False."""
        ok = [False] * len(keys)
        try:
            batches = self._route(keys, per)
        except (_Unavailable, *SERVICE_ERRORS):
            return ok
        for (_, _, idx), got in zip(batches, self._parallel(work, batches, deadline)):
            if got:
                for i, hit in zip(idx, got):
                    ok[i] = hit
        return ok

    def _exchange(self, client: redis.Redis, frames: list[Any], read: Callable[[_Replies], T]) -> T:
        """Send `frames` on one of `client`'s pooled connections and read the replies with `read`.

        The connection comes from redis-py (connected, authenticated, db selected); a reply read
        only in part leaves it unusable, so any failure drops it.
        """
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(frames, check_health=False)
            sock = getattr(conn, "_sock", None)  # redis-py's connected socket (private, stable since 2.x)
            if sock is None:
                raise redis.ConnectionError("connection has no socket")
            return read(_Replies(sock))
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _error_reply(self, node: str, message: bytes, what: str) -> None:
        """Count and report an error reply to one command; the connection stays usable."""
        self._stats.error("io")
        kind = message.split(b" ", 1)[0][:32].decode(errors="replace")  # MOVED, OOM, NOAUTH, ...
        if message.startswith(_TOPOLOGY_ERRORS) and self.cluster:
            self._stale = True  # resharding or failover: reload the slot map; this key is a miss
        elif message.startswith(_TOPOLOGY_ERRORS):
            kind = "cluster"
            message = b"the server is a Redis Cluster node; use a redis+cluster:// URL (" + message[:80] + b")"
        self._warn_once(kind, "redis L3 %s: %s refused by %s: %s", self.url, what, node,
                        message[:200].decode(errors="replace"))

    # -- L3Store ------------------------------------------------------------------------
    def _contains(self, hashes: list[int]) -> list[bool]:
        keys = [self._key(h) for h in hashes]

        def batch(node: str, client: redis.Redis, idx: list[int]) -> list[bool]:
            def read(replies: _Replies) -> list[bool]:
                found = []
                for _ in idx:
                    kind, rest = replies.line()
                    if kind == b":":
                        found.append(rest == b"1")
                    elif kind == b"-":
                        self._error_reply(node, rest, "EXISTS")
                        found.append(False)
                    else:
                        raise redis.InvalidResponse(f"unexpected reply to EXISTS: {kind!r}")
                return found

            frames = [b"".join(_command(b"EXISTS", keys[i]) for i in idx)]
            return self._call(node, lambda: self._exchange(client, frames, read))

        return self._batched(keys, max(1, len(keys)), self._quiet(batch))

    def _get(self, ids: list[BlockId], outs: list[memoryview], deadline: float | None) -> list[bool]:
        keys = [self._key(b.hash) for b in ids]

        def batch(node: str, client: redis.Redis, idx: list[int]) -> list[bool]:
            bad: list[bytes] = []
            frames = [b"".join(_command(b"GET", keys[i]) for i in idx)]

            def read(replies: _Replies) -> list[bool]:
                return self._read_blocks(replies, node, ids, outs, idx, bad)

            ok = self._call(node, lambda: self._exchange(client, frames, read))
            if bad:
                try:  # a bad object would fail every reader: remove it once
                    # One key at a time: in a cluster, keys of several slots cannot share a DEL.
                    self._call(node, lambda: [client.delete(k) for k in bad])
                except (_Unavailable, *SERVICE_ERRORS):
                    pass
            return ok

        return self._batched(keys, self._per_batch(), self._quiet(batch), deadline)

    def _read_blocks(self, replies: _Replies, node: str, ids: list[BlockId], outs: list[memoryview],
                     idx: list[int], bad: list[bytes]) -> list[bool]:
        """The replies to one GET per index: True where the block landed in its buffer and checked out."""
        head = memoryview(bytearray(self.offset))
        ok = []
        for i in idx:
            kind, rest = replies.line()
            if kind == b"-":
                self._error_reply(node, rest, "GET")
                ok.append(False)
                continue
            if kind == b"_" or (kind == b"$" and rest == b"-1"):  # no such key (RESP3, RESP2)
                ok.append(False)
                continue
            if kind != b"$" or not rest.isdigit():
                raise redis.InvalidResponse(f"unexpected reply to GET: {kind!r}")
            size = int(rest)
            try:
                if size == self.object_size:
                    # Header into a small buffer, payload straight into the caller's; both are
                    # checked before True is returned (on False the buffer's bytes are undefined).
                    replies.read_into(head)
                    replies.read_into(outs[i])
                    replies.end_of_bulk()
                    check_payload(outs[i], decode_header(self.layout, ids[i], head))
                else:
                    data = replies.read(size)
                    replies.end_of_bulk()
                    decode_into(self.layout, ids[i], data, outs[i])  # raises: wrong size for this layout
                ok.append(True)
            except DecodeError as err:
                self._warn("redis L3 %s: dropping %s (%s)", self.url, key_hex(ids[i].hash), err)
                self._stats.error(err.kind)
                bad.append(self._key(ids[i].hash))
                ok.append(False)
        return ok

    def _put(self, ids: list[BlockId], payloads: list[memoryview]) -> list[bool]:
        keys = [self._key(b.hash) for b in ids]
        expire = b"" if self.ttl is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(self.ttl)), self.ttl)
        nargs = b"*5\r\n" if self.ttl is not None else b"*3\r\n"

        def batch(node: str, client: redis.Redis, idx: list[int]) -> list[bool]:
            limit = self._bulk_limit(node, client)
            if self.object_size > limit:
                # Every block of a layout has the same size: refuse all, before sending any bytes.
                self._warn_once("too_large", "redis L3 %s: blocks of %d bytes exceed the server's limit of %d bytes; "
                                "not storing", self.url, self.object_size, limit)
                self._stats.error("too_large", len(idx))
                return [False] * len(idx)
            # SET key value [EX ttl], the value sent as header + the caller's payload buffer.
            frames: list[Any] = []
            tail = b""
            for i in idx:
                header = encode_header(self.layout, ids[i], payloads[i])
                frames.append(b"%b%b$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b"
                              % (tail, nargs, len(keys[i]), keys[i], self.object_size, header))
                frames.append(payloads[i])
                tail = b"\r\n" + expire
            frames.append(tail)

            def read(replies: _Replies) -> list[bool]:
                stored = []
                for _ in idx:
                    kind, rest = replies.line()
                    if kind == b"-":  # e.g. OOM: maxmemory reached with noeviction
                        self._error_reply(node, rest, "SET")
                    elif kind != b"+":
                        raise redis.InvalidResponse(f"unexpected reply to SET: {kind!r}")
                    stored.append(kind == b"+")
                return stored

            return self._call(node, lambda: self._exchange(client, frames, read))

        return self._batched(keys, self._per_batch(), self._quiet(batch))

    def _per_batch(self) -> int:
        return max(1, _CHUNK_BYTES // self.object_size)

    def _quiet(self, batch: Callable[[str, redis.Redis, list[int]], list[bool]]) -> Callable[..., list[bool] | bool]:
        """`batch`, answering False (all misses) where the node failed; _call has counted it."""

        def run(node: str, client: redis.Redis, idx: list[int]) -> list[bool] | bool:
            try:
                return batch(node, client, idx)
            except (_Unavailable, *SERVICE_ERRORS):
                return False

        return run

    def _bulk_limit(self, node: str, client: redis.Redis) -> int:
        """The largest value `node` accepts (proto-max-bulk-len), asked once it answers. Only the
        asking goes through _call: a limit known already is no answer from the node (taken for
        one, a dead node's breaker and health said it was back before each failed write)."""
        if self._max_object is not None:
            return self._max_object
        if node not in self._limits:
            def ask() -> int:
                try:
                    got = client.config_get("proto-max-bulk-len")
                    return int(got.get("proto-max-bulk-len", _DEFAULT_BULK_LIMIT))
                except redis.ResponseError:  # CONFIG renamed or denied (managed Redis)
                    return _DEFAULT_BULK_LIMIT

            self._limits[node] = self._call(node, ask)
        return self._limits[node]

    def _close(self) -> None:
        if not self.cluster:
            self._r.close()
            self._r.connection_pool.disconnect()
        elif self._rc is not None:
            self._rc.close()
