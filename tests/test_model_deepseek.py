"""DeepSeek-V3 (model_type deepseek_v3: multi-head latent attention + MoE) in the engine equals
transformers' DeepseekV3ForCausalLM on the same weights (CPU, fp32).

Tiny checkpoints of the real architecture, DeepSeek-V2-Lite's structure scaled down (tests/models.py
"deepseek_v3": kv_lora_rank 32, rope 8, nope 16, v 16, 4 heads, YaRN with mscale != mscale_all_dim;
3 layers, the first dense, then 8 routed experts top-2 in 2 groups of which 1 is chosen, 1 shared
expert, a random e_score_correction_bias): one without q LoRA (V2-Lite), one with it (V3) that also
carries a multi-token-prediction layer as real V3 checkpoints do, and covers rope_interleave false
and attention_bias true (biases on q_a_proj, kv_a_proj_with_mqa and o_proj). Logits and greedy tokens against
`generate`, prefill in one go and in chunks (chunked steps mix prefill and decode; decode steps take
the absorbed kernel, prefill the up-projected one). The pool holds exactly transformers' cached
latent, one head of half the latent, c_kv in the K plane and the rest in the V plane.
"""

from __future__ import annotations

import logging

import pytest
import torch
from models import paged_greedy, randomize_, tiny_config
from test_model import assert_bf16_as_close_as_transformers, assert_greedy_matches_transformers, random_prompts

from tierkv.engine.attention import AttentionMetadata
from tierkv.engine.loader import load_model
from tierkv.engine.model_config import ModelConfig
from tierkv.errors import ConfigError

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
LENGTHS = (5, 23, 40)


def save_deepseek(path, seed: int, **overrides):
    """A tiny deepseek_v3 checkpoint (tests/models.py's config with `overrides`), random weights and
    a random router correction bias (a buffer, which randomize_ leaves at zero)."""
    config = tiny_config("deepseek_v3")
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    return path


def add_mtp_layer(path, num_layers: int) -> None:
    """Append a multi-token-prediction layer (numbered num_layers, as in DeepSeek-V3's checkpoint:
    its own projections, norms and a whole decoder layer) to the checkpoint's safetensors."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    last = f"model.layers.{num_layers - 1}."
    mtp = {f"model.layers.{num_layers}." + k[len(last):]: v.clone() for k, v in tensors.items() if k.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    mtp.update({f"model.layers.{num_layers}.eh_proj.weight": torch.randn(hidden, 2 * hidden),
                f"model.layers.{num_layers}.enorm.weight": torch.ones(hidden),
                f"model.layers.{num_layers}.shared_head.norm.weight": torch.ones(hidden)})
    save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["v2_lite", "q_lora_mtp"])
def deepseek(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "v2_lite":
        save_deepseek(path, seed=0)
    else:
        save_deepseek(path, seed=1, q_lora_rank=24, rope_interleave=False, attention_bias=True)
        add_mtp_layer(path, 3)
    loaded = load_model(path, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, loaded, hf


@torch.inference_mode()
def test_greedy_tokens_and_logits_match_transformers(deepseek):
    kind, _, loaded, hf = deepseek
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    prompts = random_prompts(loaded.config.vocab_size, LENGTHS)
    ours, _ = assert_greedy_matches_transformers(loaded, hf, prompts, NEW_TOKENS, label=kind)
    # chunks of 7: chunk edges inside blocks, short prompts decode while long ones still prefill
    chunked, _ = paged_greedy(loaded.model, prompts, NEW_TOKENS, chunk=7, block_size=4)
    assert chunked == ours


@torch.inference_mode()
def test_pool_holds_transformers_latent_split_over_the_planes(deepseek):
    _, _, loaded, hf = deepseek
    layout = loaded.kv_layout(block_size=4)
    assert (layout.num_kv_heads, layout.head_dim) == (1, (32 + 8) // 2)  # one latent: 20 + 20 values
    prompt = random_prompts(loaded.config.vocab_size, (11,))[0]
    cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    pool = torch.zeros(3, 4, 2, 4, 1, 20)  # [layers, blocks, 2, block_size, 1, D]
    blocks = torch.tensor([[2, 0, 3]], dtype=torch.int32)  # out of order
    slots = torch.tensor([int(blocks[0, i // 4]) * 4 + i % 4 for i in range(11)])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=blocks, seq_lens=torch.tensor([11], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, 11], dtype=torch.int32),
                             logits_indices=torch.tensor([10]))
    loaded.model(torch.tensor(prompt), torch.arange(11), pool, meta)
    for layer in range(3):
        pages = pool[layer, blocks[0].long()]                                 # [3, 2, 4, 1, 20]
        ours = torch.cat([pages[:, 0], pages[:, 1]], dim=-1).reshape(12, 40)[:11]
        theirs = torch.cat([cache.layers[layer].keys, cache.layers[layer].values], dim=-1)[0, 0]  # [11, 32 + 8]
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_multi_token_prediction_layer_is_skipped_with_a_log_line(tmp_path, caplog):
    save_deepseek(tmp_path, seed=2)
    add_mtp_layer(tmp_path, 3)
    with caplog.at_level(logging.INFO, logger="tierkv.engine.loader"):
        loaded = load_model(tmp_path, device="cpu")
    assert len(loaded.model.model.layers) == 3
    assert any("multi-token-prediction" in r.getMessage() and "layers 3 and up" in r.getMessage()
               for r in caplog.records)


def test_an_odd_latent_is_refused_clearly():
    hf = tiny_config("deepseek_v3").to_dict()
    hf["kv_lora_rank"] = 31
    with pytest.raises(ConfigError, match="kv_lora_rank 31 \\+ qk_rope_head_dim 8 must be even"):
        ModelConfig.from_hf(hf)


def test_fp8_hub_weights_are_refused_clearly():
    hf = tiny_config("deepseek_v3").to_dict()
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match="quantised with 'fp8' are not supported.*bf16 copy"):
        ModelConfig.from_hf(hf)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_bf16_on_gpu_is_as_close_to_fp32_as_transformers_bf16(tmp_path):
    """The Triton MLA decode kernel, the prefill kernel over up-projected heads and fused_moe, held to
    transformers' own bf16 error (test_model.assert_bf16_as_close_as_transformers): the tiny MLA + MoE
    model is chaotic in bf16 (on the H200, 16 of 64 prompts gave transformers bf16's 32 greedy tokens,
    their first tokens equal and later ones flipped by routing), so the 90% criterion holds for nobody."""
    assert_bf16_as_close_as_transformers("deepseek_v3", tmp_path)
