"""gpt-oss (model_type gpt_oss) in the engine equals transformers' GptOssForCausalLM on the same weights.

A tiny random checkpoint of the real architecture (tests/models.py "gpt_oss": 4 layers alternating
an 8-token sliding window and full attention, attention sinks, q/k/v/o biases, 4 experts top-2 with
the biased router and clamped SwiGLU, YaRN RoPE): logits and greedy tokens against `generate` on
CPU in fp32, with prompts longer than the window, whole and chunked prefill. The hub's MXFP4
expert format (openai/gpt-oss-20b) is dequantised at load: the dequantiser is held to
transformers' own conversion, and an MXFP4 checkpoint loads to the model transformers runs on the
dequantised weights.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from models import paged_greedy, save_tiny_checkpoint
from test_model import (
    assert_bf16_as_close_as_transformers,
    assert_greedy_matches_transformers,
    assert_logits_close,
    random_prompts,
)

from tierkv.engine import mxfp4
from tierkv.engine.loader import load_model
from tierkv.engine.model_config import ModelConfig
from tierkv.engine.rope import rope_attention_factor, rope_inv_freq
from tierkv.engine.parallel import TensorParallel
from tierkv.errors import ConfigError, ModelLoadError

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))
    loaded = load_model(path, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, loaded, hf


def test_config_reads_the_gpt_oss_switches(tiny):
    _, loaded, _ = tiny
    cfg = loaded.config
    assert cfg.model_type == "gpt_oss" and cfg.attention_sinks
    assert cfg.layer_windows == [8, None, 8, None]
    assert cfg.qkv_bias and cfg.o_bias and cfg.head_dim == 32
    assert cfg.moe.num_experts == 4 and cfg.moe.num_experts_per_tok == 2 and cfg.moe.activation == "swigluoai"
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    layout = loaded.kv_layout()
    assert layout.windows == (8, None, 8, None) and layout.head_dim == 32


@torch.inference_mode()
def test_tiny_gpt_oss_matches_transformers(tiny):
    _, loaded, hf = tiny
    prompts = random_prompts(loaded.config.vocab_size)
    ours, _ = assert_greedy_matches_transformers(loaded, hf, prompts, NEW_TOKENS)
    # chunks of 7 over blocks of 4: chunk edges inside blocks and inside the 8-token window, and
    # decodes mixed with prefill chunks
    chunked, _ = paged_greedy(loaded.model, prompts, NEW_TOKENS, chunk=7, block_size=4)
    assert chunked == ours


@torch.inference_mode()
def test_every_position_matches_transformers(tiny):
    # every prompt position's logits: the sliding layers past their window, the sinks at each length
    _, loaded, hf = tiny
    prompt = random_prompts(loaded.config.vocab_size, lengths=(30,))[0]
    from tierkv.engine.attention import AttentionMetadata

    t, bs = len(prompt), 4
    model = loaded.model
    pool = torch.zeros(model.config.num_layers, 8, 2, bs, model.config.num_kv_heads, model.config.head_dim)
    table = torch.tensor([[7, 2, 5, 0, 1, 3, 6, 4]], dtype=torch.int32)
    pos = torch.arange(t)
    meta = AttentionMetadata(slot_mapping=table[0, pos // bs].long() * bs + pos % bs, block_tables=table,
                             seq_lens=torch.tensor([t], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32),
                             logits_indices=torch.arange(t), is_decode=False)
    assert_logits_close(model(torch.tensor(prompt), pos, pool, meta), hf(torch.tensor([prompt])).logits[0])


# openai/gpt-oss-20b's config.json as the hub has it (transformers 4 style: rope_scaling, rope_theta)
HUB_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
           "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
           "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
           "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
           "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
           "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
           "pad_token_id": 199999, "quantization_config": {"modules_to_not_convert": [
               "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
               "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088}


def test_hub_config_reads_as_transformers_reads_it():
    from transformers import GptOssConfig

    cfg = ModelConfig.from_hf(HUB_20B)
    assert cfg.layer_windows == [128, None] * 12 and cfg.attention_sinks
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps) == (64, 8, 64, 1e-5)
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling["factor"] == 32.0
    hf = GptOssConfig(**{k: v for k, v in HUB_20B.items() if k != "quantization_config"})
    torch.testing.assert_close(rope_inv_freq(cfg), transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](hf)[0],
                               rtol=0, atol=0)
    # keys left out take transformers' defaults: alternating layers (the first slides), YaRN x32, theta 150000
    minimal = {k: HUB_20B[k] for k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "num_hidden_layers", "vocab_size", "num_local_experts")}
    assert ModelConfig.from_hf(minimal) == ModelConfig.from_hf(GptOssConfig(**minimal).to_dict())
    assert ModelConfig.from_hf(minimal) == cfg


def test_a_rank_holds_its_heads_sinks(tiny):
    # 2 ranks running the model: tests/test_tensor_parallel_model.py ("gpt_oss")
    path, loaded, _ = tiny
    for rank in (0, 1):
        sinks = load_model(path, device="cpu", tp=TensorParallel(rank, 2)).model.model.layers[3].self_attn.sinks
        assert sinks.dtype == loaded.dtype
        assert torch.equal(sinks, loaded.model.model.layers[3].self_attn.sinks[2 * rank: 2 * rank + 2])


@torch.inference_mode()
def test_a_model_cast_to_bf16_holds_bf16_sinks(tiny):
    # as benchmarks build random models (nn.Module.to): the sinks follow the model dtype and the
    # kernels take them, as they take a bf16 checkpoint's
    path, _, _ = tiny
    cast = load_model(path, device="cpu").model.to(torch.bfloat16)
    cast.reset_rope()
    loaded = load_model(path, device="cpu", dtype="bfloat16")
    assert cast.model.layers[0].self_attn.sinks.dtype == loaded.model.model.layers[0].self_attn.sinks.dtype == \
        torch.bfloat16
    prompt = random_prompts(loaded.config.vocab_size, lengths=(12,))
    assert paged_greedy(cast, prompt, 3, block_size=4)[0] == paged_greedy(loaded.model, prompt, 3, block_size=4)[0]


def test_yarn_rope_matches_transformers(tiny):
    _, loaded, hf = tiny
    rotary = hf.model.rotary_emb
    torch.testing.assert_close(rope_inv_freq(loaded.config), rotary.inv_freq.float(), rtol=0, atol=0)
    assert rope_attention_factor(loaded.config) == rotary.attention_scaling != 1.0
    positions = torch.tensor([0, 1, 7, 100, 511])
    cos, sin = loaded.model.rope(positions, torch.float32)
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    half = cos.shape[-1] // 2  # gpt-oss's cos/sin are [D/2]; ours repeat them for rotate-half
    torch.testing.assert_close(cos[:, :half], ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin[:, half:], ref_sin[0], rtol=0, atol=0)


def test_yarn_truncate_and_defaults_match_transformers():
    # truncate (default true) rounds the ramp's ends outwards; a missing original context defaults
    # to max_position_embeddings, as transformers' standardize_rope_params does
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope in ({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "original_max_position_embeddings": 4096},
                 {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "attention_factor": 1.25}):
        hf_config = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=64, num_hidden_layers=2,
                                 max_position_embeddings=4096, rope_parameters=dict(rope))
        written = hf_config.to_dict()
        written["rope_parameters"] = dict(rope)  # as a hand-written config.json: no key filled in
        cfg = ModelConfig.from_hf(written)
        want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
        torch.testing.assert_close(rope_inv_freq(cfg), want, rtol=0, atol=0)
        assert rope_attention_factor(cfg) == pytest.approx(factor, rel=1e-12)


# ---- MXFP4 (the hub's gpt-oss expert format)


def _packed(g: torch.Generator, *shape: int, low: int = 0, high: int = 256):
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [mxfp4.CHUNK_BYTES, 16 * 7])  # one piece, and 7 groups a piece (not a divisor)
def test_mxfp4_dequantiser_matches_transformers(dtype, chunk, monkeypatch):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    monkeypatch.setattr(mxfp4, "CHUNK_BYTES", chunk)

    g = torch.Generator().manual_seed(0)
    # every nibble and every exponent but 255 (2^128: inf in fp32 and bf16, and 0 x inf = NaN)
    blocks, scales = _packed(g, 3, 17, 5, 16), torch.randperm(255, generator=g).to(torch.uint8).view(3, 17, 5)
    ours = mxfp4.dequantize(blocks, scales, dtype)                         # [E, rows, 5 * 32]
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)   # [E, 5 * 32, rows]
    assert ours.dtype == dtype and ours.shape == (3, 17, 160)
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_mxfp4_dequantiser_refuses_mismatched_shapes():
    with pytest.raises(ModelLoadError, match="scales"):
        mxfp4.dequantize(torch.zeros(2, 4, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8),
                         torch.float32)
    with pytest.raises(ModelLoadError, match="uint8"):
        mxfp4.dequantize(torch.zeros(2, 4, 3, 16), torch.zeros(2, 4, 3, dtype=torch.uint8), torch.float32)


def _to_mxfp4_checkpoint(src, dst, seed: int = 1):
    """dst: src with every layer's experts replaced by random MXFP4 blocks and scales, laid out as
    openai/gpt-oss-20b holds them; src's experts become those blocks dequantised by transformers
    (what a model loading dst must compute with). Returns the dequantised copy's path."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    packed, plain = {}, {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = plain[name] = t
            continue
        e, rows_in, rows_out = t.shape                          # transformers' [E, in, out]
        # exponents 2^-5 .. 2^-2: weights of the randomize_ scale, so the logits stay peaked
        blocks, scales = _packed(g, e, rows_out, rows_in // 32, 16), _packed(g, e, rows_out, rows_in // 32,
                                                                             low=122, high=126)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
    save_file(packed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    save_file(plain, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


@torch.inference_mode()
def test_mxfp4_checkpoint_loads_dequantised(tiny, tmp_path):
    src, _, _ = tiny
    plain = _to_mxfp4_checkpoint(shutil.copytree(src, tmp_path / "plain"), tmp_path / "mxfp4")
    loaded = load_model(tmp_path / "mxfp4", device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    prompts = random_prompts(loaded.config.vocab_size, lengths=(6, 19))
    assert_greedy_matches_transformers(loaded, hf, prompts, 6)


def test_mxfp4_checkpoint_missing_scales_is_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    src, _, _ = tiny
    _to_mxfp4_checkpoint(shutil.copytree(src, tmp_path / "plain"), tmp_path / "mxfp4")
    tensors = load_file(str(tmp_path / "mxfp4" / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.2.mlp.experts.down_proj_scales"):
        load_model(tmp_path / "mxfp4", device="cpu")


def test_other_quantisations_are_refused():
    hf = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2).to_dict()
    hf["quantization_config"] = {"quant_method": "fp8"}
    with pytest.raises(ConfigError, match="mxfp4"):
        ModelConfig.from_hf(hf)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_bf16_on_gpu_is_as_close_to_fp32_as_transformers_bf16(tmp_path):
    """The tiny gpt_oss is chaotic in bf16 (4 layers of std-0.3 weights): measured on CPU,
    transformers' own bf16 logits are off its fp32 ones by ~1.5 (of a ~7 range) and its 16-token
    greedy runs match fp32's for 0 of 64 prompts, so test_model's ">= 90% equal to transformers
    bf16" cannot hold for anyone (it measured 0 of 64 for ours on CPU too). As test_model holds
    SmolLM2: our bf16 (Triton kernels with sinks and windows, fused_moe) is held to transformers'
    bf16 against the fp32 model: a logit error at most 1.25x its, and 8-token greedy runs equal to
    fp32's for at least as many prompts as its, minus 3 of 64 (CPU: ours 1.47 / 9, its 1.49 / 8)."""
    assert_bf16_as_close_as_transformers("gpt_oss", tmp_path)


@pytest.mark.gpu
@needs_cuda
def test_mxfp4_dequantiser_on_gpu_equals_cpu():
    g = torch.Generator().manual_seed(3)
    blocks, scales = _packed(g, 4, 64, 8, 16), _packed(g, 4, 64, 8, low=100, high=140)
    want = mxfp4.dequantize(blocks, scales, torch.bfloat16)
    got = mxfp4.dequantize(blocks.cuda(), scales.cuda(), torch.bfloat16)
    assert torch.equal(got.cpu(), want)
