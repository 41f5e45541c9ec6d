"""Tensor-parallel shards give the whole model's logits and greedy tokens (CPU, fp32, gloo).

Real ranks in spawned processes load their shard of tiny Llama, Qwen2 (tied embeddings, qkv bias),
Qwen3 (q/k norm, head_dim != hidden / heads), Llama 3 (o/MLP bias, added after the all-reduce),
Gemma 3 (sandwich norms, scaled embedding, sliding and global layers with their own RoPE),
DeepSeek-V3 (latent attention: q heads and kv_b_proj rows split, the latent and its one-head pool
replicated; each expert's features split), gpt-oss (each rank its q heads' attention sinks; expert
biases) and Qwen3-MoE (a dense layer, then experts split) checkpoints and of one whose vocab (509)
no size divides; 2 ranks split the 2 KV heads, 4 ranks replicate each on two. A failing rank fails
the test with its traceback, and the other ranks (which would wait on it in a collective) are
terminated.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from models import paged_greedy, save_tiny_checkpoint

from tierkv.engine.loader import ModelLoadError, load_model
from tierkv.engine.model import CausalLM
from tierkv.engine.model_config import ModelConfig
from tierkv.engine.parallel import TensorParallel, init_process_group
from tierkv.errors import ConfigError

if importlib.util.find_spec("transformers") is None:  # not imported: every spawned rank imports this file
    pytest.skip("the tiny checkpoints are built with transformers", allow_module_level=True)

KINDS = ["llama", "qwen2", "qwen3", "llama3", "gemma3", "deepseek_v3", "gpt_oss", "qwen3_moe", "odd-vocab"]
ODD_VOCAB = 509  # prime: padded to 510 rows on 2 ranks, 512 on 4
NEW_TOKENS = 6
BLOCK_SIZE = 4
TIMEOUT_S = 120  # for all ranks of one run; a run takes seconds


def prompts_for(vocab: int) -> list[list[int]]:
    """Two random prompts and one of the ids on both sides of the vocab shards' edges."""
    g = torch.Generator().manual_seed(7)
    edges = [0, 127, 128, 254, 255, 256, 383, 384, vocab - 1]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 13)] + [edges]


def run_model(lm) -> dict:
    tokens, logits = paged_greedy(lm.model, prompts_for(lm.config.vocab_size), NEW_TOKENS, block_size=BLOCK_SIZE)
    return {"tokens": tokens, "logits": torch.stack(logits),  # [prompts, vocab]
            "heads": (lm.model.num_local_heads, lm.model.num_local_kv_heads, lm.kv_layout().num_kv_heads),
            "dense": all(p.is_contiguous() for p in lm.model.parameters())}


def _rank_main(rank: int, size: int, init_file: str, paths: dict[str, str], out_dir: str) -> None:
    """One rank: load each checkpoint's shard, run it, save the results (or the traceback)."""
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)  # size ranks share the test machine's few cores
        tp = init_process_group(rank, size, init_file, torch.device("cpu"))
        results = {}
        with torch.inference_mode():
            for kind, path in paths.items():
                results[kind] = run_model(load_model(path, device="cpu", dtype="float32", tp=tp))
        torch.save(results, out / f"rank{rank}.pt")
        dist.barrier()  # every rank's last collective is done before any of them goes
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    # Exit without tearing the process group down: a gloo rank destroyed while its peers exit
    # can abort in a C++ destructor (seen once in 4 ranks on the loaded 2-core CI box), which
    # would fail a run whose results are all saved. The process's exit closes the sockets.
    os._exit(0)


def run_ranks(size: int, paths: dict[str, str], out: Path) -> list[dict]:
    """Each rank's results; fails the test with the tracebacks of failed ranks, or on a timeout."""
    out.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, size, str(out / "init"), paths, str(out)), daemon=True)
             for rank in range(size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        running = list(procs)
        while running and time.monotonic() < deadline:
            wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
            running = [p for p in procs if p.exitcode is None]
            if any(p.exitcode for p in procs if p.exitcode is not None):
                break  # a rank failed: the others would wait for it in their next collective
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
    errors = [f.read_text() for f in sorted(out.glob("rank*.err"))]
    if errors:
        pytest.fail("a rank failed:\n" + "\n".join(errors), pytrace=False)
    codes = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode != 0}
    if codes:
        pytest.fail(f"ranks exited with codes {codes} (negative: killed, after {TIMEOUT_S} s or a peer's failure)")
    return [torch.load(out / f"rank{rank}.pt") for rank in range(size)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-models")
    paths = {kind: save_tiny_checkpoint(kind, root / kind) for kind in KINDS if kind != "odd-vocab"}
    paths["odd-vocab"] = save_tiny_checkpoint("llama", root / "odd-vocab", seed=3, vocab_size=ODD_VOCAB)
    return {kind: str(path) for kind, path in paths.items()}


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict[str, dict]:
    """The whole model's results (size 1), in this process."""
    with torch.inference_mode():
        return {kind: run_model(load_model(path, device="cpu", dtype="float32")) for kind, path in checkpoints.items()}


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory) -> list[dict]:
    return run_ranks(2, checkpoints, tmp_path_factory.mktemp("tp2") / "run")


@pytest.fixture(scope="module")
def four_ranks(checkpoints, tmp_path_factory) -> list[dict]:
    paths = {kind: checkpoints[kind] for kind in ("qwen3", "odd-vocab")}
    return run_ranks(4, paths, tmp_path_factory.mktemp("tp4") / "run")


def assert_same_as_whole(ranks: list[dict], reference: dict[str, dict], kind: str) -> None:
    ref = reference[kind]
    for rank, results in enumerate(ranks):
        got = results[kind]
        # fp32 on both sides; only the order of the sums differs (the all-reduce adds partials)
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5 * float(ref["logits"].abs().max()),
                                   msg=lambda m, rank=rank: f"rank {rank}: {m}")
        assert got["tokens"] == ref["tokens"], f"rank {rank}"
        assert got["dense"], f"rank {rank}: a weight slice was left strided"


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_match_the_whole_model(two_ranks, reference, kind):
    assert_same_as_whole(two_ranks, reference, kind)
    # 4 q heads and 2 KV heads split in two; the KV layout sizes the pool by the local heads
    assert all(r[kind]["heads"] == (2, 1, 1) for r in two_ranks)


@pytest.mark.parametrize("kind", ["qwen3", "odd-vocab"])
def test_four_ranks_replicate_kv_heads(four_ranks, reference, kind):
    assert_same_as_whole(four_ranks, reference, kind)
    assert all(r[kind]["heads"] == (1, 1, 1) for r in four_ranks)  # each of the 2 KV heads on 2 ranks


@pytest.mark.parametrize("size", [3, 8])
def test_bad_size_is_refused_before_reading_weights(checkpoints, tmp_path, size):
    # only config.json: the size must be refused before the loader looks for weights
    (tmp_path / "m").mkdir()
    shutil.copy(Path(checkpoints["llama"]) / "config.json", tmp_path / "m")
    with pytest.raises(ModelLoadError, match=rf"tensor_parallel_size {size} .*4 attention heads; use one of \[1, 2, 4\]"):
        load_model(tmp_path / "m", device="cpu", tp=TensorParallel(0, size))


def tiny_config(**overrides) -> ModelConfig:
    fields = {"model_type": "llama", "vocab_size": 100, "hidden_size": 48, "intermediate_size": 96, "num_layers": 1,
              "num_heads": 6, "num_kv_heads": 2, "head_dim": 8}
    return ModelConfig(**{**fields, **overrides})


def test_shard_shapes():
    with torch.device("meta"):
        whole = CausalLM(tiny_config())
        one = CausalLM(tiny_config(), TensorParallel())
        shard = CausalLM(tiny_config(), TensorParallel(1, 2))
    assert {k: v.shape for k, v in one.state_dict().items()} == {k: v.shape for k, v in whole.state_dict().items()}
    assert (whole.num_local_heads, whole.num_local_kv_heads) == (6, 2)
    assert (shard.num_local_heads, shard.num_local_kv_heads) == (3, 1)
    layer = shard.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == ((3 + 2 * 1) * 8, 48)  # its q, k, v rows
    assert layer.self_attn.o_proj.weight.shape == (48, 3 * 8)  # its input columns
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 48, 48) and layer.mlp.down_proj.weight.shape == (48, 48)
    assert shard.model.embed_tokens.weight.shape == shard.lm_head.weight.shape == (50, 48)
    assert shard.config.num_heads == 6  # the config stays the whole model's


def test_model_refuses_sizes_it_cannot_split():
    with torch.device("meta"):
        with pytest.raises(ConfigError, match="cannot split the model's 4 KV heads"):
            CausalLM(tiny_config(num_kv_heads=4), TensorParallel(0, 3))
        with pytest.raises(ConfigError, match="intermediate size 100"):
            CausalLM(tiny_config(num_kv_heads=6, intermediate_size=100), TensorParallel(0, 3))
