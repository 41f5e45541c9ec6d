"""A real tierkv-serve under load, for the soak and fault tests: a tiny model whose answers name
their token ids, one request through httpx, and the server's stats once it is idle.

The model is a random-weight tiny Llama (tests/models.py) with a word-level tokenizer whose
token i is the word "w{i}": prompts go as token ids, and every answer's text (streamed delta by
delta or whole) names its token ids exactly, so answers compare id by id. Tiny, so that a CPU
step costs milliseconds and the load is the server's own work, not the model's. Starts nothing
by itself; the tests own every process.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from models import save_tiny_checkpoint, save_word_tokenizer
from server_helpers import ServerProcess, metric

MODEL = "tiny"
VOCAB = 512  # tests/models.py TINY
BLOCK = 16
PREFIX_TOKENS = 4 * BLOCK  # a shared prefix: 4 full blocks
PROMPT_TOKENS = PREFIX_TOKENS + 8
MAX_TOKENS = 16  # with ignore_eos: every request prefills 72 tokens and decodes 16
# One block of the tiny model: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
# torch's OpenMP workers spin-wait; on a 2-core box shared with the clients and Redis that turns
# a 35 ms request into 0.3-3 s at random (measured). One thread makes each step cost the same
# whatever else runs, which is what a latency comparison between quarters needs.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A random-weight tiny Llama with a word-level tokenizer: token i <-> the word "w{i}"."""
    return save_word_tokenizer(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-soak"), seed=1), VOCAB)


def start_server(model: Path, log: Path, l1: int, l2: int, l3: str) -> ServerProcess:
    srv = ServerProcess(["--model", str(model), "--served-model-name", MODEL, "--l1", str(l1), "--l2", str(l2),
                         "--l3", l3, "--log-level", "warning"], log, env=SERVER_ENV)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


def cap_redis(redis_server, size: int) -> None:
    """Bound the store (write-through puts every block there): an LRU Redis, as one would deploy."""
    r = redis_server.client()
    r.config_set("maxmemory", str(size))
    r.config_set("maxmemory-policy", "allkeys-lru")


def ids_of(text: str) -> list[int]:
    words = text.split()
    assert all(w[0] == "w" for w in words), text
    return [int(w[1:]) for w in words]


# ---------------------------------------------------------------------------- one request


@dataclass(slots=True)
class Answer:
    key: int  # which request: the plan's key (fault test), the client's count (soak)
    stream: bool
    start: float
    end: float
    error: str | None  # what was wrong with the answer, None when it is complete
    ids: list[int]

    @property
    def latency(self) -> float:
        return self.end - self.start


async def complete(c: httpx.AsyncClient, url: str, key: int, prompt: list[int], stream: bool) -> Answer:
    """One /v1/completions request, checked: status 200, MAX_TOKENS ids, finish_reason length, usage
    and (streaming) an event per token and [DONE] last. Never raises: a failure is the Answer's error."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    ids: list[int] = []
    try:
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise AssertionError(f"status {r.status_code}: {r.text[:300]}")
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            usage = chunks[-1]["usage"]
            deltas = [ch["choices"][0] for ch in chunks[:-1]]
            text = "".join(d["text"] for d in deltas)
            reason = deltas[-1]["finish_reason"]
            assert sum(1 for d in deltas if d["text"]) == MAX_TOKENS, deltas  # one word a token
        else:
            r = await c.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, f"status {r.status_code}: {r.text[:300]}"
            out = r.json()
            text, reason, usage = out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"]
        ids = ids_of(text)
        assert len(ids) == MAX_TOKENS and reason == "length", (len(ids), reason)
        assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] == len(prompt), usage
        error = None
    except Exception as err:  # noqa: BLE001 (reported with the others at the end)
        error = f"{type(err).__name__}: {err}"
    return Answer(key, stream, start, time.monotonic(), error, ids)


def stats(srv: ServerProcess) -> dict:
    return httpx.get(srv.url + "/v1/cache/stats", timeout=30).json()


def redis_stats(s: dict) -> dict:
    (store,) = s["l3_stores"]
    assert store["name"] == "redis"
    return store


def wait_idle_and_nothing_held(srv: ServerProcess, timeout: float = 30.0) -> dict:
    """Once no request runs, every L1 block is evictable or free (no pin left behind), and so is
    every L2 block once the background L3 writes are done (no hold left behind). `used` is
    `capacity - len(free list)`, so used == evictable also says that no slot left both the free
    list and the index (a leaked slot)."""
    end = time.monotonic() + timeout
    while True:
        m = httpx.get(srv.url + "/metrics", timeout=30).text
        s = stats(srv)
        l1, l2 = s["tiers"]["l1"], s["tiers"]["l2"]
        idle = metric(m, "tierkv_requests_running") == 0 and metric(m, "tierkv_requests_waiting") == 0
        if idle and l1["used_blocks"] == l1["evictable_blocks"] and l2["used_blocks"] == l2["evictable_blocks"]:
            break
        if time.monotonic() > end:
            raise AssertionError(f"blocks still held {timeout} s after the last answer: l1 {l1}, l2 {l2}, "
                                 f"running {metric(m, 'tierkv_requests_running')}")
        time.sleep(0.2)
    for tier in ("l1", "l2"):
        t = s["tiers"][tier]
        assert 0 <= t["used_blocks"] <= t["capacity_blocks"], t
    # each index entry sits in L1 or L2 (or both): as many entries as the slots they use, at most
    assert max(l1["used_blocks"], l2["used_blocks"]) <= s["blocks"] <= l1["used_blocks"] + l2["used_blocks"], s
    return s


def assert_clean_exit(srv: ServerProcess, code: int) -> None:
    """The server drained and exited 0 on SIGTERM, and logged no stack trace all along."""
    log = srv.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
