"""The qwen3_moe model type in the engine equals transformers' Qwen3MoeForCausalLM (CPU, fp32).

A tiny random-weight checkpoint (3 layers, the first dense through mlp_only_layers, 8 experts,
top-2) as transformers' save_pretrained writes it (one tensor per expert, as the hub's
Qwen3-30B-A3B holds them): logits and greedy tokens against transformers, chunked prefill, the
same checkpoint with its experts stored fused, clear errors for a checkpoint that lacks an expert,
and a tensor-parallel rank's share of the experts (test_tensor_parallel_model.py runs two ranks of
this checkpoint against the whole model).
On the GPU (the lead runs it): test_model.py's bf16 agreement criterion through the Triton fused_moe.
"""

from __future__ import annotations

import json

import pytest
import torch
from models import paged_greedy, save_tiny_checkpoint
from test_model import NEW_TOKENS, assert_greedy_matches_transformers, random_prompts
from test_model import test_bf16_tiny_models_on_gpu_agree_with_transformers as bf16_agreement

from tierkv.engine.loader import load_model
from tierkv.engine.moe import SparseMoE
from tierkv.engine.parallel import TensorParallel
from tierkv.errors import ModelLoadError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def tiny(checkpoint):
    loaded = load_model(checkpoint, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return loaded, hf


def test_the_checkpoint_holds_one_tensor_per_expert(checkpoint):
    names = safetensors_torch.load_file(checkpoint / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # layer 0 is dense (mlp_only_layers)


def test_layers_follow_mlp_only_layers(tiny):
    loaded, _ = tiny
    kinds = [type(layer.mlp).__name__ for layer in loaded.model.model.layers]
    assert kinds == ["MLP", "SparseMoE", "SparseMoE"]
    assert loaded.config.moe.num_experts == 8 and loaded.config.moe.norm_topk_prob


@torch.inference_mode()
def test_matches_transformers(tiny):
    loaded, hf = tiny
    prompts = random_prompts(loaded.config.vocab_size)
    assert_greedy_matches_transformers(loaded, hf, prompts)


@torch.inference_mode()
def test_chunked_prefill_gives_identical_tokens(tiny):
    loaded, _ = tiny
    prompts = random_prompts(loaded.config.vocab_size)
    whole, _ = paged_greedy(loaded.model, prompts, NEW_TOKENS, block_size=4)
    chunked, _ = paged_greedy(loaded.model, prompts, NEW_TOKENS, chunk=7, block_size=4)
    assert chunked == whole


def _rewrite(src, dst, change) -> None:
    """A copy of checkpoint directory src at dst with its tensors passed through change(dict)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = safetensors_torch.load_file(src / "model.safetensors")
    safetensors_torch.save_file(change(tensors), dst / "model.safetensors", metadata={"format": "pt"})


def _fuse_experts(tensors: dict) -> dict:
    """Per-expert tensors -> transformers' in-memory fused form (experts.gate_up_proj [E, 2I, H])."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}{e}.gate_proj.weight"],
                                                          tensors[f"{p}{e}.up_proj.weight"]]) for e in range(8)])
        out[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(8)])
    return out


@torch.inference_mode()
def test_fused_expert_tensors_load_alike(tiny, checkpoint, tmp_path):
    loaded, _ = tiny
    _rewrite(checkpoint, tmp_path / "fused", _fuse_experts)
    fused = load_model(tmp_path / "fused", device="cpu")
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(fused.model.state_dict()[name], tensor), name


def test_a_missing_expert_is_named(checkpoint, tmp_path):
    _rewrite(checkpoint, tmp_path / "holed",
             lambda t: {k: v for k, v in t.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.experts lacks .*experts\.5\.up_proj\.weight"):
        load_model(tmp_path / "holed", device="cpu")


def test_tensor_parallel_size_must_split_the_experts(checkpoint, tmp_path):
    (tmp_path / "m").mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    config["moe_intermediate_size"] = 50  # 4 attention heads and intermediate 128 split in 4; 50 does not
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="does not divide the moe_intermediate_size 50"):
        load_model(tmp_path / "m", device="cpu", tp=TensorParallel(0, 4))


def test_a_rank_holds_its_slice_of_every_expert(checkpoint):
    # each expert's 48 intermediate features: 24 on rank 1 (the 2-rank run: test_tensor_parallel_model.py)
    shard = load_model(checkpoint, device="cpu", tp=TensorParallel(1, 2)).model
    block = shard.model.layers[1].mlp
    assert isinstance(block, SparseMoE)
    assert block.experts.gate_up_proj.shape == (8, 2 * 24, 64) and block.experts.down_proj.shape == (8, 64, 24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_bf16_tiny_qwen3_moe_on_gpu_agrees_with_transformers(tmp_path):
    """test_model.py's bf16 criterion (>= 90% of 64 prompts give transformers' 32 greedy tokens),
    through the Triton fused_moe's grouped path (64 sequences a step; the per-pair path, for a
    few tokens, is held to the reference by test_kernels_moe_gpu.py)."""
    bf16_agreement("qwen3_moe", tmp_path)
