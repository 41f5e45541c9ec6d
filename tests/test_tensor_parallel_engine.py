"""The engine over tensor-parallel ranks (CPU, gloo, 2 processes started by the engine itself).

TP=2 gives TP=1's greedy tokens on tiny Llama, Qwen2, Qwen3, Qwen3-MoE, gpt-oss and Gemma 3 (sliding
windows: every rank keeps a cache per layer group, split as rank 0 splits L1, and the worker
repeats each group's moves, the window group's hits loading only their windows) and DeepSeek-V3
(MLA: the one latent head is replicated, not split) checkpoints:
- with prefix caching and L2 on, a second round served from L1 and a third from L2 (rank 0's
  decision; the worker repeats its loads on its own L2, and its counters show it), with n=2
  choices whose partial block is copied on write;
- with an L1 of a few blocks, where a long prompt streams from L2 and requests are preempted
  (Llama, and gpt-oss, whose full-attention group's cache streams).

Bad input fails before any process starts. A worker killed mid-generate ends the call with
TensorParallelError naming it, and no process is left; nor after the user's process is
SIGTERMed or SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from models import save_tiny_checkpoint

from tierkv import LLM, SamplingParams
from tierkv.engine.step_plan import StepPlan, array_names
from tierkv.errors import ConfigError, TensorParallelError
from tierkv.groups import KVGroups, caches_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompts(lengths, seed: int = 0, shared: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [head + torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-engine")
    return {kind: str(save_tiny_checkpoint(kind, root / kind, seed=3))
            for kind in ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3", "deepseek_v3")}


def rounds(llm: LLM, batch: list[list[int]]) -> list[list[list[int]]]:
    """Three rounds of the same prompts: computed, then from L1, then from L2 (L1 emptied)."""
    out = []
    for r in range(3):
        if r == 2:
            llm.cache.evict("l1")
        outs = llm.generate(batch, [GREEDY] * (len(batch) - 1) + [SamplingParams(n=2, temperature=0.0, max_tokens=10,
                                                                                 ignore_eos=True)], use_tqdm=False)
        if r:
            assert all(o.cached_tokens > 0 for o in outs)
        out.append([o.token_ids for o in outs] + [outs[-1].choices[1].token_ids])
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3", "deepseek_v3"])
def test_two_ranks_give_one_rank_greedy_tokens_through_l1_and_l2(checkpoints, kind):
    batch = prompts([9, 30, 17, 22], seed=1, shared=12)
    options = dict(device="cpu", block_size=4, l2="2MiB")
    one = LLM(checkpoints[kind], **options)
    want = rounds(one, batch)
    one.close()
    two = LLM(checkpoints[kind], tensor_parallel_size=2, **options)
    try:
        # a model of full and window layers keeps a cache per layer group on every rank, as one rank does
        hybrid = len(two.cache.layout.groups) > 1
        assert hybrid == (kind in ("gpt_oss", "gemma3"))
        assert isinstance(two.cache, KVGroups) == isinstance(one.cache, KVGroups) == hybrid
        assert rounds(two, batch) == want
        stats = two.engine.cache_stats()
        rank0, rank1 = (r["tiers"] for r in stats["ranks"])
        assert rank0["l2"]["blocks_out"] > 0  # the third round loaded from L2 ...
        # ... and the worker repeated every L2 load and copy-down on its own pools, of its heads
        assert rank1["l2"]["blocks_out"] == rank0["l2"]["blocks_out"]
        assert rank1["l2"]["blocks_in"] == rank0["l2"]["blocks_in"] > 0
        assert stats["tiers"]["l2"]["bytes_out"] == 2 * rank0["l2"]["bytes_out"]
        assert rank1["l2"]["bytes_out"] == rank0["l2"]["bytes_out"]
        # each rank holds half the KV heads: the same blocks at half the bytes of TP=1's (in each
        # group's cache); an MLA latent is one head, which every rank holds whole
        share = 1 if one.cache.layout.latent else 2
        ranks = [r.get("groups", [r]) for r in stats["ranks"]]  # each rank's caches
        for cache, *on_ranks in zip(caches_of(one.cache), *ranks):
            for tiers in (r["tiers"] for r in on_ranks):
                assert tiers["l1"]["capacity_bytes"] // tiers["l1"]["capacity_blocks"] == \
                    cache.layout.bytes_per_block // share
                assert tiers["l2"]["blocks_out"] == on_ranks[0]["tiers"]["l2"]["blocks_out"]  # each cache repeated
        if hybrid:
            # the third round's hits loaded each window group's last blocks alone, on both ranks
            (full, window), _ = ranks
            assert 0 < window["tiers"]["l2"]["blocks_out"] < full["tiers"]["l2"]["blocks_out"]
            assert two.cache.caches[1].l1.num_blocks < two.cache.caches[0].l1.num_blocks
    finally:
        two.close()


def test_a_step_plan_with_layer_groups_travels_whole():
    """The wire format another rank decodes: each cache's moves apart, and each layer group's
    slots and block tables."""
    arrays = {name: np.arange(i, i + 3) for i, name in enumerate(array_names(3))}
    plan = StepPlan(moves=[[(1, [4, 5], [6, 7])], [], [(0, [1], [2]), (5, [3], [9])]], arrays=arrays, width=3,
                    is_decode=True, context=17, streamed_from=1, streamed=[([1, 2], [3, 4])])
    back = StepPlan.decode(plan.encode())
    assert back.moves == plan.moves and back.streamed == plan.streamed
    assert list(back.arrays) == array_names(3) == list(arrays)
    assert all(np.array_equal(back.arrays[k], v) for k, v in arrays.items())
    assert (back.width, back.is_decode, back.context, back.streamed_from) == (3, True, 17, 1)
    assert "block_tables:2" in arrays and StepPlan.decode(StepPlan(moves=[[]]).encode()).arrays == {}


def test_fp8_offload_per_rank_matches_one_rank(checkpoints):
    """fp8 L2 blocks carry one scale per KV head, so splitting the heads over ranks quantises
    exactly as one rank does: the L2-served round gives TP=1's tokens."""
    batch = prompts([14, 27], seed=6, shared=16)
    options = dict(device="cpu", block_size=4, l2="2MiB", kv_offload_dtype="fp8_e4m3")
    one = LLM(checkpoints["qwen3"], **options)
    want = rounds(one, batch)
    one.close()
    two = LLM(checkpoints["qwen3"], tensor_parallel_size=2, **options)
    try:
        assert rounds(two, batch) == want
        rank0, rank1 = (r["tiers"] for r in two.engine.cache_stats()["ranks"])
        assert rank1["l2"]["blocks_out"] == rank0["l2"]["blocks_out"] > 0
        # each rank's L2 block: fp8 values of its heads and their scales, half of TP=1's
        assert rank0["l2"]["capacity_bytes"] // rank0["l2"]["capacity_blocks"] == \
            one.cache.l2.layout.bytes_per_block // 2
    finally:
        two.close()


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_streaming_and_preemption_in_a_tiny_l1_match_one_rank(checkpoints, kind):
    path = checkpoints[kind]
    long, *short = prompts([150, 21, 33, 12], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, device="cpu").generate([long, *short], params, use_tqdm=False)]
    bb = LLM(path, device="cpu", l1=1 << 20, block_size=4).cache.layout.bytes_per_block
    # TP=2 blocks are half as big: L1 of 16 of them holds 64 tokens (gpt-oss: in each layer
    # group's cache), under half the long prompt; the short ones and their outputs compete for
    # the rest, so some are preempted
    two = LLM(path, device="cpu", tensor_parallel_size=2, block_size=4, l1=16 * bb // 2, l2=128 * bb // 2,
              max_num_seqs=3)
    try:
        assert [c.l1.num_blocks for c in caches_of(two.cache)] == [16] * len(two.cache.layout.groups)
        assert [o.token_ids for o in two.generate([long, *short], params, use_tqdm=False)] == want
        assert two.engine.scheduler.num_preemptions > 0
        rank0, rank1 = two.engine.cache_stats()["ranks"]
        # the long prompt streamed its offloaded blocks from L2 (the full-attention group's, with
        # groups), and the worker repeated every load of every cache
        assert rank0["tiers"]["l2"]["bytes_out"] > 0
        assert rank1["tiers"]["l2"]["bytes_out"] == rank0["tiers"]["l2"]["bytes_out"]
        assert [g["tiers"]["l2"]["bytes_out"] for g in rank1.get("groups", [])] == \
            [g["tiers"]["l2"]["bytes_out"] for g in rank0.get("groups", [])]
    finally:
        two.close()


def test_bad_sizes_fail_before_any_rank_starts(checkpoints):
    path = checkpoints["llama"]  # 4 attention heads, 2 KV heads
    with pytest.raises(ConfigError, match=r"does not divide the model's 4 attention heads; use one of \[1, 2, 4\]"):
        LLM(path, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an int >= 1"):
        LLM(path, device="cpu", tensor_parallel_size=0)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ConfigError, match=r"needs 2 GPUs, but [01] are visible; lower it to [01] or less"):
            LLM(path, device="cuda", tensor_parallel_size=2)


def _gone(pid: int, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a child of this process: reap it, or it stays a zombie that kill(0) still finds
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


def test_a_worker_killed_mid_generate_fails_the_call_and_leaves_no_process(checkpoints):
    llm = LLM(checkpoints["llama"], device="cpu", tensor_parallel_size=2, block_size=4)
    worker = llm.engine.workers.procs[0]
    many = prompts([40] * 8, seed=4)
    llm.generate(many[:1], GREEDY, use_tqdm=False)  # ranks up and in step
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(TensorParallelError, match="tensor-parallel tierkv-tp-rank1 exited with code -9"):
        llm.generate(many, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), use_tqdm=False)
    assert _gone(worker.pid, within=10)
    llm.close()  # after the failure: nothing left to stop, and no error


SCRIPT = textwrap.dedent("""
    import sys, time
    from tierkv import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, block_size=4)
        print(" ".join(str(p.pid) for p in llm.engine.workers.procs), flush=True)
        while True:
            llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_rank_outlives_a_killed_user_process(checkpoints, tmp_path, sig):
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    user = subprocess.Popen([sys.executable, str(script), checkpoints["llama"]], stdout=subprocess.PIPE, env=env,
                            text=True)
    try:
        pids = [int(p) for p in user.stdout.readline().split()]
        assert pids, "the script did not start its ranks"
        time.sleep(0.5)  # mid-generate
        user.send_signal(sig)
        user.wait(timeout=30)
        assert all(_gone(pid, within=10) for pid in pids)
    finally:
        user.kill()


def _ranks(pid: int) -> list[int]:
    """The tensor-parallel rank processes `pid` spawned (Linux /proc): its children running
    multiprocessing's spawn_main (not its resource tracker)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                out.append(int(entry.name))
    return out


def test_tierkv_serve_over_two_ranks_answers_like_one_fails_whole_and_stops(checkpoints, tmp_path):
    openai = pytest.importorskip("openai")
    import httpx
    from server_helpers import ServerProcess

    path = checkpoints["qwen2"]
    prompt = prompts([23], seed=5)[0]
    want = LLM(path, device="cpu").generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                            use_tqdm=False)[0].token_ids
    server = ServerProcess(["--model", path, "--device", "cpu", "-tp", "2", "--l2", "1MiB"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        assert "tensor parallel over 2 ranks" in server.log()
        workers = _ranks(server.proc.pid)
        assert len(workers) == 1, "the server did not start its one other rank"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        got = client.completions.create(model="qwen2", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=1,
                                        extra_body={"ignore_eos": True})
        assert [int(t) for t in got.choices[0].logprobs.tokens] == want  # no tokenizer: tokens are named by id
        stats = httpx.get(server.url + "/v1/cache/stats", timeout=30).json()
        assert [r["rank"] for r in stats["ranks"]] == [0, 1]
        m = httpx.get(server.url + "/metrics", timeout=30).text
        assert all(f'tierkv_rank_tier_bytes_out_total{{rank="{r}",tier="l2"}}' in m for r in (0, 1))
        # a rank that dies fails the engine for good: requests get 503 engine_failed and /health
        # 503, so that a supervisor restarts the server; it still stops cleanly
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(openai.InternalServerError) as failed:
            client.with_options(max_retries=0).completions.create(model="qwen2", prompt=prompt, max_tokens=8,
                                                                  extra_body={"ignore_eos": True})
        assert failed.value.status_code == 503 and "engine_failed" in str(failed.value.body)
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "failed"
    finally:
        assert server.stop() == 0
    assert all(_gone(pid, within=10) for pid in workers)


def test_a_script_without_the_main_guard_is_told_what_to_add(checkpoints, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import sys
        from tierkv import LLM
        LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(script), checkpoints["llama"]], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode != 0
    assert 'must guard its top level with `if __name__ == "__main__":`' in run.stderr
