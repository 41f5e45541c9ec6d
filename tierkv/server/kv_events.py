"""KV-cache events over ZMQ in vLLM's wire format, for cache-aware routers (vllm-router kv_aware,
llm-d's indexer, Dynamo).

Configured with vLLM's JSON (`--kv-events-config`, KVEventsConfig: same fields, same defaults).
A thread takes the cache's block records (tierkv/events.py) every EVENT_INTERVAL_S, makes what
arrived into one batch and sends it as three frames: [topic, seq as 8-byte big-endian, payload].
The payload is msgpack [ts, events, data_parallel_rank]; each event is a map tagged by "type",
with the fields and key order of vLLM >= 0.26 (msgspec structs, map-encoded since vLLM #42892):
BlockStored, BlockRemoved, AllBlocksCleared. The last `buffer_steps` batches answer a ROUTER
replay socket as vLLM's does. Nothing here can hold up the engine: the cache only appends to a
bounded queue, and the PUB socket drops at its high-water mark rather than wait for a reader.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from urllib.parse import urlsplit

import msgpack
import numpy as np

from ..errors import ConfigError
from ..events import CLEARED, STORED, BlockEvents, Medium

log = logging.getLogger(__name__)

EVENT_INTERVAL_S = 0.01  # how often the queue is made into a batch: at most this late to a router
DP_RANK = 0  # the batches' data_parallel_rank: a tierkv-serve is one engine (no data parallelism)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay
HASH_MASK = (1 << 64) - 1  # msgpack integers are 64-bit: the low half of the 128-bit chained hash
PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: its field names, meanings and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, "null" otherwise (as vLLM)
    endpoint: str = "tcp://*:5557"  # a wildcard host binds; any other host is connected to (as vLLM)
    replay_endpoint: str | None = None  # a ROUTER socket, always bound
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark of the PUB socket
    max_queue_size: int = 100_000  # block records waiting for the thread; past it the oldest go
    topic: str = ""

    @classmethod
    def parse(cls, value: str | dict) -> KVEventsConfig:
        """From the flag's JSON text (or a YAML mapping); ConfigError says what to change."""
        flag = "--kv-events-config"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{flag} must be a JSON object such as '{{\"enable_kv_cache_events\": true, "
                                  f"\"endpoint\": \"tcp://*:5557\"}}': {err}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{flag} must be a JSON object of vLLM's KVEventsConfig fields, got {value!r}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ConfigError(f"{flag}: unknown field(s) {', '.join(unknown)}; the fields are {', '.join(known)}")
        kinds = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": str,
                 "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str}
        words = {bool: "true or false", int: "an integer", str: "a string"}
        for name, v in value.items():
            kind = kinds[name]
            if not (v is None and known[name].default is None) and (
                    not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
                raise ConfigError(f"{flag}: {name} must be {words[kind]}, got {v!r}")
        cfg = cls(**value)
        if cfg.publisher is not None and cfg.publisher not in PUBLISHERS:
            raise ConfigError(f"{flag}: unknown publisher {cfg.publisher!r}; tierkv-serve publishes with 'zmq' "
                              "(or 'null' for none)")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(cfg, name) < (1 if name == "max_queue_size" else 0):
                raise ConfigError(f"{flag}: {name} must be {'positive' if name == 'max_queue_size' else '>= 0'}, "
                                  f"got {getattr(cfg, name)}")
        for name in ("endpoint", "replay_endpoint"):
            url = getattr(cfg, name)
            if url is not None and urlsplit(url).scheme not in ("tcp", "ipc", "inproc"):
                raise ConfigError(f"{flag}: {name} must be a ZMQ address such as tcp://*:5557 or ipc:///tmp/kv, "
                                  f"got {url!r}")
        return cfg

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def resolve(endpoint: str, host: str) -> str:
    """The address to bind for `endpoint`: its wildcard host `*` becomes the server's --host. The
    events carry prompt token ids, so they are never open wider than the HTTP API is (the server
    binds 127.0.0.1 by default; --host 0.0.0.0 opens both). Any other address is used as given."""
    return endpoint.replace("*", f"[{host}]" if ":" in host else host, 1)


def _binds(endpoint: str) -> bool:
    # vLLM's rule: bind a wildcard (or IPv6 any) address and ipc/inproc, connect to anything else
    # (a PUB that connects out to an XSUB proxy)
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(slots=True)
class _Run:
    """Consecutive records of one kind and medium that make one event."""

    kind: int
    medium: Medium
    hashes: deque[int]
    parent: int = 0  # stored: the parent of the first block
    tokens: deque[bytes] | None = None  # stored: each block's token ids

    def extend(self, rec: tuple) -> bool:
        """Take `rec` into the run if it continues it: any removal; a stored block that follows
        the run's last block or precedes its first (the cache enters a run tail first)."""
        if rec[0] != self.kind or rec[1] != self.medium:
            return False
        if self.kind != STORED:
            self.hashes.append(rec[2])
        elif rec[3] == self.hashes[-1]:
            self.hashes.append(rec[2])
            self.tokens.append(rec[4])
        elif rec[2] == self.parent:
            self.hashes.appendleft(rec[2])
            self.tokens.appendleft(rec[4])
            self.parent = rec[3]
        else:
            return False
        return True

    def event(self, block_size: int) -> dict:
        hashes = [h & HASH_MASK for h in self.hashes]
        if self.kind == STORED:
            ev = {"type": "BlockStored", "block_hashes": hashes,
                  "parent_block_hash": self.parent & HASH_MASK if self.parent else None,
                  "token_ids": np.frombuffer(b"".join(self.tokens), dtype="<i4").tolist(), "block_size": block_size,
                  "lora_id": None, "medium": self.medium.name, "lora_name": None,
                  # one KV-cache group, full attention: a tierkv block holds every layer's KV
                  "extra_keys": [None] * len(hashes), "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
        else:
            ev = {"type": "BlockRemoved", "block_hashes": hashes, "medium": self.medium.name, "group_idx": 0}
        # vLLM leaves these out when unset. A shared store's blocks carry its name: vllm-router then
        # counts them as that pool's (its "external" tier), not as the worker's own
        if self.medium.locality is not None:
            ev["locality"] = self.medium.locality
        if self.medium.ownership is not None:
            ev["ownership"] = self.medium.ownership
        return ev


def wire_events(records: deque[tuple], block_size: int) -> list[dict]:
    """The records as vLLM's event maps: a run of stored blocks that chain (each the parent of the
    next) in one medium is one BlockStored, as vLLM sends one per run; consecutive removals from
    one medium are one BlockRemoved."""
    out: list[_Run | dict] = []
    for rec in records:
        if rec[0] == CLEARED:
            out.append({"type": "AllBlocksCleared"})
        elif not (out and isinstance(out[-1], _Run) and out[-1].extend(rec)):
            stored = rec[0] == STORED
            out.append(_Run(rec[0], rec[1], deque([rec[2]]), rec[3] if stored else 0,
                            deque([rec[4]]) if stored else None))
    return [r.event(block_size) if isinstance(r, _Run) else r for r in out]


class KVEventPublisher:
    """The ZMQ side: binds (or connects) at construction, so a busy port fails before the model loads."""

    def __init__(self, config: KVEventsConfig, *, host: str, block_size: int) -> None:
        try:
            import zmq
        except ImportError:
            raise ConfigError("--kv-events-config needs pyzmq: pip install 'tierkv[serve]'") from None
        self._zmq = zmq
        self.config, self.block_size = config, block_size
        self.events = BlockEvents(config.max_queue_size)  # what the cache records into
        self.published = 0  # batches sent
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = resolve(config.endpoint, host) if _binds(config.endpoint) else config.endpoint
        self.replay_endpoint = resolve(config.replay_endpoint, host) if config.replay_endpoint else None
        self._replay = self._ctx.socket(zmq.ROUTER) if self.replay_endpoint is not None else None
        if self._replay is not None:
            self._replay.setsockopt(zmq.LINGER, 0)
        self._open(self._pub, self.endpoint, _binds(config.endpoint))
        if self._replay is not None:
            self._open(self._replay, self.replay_endpoint, True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierkv-kv-events", daemon=True)
        self._thread.start()
        # say which: a named host makes the publisher connect out (vLLM's rule), and a router that
        # connects to it too then hears nothing
        log.info("KV-cache events: %s %s (topic %r)%s",
                 "bound to" if _binds(config.endpoint) else "connecting out to (a named host: use tcp://*:PORT "
                 "for routers to connect to)", self.endpoint, config.topic,
                 f", replay bound to {self.replay_endpoint}" if self.replay_endpoint else "")

    def _open(self, sock, endpoint: str, bind: bool) -> None:
        if "[" in endpoint or "::" in endpoint:
            sock.setsockopt(self._zmq.IPV6, 1)
        try:
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except self._zmq.ZMQError as err:
            self._ctx.destroy(linger=0)
            raise ConfigError(f"--kv-events-config: cannot {'bind' if bind else 'connect to'} {endpoint}: "
                              f"{err.strerror}; give a free port (the server's --host replaces '*')") from None

    def sources(self, request_host: str | None) -> list[dict]:
        """GET /kv_event_sources, in vLLM's shape: one entry per data-parallel rank. An address bound
        on every interface is given with the host the client reached the server by."""
        def reachable(url: str | None) -> str | None:
            parts = urlsplit(url or "")
            if request_host is None or parts.hostname not in ("0.0.0.0", "::"):
                return url
            return f"{parts.scheme}://{f'[{request_host}]' if ':' in request_host else request_host}:{parts.port}"

        return [{"data_parallel_rank": DP_RANK, "endpoint": reachable(self.endpoint),
                 "replay_endpoint": reachable(self.replay_endpoint), "topic": self.config.topic}]

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None:
                if self._replay.poll(EVENT_INTERVAL_S * 1000):
                    self._serve_replay()
            else:
                self._stop.wait(EVENT_INTERVAL_S)
            self._send(self.events.take())
        self._send(self.events.take())  # what the cache recorded before close

    def _send(self, records: deque[tuple]) -> None:
        if not records:
            return
        payload = msgpack.packb([time.time(), wire_events(records, self.block_size), DP_RANK])
        seq = self._seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((self._topic, seq, payload))  # a PUB never waits: past hwm it drops
        except Exception:  # a send error must not end the thread: the batch is still kept for replay
            log.exception("publishing KV-cache events failed")
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self.published += 1

    def _serve_replay(self) -> None:
        """A replay request [identity, empty, start seq]: every kept batch from that seq on, as
        [identity, empty, topic, seq, payload], then [identity, empty, topic, -1, empty]."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV-event replay request of %d frames", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        # the topic here too (vLLM sends an empty one): subscribers that check it accept the end
        self._replay.send_multipart((client, b"", self._topic, END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is left, stop the thread and close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        self._ctx.destroy(linger=0)
