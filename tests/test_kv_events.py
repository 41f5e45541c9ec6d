"""KV-cache events in vLLM's wire format (tierkv/server/kv_events.py): the config, the batches and
their bytes, a real tierkv-serve publishing them to a real ZMQ subscriber and replay socket, and a
real vllm-router's kv_aware policy routing by them."""

from __future__ import annotations

import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgpack
import pytest
import torch
import zmq
from server_helpers import ServerProcess, free_port, metric

import tierkv
from tierkv.errors import ConfigError
from tierkv.events import CLEARED, CPU, GPU, REMOVED, STORED, Medium
from tierkv.server.kv_events import (
    END_SEQ,
    HASH_MASK,
    KVEventPublisher,
    KVEventsConfig,
    resolve,
    wire_events,
)

BUNDLED = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the name tierkv-serve serves the bundled model under
BS = 16  # tokens per block (the server's default)


# ---------------------------------------------------------------------------------------- config

def test_the_config_takes_vllms_fields_and_defaults():
    cfg = KVEventsConfig.parse("{}")
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == (
        "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert not cfg.enabled
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').enabled  # publisher defaults to zmq
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    full = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000",
            "replay_endpoint": "tcp://*:6001", "buffer_steps": 5, "hwm": 7, "max_queue_size": 9, "topic": "kv"}
    assert KVEventsConfig.parse(full) == KVEventsConfig(**full)  # a YAML mapping works as the JSON does


@pytest.mark.parametrize("text, says", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field(s) endpont; the fields are"),
    ('{"publisher": "kafka"}', "unknown publisher 'kafka'"),
    ("enable_kv_cache_events=true", "must be a JSON object"),
    ('["zmq"]', "must be a JSON object"),
    ('{"buffer_steps": "10"}', "buffer_steps must be an integer"),
    ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events must be true or false"),
    ('{"max_queue_size": 0}', "max_queue_size must be positive"),
    ('{"endpoint": "http://127.0.0.1:5557"}', "endpoint must be a ZMQ address"),
])
def test_a_bad_config_is_refused_with_what_to_change(text, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        KVEventsConfig.parse(text)


def test_the_cli_refuses_a_bad_config_or_a_busy_port_before_loading_the_model():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for cfg, says in ((f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}', "cannot bind"),
                          ('{"enable_kv_cache_events": true, "typo": 1}', "unknown field(s) typo")):
            t0 = time.monotonic()
            out = subprocess.run([sys.executable, "-m", "tierkv.server.cli", "--port", str(free_port()),
                                  "--kv-events-config", cfg], capture_output=True, text=True, timeout=120, check=False)
            assert out.returncode == 2 and says in out.stderr, out.stderr
            assert time.monotonic() - t0 < 20  # no model was loaded


def test_a_wildcard_binds_the_servers_host():
    assert resolve("tcp://*:5557", "127.0.0.1") == "tcp://127.0.0.1:5557"
    assert resolve("tcp://*:5557", "0.0.0.0") == "tcp://0.0.0.0:5557"
    assert resolve("tcp://*:5557", "::1") == "tcp://[::1]:5557"
    assert resolve("ipc:///tmp/kv", "127.0.0.1") == "ipc:///tmp/kv"


def test_the_log_says_whether_the_publisher_binds_or_connects_out(caplog):
    # a named host connects out (vLLM's rule), where a router connecting too would hear nothing
    caplog.set_level("INFO", logger="tierkv.server.kv_events")
    for endpoint, says in ((f"tcp://*:{free_port()}", "bound to tcp://127.0.0.1:"),
                           (f"tcp://127.0.0.1:{free_port()}", "connecting out to (a named host")):
        pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint), host="127.0.0.1",
                               block_size=BS)
        pub.close()
        assert says in caplog.text, caplog.text


# ---------------------------------------------------------------------------------------- wire format

def chain(n: int, first_token: int = 0) -> list[tuple]:
    """Stored records of a chain of n blocks, in chain order: (STORED, GPU, hash, parent, tokens)."""
    out, parent = [], 0
    for i in range(n):
        h = (i + 1) << 100 | (7 + i)  # wider than 64 bits: the wire carries the low 64
        toks = torch.arange(first_token + BS * i, first_token + BS * (i + 1), dtype=torch.int32).numpy().tobytes()
        out.append((STORED, GPU, h, parent, toks))
        parent = h
    return out


def test_a_run_of_chained_blocks_is_one_block_stored_in_either_order():
    blocks = chain(3)
    for records in (blocks, blocks[::-1]):  # the cache enters a run tail first
        [ev] = wire_events(deque(records), BS)
        assert ev["block_hashes"] == [7, 8, 9] and ev["parent_block_hash"] is None
        assert ev["token_ids"] == list(range(3 * BS))
    # a run that starts mid-chain names its parent; another medium starts another event
    evs = wire_events(deque([*blocks[1:], (STORED, CPU, *blocks[0][2:])]), BS)
    assert [(e["medium"], e["block_hashes"], e["parent_block_hash"]) for e in evs] == [
        ("GPU", [8, 9], 7), ("CPU", [7], None)]


def test_removals_and_clears_keep_their_order():
    records = deque([(REMOVED, GPU, 1), (REMOVED, GPU, 2), (REMOVED, CPU, 3), (CLEARED,), (REMOVED, CPU, 4)])
    assert wire_events(records, BS) == [
        {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU", "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {"type": "BlockRemoved", "block_hashes": [4], "medium": "CPU", "group_idx": 0}]


def test_the_payload_is_vllms_bytes():
    """msgpack of [ts, events, rank]: events are maps with vLLM's keys in its struct order (what
    msgspec writes for vLLM >= 0.26 with one full-attention group), shared stores marked."""
    pool = Medium("STORAGE", "REMOTE", "redis://10.0.0.5:6379/0")
    [ev] = wire_events(deque([(STORED, pool, *chain(1)[0][2:])]), BS)
    payload = msgpack.packb([1.5, [ev], 0])
    assert payload[:10] == b"\x93\xcb" + struct.pack(">d", 1.5)  # an array of 3; ts a float64
    ts, [back], rank = msgpack.unpackb(payload)
    assert (ts, rank) == (1.5, 0)
    assert list(back) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                          "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "locality", "ownership"]
    assert back == {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                    "token_ids": list(range(BS)), "block_size": BS, "lora_id": None, "medium": "STORAGE",
                    "lora_name": None, "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention",
                    "locality": "REMOTE", "ownership": "redis://10.0.0.5:6379/0"}
    # a 64-bit hash above 2**63 goes out as msgpack uint64, as msgspec writes a Python int
    big = (STORED, GPU, (1 << 64) - 2, 0, chain(1)[0][4])
    assert b"\xcf" + ((1 << 64) - 2).to_bytes(8, "big") in msgpack.packb(wire_events(deque([big]), BS))
    assert HASH_MASK == (1 << 64) - 1


# ---------------------------------------------------------------------------------------- a real server

def _blocks(events: list[dict], medium: str, locality: str | None = None) -> dict[int, tuple]:
    """hash -> (parent, token ids) of every block stored in `medium`."""
    out = {}
    for e in events:
        if e["type"] == "BlockStored" and e["medium"] == medium and e.get("locality") == locality:
            parent = e["parent_block_hash"]
            for i, h in enumerate(e["block_hashes"]):
                out[h] = (parent, e["token_ids"][i * BS : (i + 1) * BS])
                parent = h
    return out


def _chain_of(blocks: dict[int, tuple], prompt: list[int]) -> list[int]:
    """The hashes of `prompt`'s full blocks, walked from the first through parent links."""
    found, parent = [], None
    for i in range(len(prompt) // BS):
        want = prompt[i * BS : (i + 1) * BS]
        nxt = [h for h, (p, toks) in blocks.items() if p == parent and toks == want]
        if not nxt:
            break
        parent = nxt[0]
        found.append(parent)
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """tierkv-serve with events and replay, L2 and a disk L3 (write-through: each block goes down
    every tier), and an L1 of 39 blocks (0.7 MiB each) so that 7 prompts evict the first ones."""
    tmp = tmp_path_factory.mktemp("kv_events")
    ep, rp = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{ep}", "replay_endpoint": f"tcp://*:{rp}",
           "topic": "kv"}
    srv = ServerProcess(["--kv-events-config", json.dumps(cfg), "--l1", "28MiB", "--l2", "64MiB", "--l3",
                         f"file://{tmp}/l3", "--max-model-len", "256"], tmp / "server.log")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        srv.wait_ready()
        sub.connect(f"tcp://127.0.0.1:{ep}")
        time.sleep(0.5)  # a SUB sees only what is sent after it joined
        prompts = [[1000 + 97 * p + t for t in range(100)] for p in range(7)]  # 6 full blocks each
        for prompt in prompts:
            r = httpx.post(srv.url + "/v1/completions", json={"model": BUNDLED, "prompt": prompt, "max_tokens": 2},
                           timeout=120)
            assert r.status_code == 200, r.text
        time.sleep(1.0)  # write-through to L3 finishes in the background
        live = {}
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            live[int.from_bytes(seq, "big")] = payload
        yield srv, ep, rp, prompts, live, ctx
    finally:
        ctx.destroy(linger=0)
        srv.stop()


def test_a_real_server_publishes_each_tier_its_blocks_enter_and_leave(served):
    srv, _, _, prompts, live, _ = served
    assert sorted(live) == list(range(len(live))) and live  # seq counts from 0 without a gap
    batches = [msgpack.unpackb(live[s]) for s in sorted(live)]
    assert all(isinstance(ts, float) and rank == 0 for ts, _, rank in batches)
    events = [e for _, evs, _ in batches for e in evs]
    gpu, cpu, disk = _blocks(events, "GPU"), _blocks(events, "CPU"), _blocks(events, "STORAGE", "LOCAL")
    first = _chain_of(gpu, prompts[0])
    # the prompt's 6 full blocks, their token ids and chain as sent; the same hashes in L2 and on disk
    assert len(first) == 6
    assert _chain_of(cpu, prompts[0]) == first and _chain_of(disk, prompts[0]) == first
    assert not any("ownership" in e for e in events)  # a local disk is no shared pool
    # L1 holds 39 blocks: the later prompts pushed blocks of the first out of it (L2 keeps them)
    removed = {(e["medium"], h) for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
    assert {("GPU", h) for h in first} & removed and not {("CPU", h) for h in first} & removed
    text = httpx.get(srv.url + "/metrics").text
    assert metric(text, "tierkv_kv_events_dropped_total") == 0
    assert metric(text, "tierkv_kv_events_batches_total") == len(live)


def test_the_replay_socket_sends_the_kept_batches_again(served):
    _, _, rp, _, live, ctx = served
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{rp}")
    start = len(live) // 2
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = {}
    while dealer.poll(5000):
        empty, topic, seq, payload = dealer.recv_multipart()
        assert empty == b"" and topic == b"kv"
        if seq == END_SEQ:
            break
        got[int.from_bytes(seq, "big")] = payload
    else:
        pytest.fail("no end of replay")
    assert got == {s: p for s, p in live.items() if s >= start}
    dealer.close(linger=0)


def test_the_sources_are_listed_as_vllm_lists_them(served):
    srv, ep, rp, _, _, _ = served
    assert httpx.get(srv.url + "/kv_event_sources").json() == [{
        "data_parallel_rank": 0, "endpoint": f"tcp://127.0.0.1:{ep}", "replay_endpoint": f"tcp://127.0.0.1:{rp}",
        "topic": "kv"}]


def test_a_server_bound_everywhere_lists_the_address_it_was_reached_by():
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}"),
                           host="0.0.0.0", block_size=BS)
    try:
        [src] = pub.sources("10.1.2.3")
        assert src["endpoint"] == f"tcp://10.1.2.3:{pub.endpoint.rsplit(':', 1)[1]}" and src["replay_endpoint"] is None
    finally:
        pub.close()


def test_a_full_queue_drops_the_oldest_records_and_the_publisher_counts_them():
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}",
                                          max_queue_size=4), host="127.0.0.1", block_size=BS)
    pub.close()  # no thread taking: records pile up as if the publisher fell behind
    for h in range(10):
        pub.events.removed(GPU, h)
    assert pub.events.dropped == 6 and [r[2] for r in pub.events.take()] == [6, 7, 8, 9]


# ---------------------------------------------------------------------------------------- vllm-router

class Worker:
    """A worker as vllm-router sees it: events from a real TieredKVCache through tierkv's real
    publisher, and an HTTP front answering what the router asks (/health, /tokenize, completions).
    The HTTP front stands in for tierkv-serve until it serves /tokenize; the router needs the
    prompt's token ids to match them against the events."""

    LAYOUT = tierkv.KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=BS)

    def __init__(self, name: str, tokens: list[int]) -> None:
        self.events_port = free_port()
        self.publisher = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                                         endpoint=f"tcp://*:{self.events_port}"),
                                          host="127.0.0.1", block_size=BS)
        block = self.LAYOUT.bytes_per_block
        self.cache = tierkv.TieredKVCache(self.LAYOUT, tierkv.CacheConfig(l1=8 * block, l2=16 * block), device="cpu")
        self.cache.listen(self.publisher.events)

        class Front(BaseHTTPRequestHandler):
            def _send(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send({"status": "ok"} if self.path == "/health" else {}, 200 if self.path == "/health" else 404)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/tokenize":
                    return self._send({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})
                if self.path == "/v1/completions":
                    return self._send({"id": "x", "object": "text_completion", "model": "m", "choices": [
                        {"index": 0, "text": name, "finish_reason": "stop"}]})
                return self._send({}, 404)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Front)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.publisher.close()


def test_vllm_routers_kv_aware_policy_routes_by_the_published_blocks(tmp_path):
    tokens = list(range(1000, 1000 + 5 * BS + 3))  # 5 full blocks
    a, b = Worker("A", tokens), Worker("B", tokens)
    port, log_path = free_port(), tmp_path / "router.log"
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--worker-urls", a.url, b.url, "--policy", "kv_aware",
           "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", "debug", "--kv-event-model", "m", "--kv-event-block-size", str(BS)]
    for w in (a, b):
        cmd += ["--kv-event-source", f"{w.url}=tcp://127.0.0.1:{w.events_port}"]
    with open(log_path, "w") as out:
        router = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def route() -> tuple[str, int]:
        """The worker the router picks for the prompt, and the cached tokens it credits it with."""
        time.sleep(0.3)  # the events reach the router
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                       timeout=30)
        log = re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text())  # without its colours
        decision = [line for line in log.splitlines() if "KV prefix decision" in line][-1]
        return r.json()["choices"][0]["text"], int(re.search(r"credited_prefix_tokens=(\d+)", decision).group(1))

    try:
        end = time.monotonic() + 60
        while "spawned subscriber" not in log_path.read_text() or "Router ready" not in log_path.read_text():
            assert time.monotonic() < end and router.poll() is None, log_path.read_text()
            time.sleep(0.2)
        time.sleep(0.5)
        assert route()[1] == 0
        b.cache.store(tokens, torch.randn(3, 2, len(tokens), 2, 8))  # GPU, a run entered tail first
        assert route() == ("B", 5 * BS)
        a.cache.store(tokens[: 2 * BS], torch.randn(3, 2, 2 * BS, 2, 8))
        assert route() == ("B", 5 * BS)
        b.cache.evict("l1")  # B's blocks now in L2: removed from GPU, stored in CPU, credited less
        assert route() == ("B", int(5 * BS * 0.8))  # vllm-router's default --kv-penalty-host
        assert b.cache.clear()  # AllBlocksCleared: B holds nothing now
        assert route() == ("A", 2 * BS)
        log = log_path.read_text()
        assert "decode batch" not in log and "rejected" not in log, log
    finally:
        router.terminate()
        router.wait(30)
        a.close()
        b.close()
