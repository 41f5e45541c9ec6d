"""TierKVConnector under the real vLLM CPU build (issue 38): vLLM runs in a venv of its own
(scripts/vllm_env.sh), offline through tests/vllm_driver.py or as its OpenAI server driven by the
real `openai` client, on the bundled SmolLM2 converted by tierkv, with real files, Redis and
shared memory. Each test asserts that tierkv served KV (vLLM's num_cached_tokens / cached_tokens
after vLLM's own prefix cache was reset, or tierkv's counters) and that the output equals the
cold run's: logprobs bit for bit where the prefill splits the same way, within 1e-4 where chunked
prefill and preemption split it otherwise (vLLM's CPU numerics then differ without tierkv too).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from models import bundled_cache_dir
from server_helpers import ServerProcess
from services import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "vllm_driver.py"
# a prompt of 170 tokens: 5 full blocks of 32, the last token computed
PROMPT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))
OTHER = " ".join(f"Step {i}: mix the flour, the water and the salt, then wait." for i in range(12))


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM venv's python (made the first time: ~3 min and ~3.5 GB)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_env.sh")], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"scripts/vllm_env.sh failed:\n{out.stderr[-3000:]}"
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def model_dir() -> str:
    from tierkv.engine.loader import bundled_model_dir

    return str(bundled_model_dir(bundled_cache_dir()))


def vllm_env(multiprocessing: bool) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0", "TOKENIZERS_PARALLELISM": "false"}


def drive(python: str, spec: dict, tmp_path: Path, multiprocessing: bool = False,
          env: dict[str, str] | None = None) -> tuple[list, str]:
    """Run the driver; returns what each step saw, and vLLM's log."""
    out = subprocess.run([python, str(DRIVER), json.dumps(spec)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, env={**vllm_env(multiprocessing), **(env or {})})
    log = out.stdout + out.stderr
    line = next((x for x in out.stdout.splitlines() if x.startswith("DRIVER_RESULT ")), None)
    assert out.returncode == 0 and line is not None, f"the vLLM driver failed (exit {out.returncode}):\n{log[-6000:]}"
    return json.loads(line[len("DRIVER_RESULT "):]), log


def logprobs(outputs: list[dict]) -> list:
    return [o["logprobs"] for o in outputs]


def test_hits_from_l2_then_l3_and_a_spoiled_or_deleted_l3_object_is_recomputed(vllm_python, model_dir, tmp_path,
                                                                                redis_server):
    """One process: cold; vLLM's prefix cache reset -> an L2 hit; tierkv's L2 reset too -> an L3 hit
    (read asynchronously). Every disk object flipped while Redis holds the blocks: Redis, the
    next store, serves them, and the disk store deletes the corrupt objects (the next lookup
    without Redis misses). Then, with every disk object spoiled where the lookup cannot see it
    (bytes flipped, cut short, or the files deleted behind the store's index) and Redis emptied:
    vLLM is told which blocks failed, recomputes them, and answers the same, each time. Then a new
    process (vLLM's default multiprocessing: scheduler and worker apart, L2 shared through
    /dev/shm) with Redis alone hits what the first stored there."""
    disk = tmp_path / "l3"
    extra = {"l2": "256MiB", "l3": [f"file://{disk}", redis_server.url]}
    gen = {"generate": [PROMPT]}
    reset_all = {"reset": True, "connector": True}
    flush = {"flush_redis": redis_server.url}

    def spoil(how: str) -> dict:
        return {"spoil_disk": str(disk), "how": how, "count": 1000}  # every object: the chain fails at block 0

    steps = [gen, {"reset": True}, gen, {"stats": True}, reset_all, gen, {"stats": True},
             spoil("flip"), reset_all, gen,  # 9: from Redis
             flush, reset_all, gen,  # 12: the corrupt disk objects are gone: a miss (and written again)
             spoil("flip"), flush, reset_all, gen,  # 16
             spoil("truncate"), flush, reset_all, gen,  # 20
             spoil("delete"), flush, reset_all, gen,  # 24
             {"generate": [OTHER]}]  # 25: stored in Redis for the next process
    seen, log = drive(vllm_python, {"model": model_dir, "extra": extra, "steps": steps}, tmp_path)
    cold, l2_hit, l2_stats, l3_hit, l3_stats = seen[0][0], seen[2][0], seen[3], seen[5][0], seen[6]
    assert cold["num_cached_tokens"] == 0 and cold["prompt_tokens"] == 170
    assert l2_hit["num_cached_tokens"] == 160 and l2_stats["by_tier"]["l2"] == 160
    assert l3_hit["num_cached_tokens"] == 160 and l3_stats["by_tier"]["l3"] == 160
    assert [seen[i]["spoiled"] for i in (7, 13, 17, 21)] == [5, 5, 5, 5]  # 5 blocks, an object each
    assert all(seen[i] is True for i in (1, 4, 8, 11, 15, 19, 23))  # every reset took (tierkv's too)
    from_redis, missed = seen[9][0], seen[12][0]
    after_flip, after_truncate, after_delete = seen[16][0], seen[20][0], seen[24][0]
    assert from_redis["num_cached_tokens"] == 160 and missed["num_cached_tokens"] == 0
    for out in (l2_hit, l3_hit, from_redis, missed, after_flip, after_truncate, after_delete):
        assert out["tokens"] == cold["tokens"] and out["logprobs"] == cold["logprobs"]
    # the flipped, the truncated and the deleted objects: vLLM was told which blocks failed and
    # recomputed them (its num_cached_tokens still counts the promise: vLLM sets it once, at admission)
    assert log.count("Recovered from KV load failure") == 3, [x for x in log.splitlines() if "Recovered" in x]

    other = seen[25][0]
    seen, _ = drive(vllm_python, {"model": model_dir, "extra": {"l2": "256MiB", "l3": [redis_server.url]},
                                  "steps": [{"generate": [OTHER]}]}, tmp_path, multiprocessing=True)
    full_blocks = (other["prompt_tokens"] - 1) // 32 * 32  # all but the last token, in whole blocks
    assert other["num_cached_tokens"] == 0 and seen[0][0]["num_cached_tokens"] == full_blocks
    assert seen[0][0]["logprobs"] == other["logprobs"]


def test_an_unknown_option_stops_vllm_at_start_and_names_the_accepted_ones(vllm_python, model_dir, tmp_path):
    spec = {"model": model_dir, "extra": {"l2": "256MiB", "l3_url": "file:///tmp/x"}, "steps": []}
    out = subprocess.run([vllm_python, str(DRIVER), json.dumps(spec)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=vllm_env(multiprocessing=False))
    assert out.returncode != 0
    assert ("kv_connector_extra_config: unknown key(s) 'l3_url'; TierKVConnector takes l2, l3, eviction, "
            "write_policy, kv_offload_dtype, model") in out.stderr


def test_chunked_prefill_preemption_a_shared_prefix_and_parallel_sampling(vllm_python, model_dir, tmp_path):
    """A small step budget (chunked prefill) and 8 KV blocks (vLLM preempts), prompts that share
    a prefix, and n=2: the round after vLLM's prefix cache is reset loads from tierkv and
    answers as the cold round did."""
    topics = ["fox", "whale", "eagle"]
    distinct = [" ".join(f"Fact {i} about the {t}: it lives far away and eats a lot." for i in range(3))
                for t in topics]
    prefix = " ".join(f"Item {i}: a fox, a dog and a cat." for i in range(4))
    shared = [prefix + f" Question {q}: which animal is first?" for q in range(2)]
    batch = {"generate": distinct + shared, "sampling": {"max_tokens": 48}}
    # seeded n=2 on a prompt prefilled in one step (vLLM CPU cannot chunk a seeded prefill)
    sampled = {"generate": ["Tell me a story about a fox and a dog in the snow."],
               "sampling": {"n": 2, "seed": 7, "temperature": 0.8, "max_tokens": 12}}
    steps = [batch, sampled, {"stats": True}, {"reset": True}, batch, sampled, {"stats": True}]
    llm = {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 8, "max_model_len": 224}
    seen, _ = drive(vllm_python, {"model": model_dir, "extra": {"l2": "256MiB"}, "llm": llm, "steps": steps}, tmp_path)
    cold, cold_n, first, warm, warm_n, end = seen[0], seen[1], seen[2], seen[4], seen[5], seen[6]
    assert first["preemptions"] > 0  # the test's setting did preempt
    assert end["resumed_hit_tokens"] > 0  # a preempted request resumed from tierkv's blocks
    assert end["by_tier"]["l2"] > first["by_tier"]["l2"]
    assert all(o["num_cached_tokens"] > 0 for o in warm)
    assert [o["tokens"] for o in warm] == [o["tokens"] for o in cold]
    diff = max(abs(a - b) for x, y in zip(logprobs(cold), logprobs(warm)) for u, v in zip(x, y) for a, b in zip(u, v))
    assert diff < 1e-4
    assert len(cold_n[0]["tokens"]) == 2 and warm_n[0]["tokens"] == cold_n[0]["tokens"]


def test_tensor_parallel_ranks_store_their_heads_of_blocks_a_single_rank_engine_reads(vllm_python, tmp_path):
    """TP=2 (two CPU workers, one core each): an L2 hit after vLLM's prefix cache is reset answers
    as the cold run did, bit for bit. A TP=1 engine then reads the same blocks from the disk L3
    (L2 and L3 blocks hold every rank's heads, named apart from no TP size) and answers the same
    tokens (logprobs within 1e-4: the two TP sizes sum the attention heads in another order)."""
    from models import save_tiny_checkpoint

    model = str(save_tiny_checkpoint("llama", tmp_path / "tiny", hidden_size=256, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1024,
                                     max_position_embeddings=2048))
    prompt = [(i * 37) % 1000 + 3 for i in range(170)]
    gen = {"generate": [prompt], "sampling": {"detokenize": False}}
    extra = {"l2": "64MiB", "l3": [f"file://{tmp_path / 'l3'}"]}
    llm = {"tensor_parallel_size": 2, "skip_tokenizer_init": True}
    # vLLM binds each CPU worker to a NUMA node of its own unless told the cores (one node here)
    seen, _ = drive(vllm_python, {"model": model, "extra": extra, "llm": llm, "steps": [gen, {"reset": True}, gen]},
                    tmp_path, multiprocessing=True, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    cold, warm = seen[0][0], seen[2][0]
    assert cold["num_cached_tokens"] == 0 and warm["num_cached_tokens"] == 160
    assert warm["tokens"] == cold["tokens"] and warm["logprobs"] == cold["logprobs"]
    seen, _ = drive(vllm_python, {"model": model, "extra": extra, "llm": {"skip_tokenizer_init": True},
                                  "steps": [gen]}, tmp_path)
    single = seen[0][0]
    assert single["num_cached_tokens"] == 160 and single["tokens"] == cold["tokens"]
    assert max(abs(a - b) for a, b in zip(single["logprobs"][0], cold["logprobs"][0])) < 1e-4


class VllmServer(ServerProcess):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: `vllm serve` fails in
    vllm-cpu 0.32.0, whose distribution name it cannot find) with the connector, ready."""

    def __init__(self, python: str, model: str, extra: dict, workdir: Path, events_port: int | None = None) -> None:
        events = [] if events_port is None else ["--kv-events-config", json.dumps(
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}", "topic": "kv"})]
        transfer = {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.integrations.vllm",
                    "kv_role": "kv_both", "kv_connector_extra_config": extra}
        port = free_port()
        super().__init__(
            ["--model", model, "--host", "127.0.0.1", "--block-size", "32", "--max-model-len", "2048", "--enforce-eager",
             "--dtype", "float32", "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer), *events],
            workdir / f"vllm-server-{port}.log", {**vllm_env(multiprocessing=True), "VLLM_SERVER_DEV_MODE": "1"},
            command=("-m", "vllm.entrypoints.openai.api_server"), port=port, python=python)  # (dev mode: the reset route)
        self.wait_ready(300)

    def complete(self):
        from openai import OpenAI

        client = OpenAI(base_url=self.url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].logprobs.token_logprobs

    def reset(self, external: bool) -> None:
        r = httpx.post(f"{self.url}/reset_prefix_cache", params={"reset_external": str(external).lower()}, timeout=30)
        assert r.status_code == 200, r.text


def received_events(sub) -> list[list]:
    """vLLM's KV events published so far, as the maps it sends."""
    import msgpack

    events = []
    while sub.poll(2000):
        _, _, payload = sub.recv_multipart()
        events += msgpack.unpackb(payload)[1]
    return events


def test_vllm_server_reports_tierkv_hits_as_cached_tokens_and_a_restart_hits_l3(vllm_python, model_dir, tmp_path):
    """vLLM's OpenAI server (its own processes for scheduler and worker) with the connector:
    usage.prompt_tokens_details.cached_tokens counts tierkv's L2 hit after vLLM's prefix cache is
    reset; vLLM's KV events name tierkv's CPU and STORAGE blocks by vLLM's own block hashes (the
    ones its GPU events use); /metrics carries tierkv's counters; a restarted server hits L3."""
    import zmq

    extra = {"l2": "256MiB", "l3": [f"file://{tmp_path / 'l3'}"]}
    events_port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{events_port}")  # vLLM's publisher binds it; zmq connects once it is up
    server = VllmServer(vllm_python, model_dir, extra, tmp_path, events_port=events_port)
    try:
        cached, cold = server.complete()
        assert cached == 0
        server.reset(external=False)  # vLLM's own prefix cache only: the hit is tierkv's L2
        cached, warm = server.complete()
        assert cached == 160 and warm == cold
        events = received_events(sub)
        stored: dict[str, set] = {}
        for e in events:
            if e["type"] == "BlockStored":
                stored.setdefault(e["medium"], set()).update(e["block_hashes"])
        assert len(stored.get("CPU", ())) == 5 and len(stored.get("STORAGE", ())) == 5, events
        assert stored["CPU"] == stored["STORAGE"] and stored["CPU"] <= stored["GPU"]
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        hits = [line for line in metrics.splitlines()
                if line.startswith("tierkv_prefix_cache_hit_tokens_total{") and 'tier="l2"' in line]
        assert hits and float(hits[0].rsplit(" ", 1)[1]) == 160, metrics[-3000:]
    finally:
        ctx.destroy(linger=0)
        server.stop()
    server = VllmServer(vllm_python, model_dir, extra, tmp_path)  # restarted: L2 is gone, the disk L3 is not
    try:
        cached, again = server.complete()
        assert cached == 160 and again == cold
    finally:
        server.stop()
