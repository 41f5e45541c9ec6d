"""Gemma 3 in the engine equals transformers' Gemma3ForCausalLM on the same weights (CPU, fp32).

A tiny `gemma3_text` checkpoint of the real architecture (6 layers: five sliding-window layers
of 8 tokens to one global layer, each kind with its own RoPE, linear scaling on the global one;
sandwich norms with (1 + w) weights, q/k norm, query_pre_attn_scalar != head_dim, GELU-tanh
GeGLU, the embedding scaled by sqrt(hidden)) is compared logit by logit and greedy token by
token against `generate`, with prompts longer than the window, in one prefill and in chunks.
A `gemma3` (Gemma3ForConditionalGeneration) checkpoint loads its text model only. (Two
tensor-parallel ranks: tests/test_tensor_parallel_model.py's "gemma3" kind.)
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from models import (
    every_position_logits,
    paged_greedy,
    randomize_,
    save_tiny_checkpoint,
    save_word_tokenizer,
    tiny_config,
)
from test_model import assert_greedy_matches_transformers, assert_logits_close, hf_greedy, needs_cuda, random_prompts
from test_model import test_bf16_tiny_models_on_gpu_agree_with_transformers as bf16_agreement

from tierkv import LLM, SamplingParams
from tierkv.engine.loader import load_model
from tierkv.engine.model_config import ModelConfig
from tierkv.engine.rope import rope_inv_freq
from tierkv.errors import ConfigError

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
LENGTHS = (5, 23, 40)  # the window is 8: the longer prompts slide past it many times


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = save_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"))
    loaded = load_model(path, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return loaded, hf


def test_config_is_read_as_transformers_reads_it(gemma3):
    loaded, hf = gemma3
    cfg = loaded.config
    assert cfg.model_type == "gemma3_text" and type(hf).__name__ == "Gemma3ForCausalLM"
    assert cfg.layer_windows == [8, 8, 8, 8, 8, None]
    assert loaded.model.model.layers[0].self_attn.scale == 24**-0.5


@torch.inference_mode()
def test_greedy_tokens_and_logits_match_transformers(gemma3):
    loaded, hf = gemma3
    prompts = random_prompts(loaded.config.vocab_size, LENGTHS)
    # block size 4: a window of 8 covers two or three blocks
    ours, _ = assert_greedy_matches_transformers(loaded, hf, prompts, NEW_TOKENS)
    # chunks of 7 over a window of 8: a chunk's queries see keys of the chunk before
    chunked, _ = paged_greedy(loaded.model, prompts, NEW_TOKENS, chunk=7, block_size=4)
    assert chunked == ours


@torch.inference_mode()
def test_every_position_matches_transformers(gemma3):
    """All 30 positions of one prompt: the window's edge, both RoPE tables and every layer type."""
    loaded, hf = gemma3
    prompt = random_prompts(loaded.config.vocab_size, (30,))[0]
    assert_logits_close(every_position_logits(loaded.model, prompt), hf(torch.tensor([prompt])).logits[0])


def test_each_layer_type_has_its_rope(gemma3):
    loaded, hf = gemma3
    rotary = hf.model.rotary_emb
    exact = dict(rtol=0, atol=0)
    torch.testing.assert_close(rope_inv_freq(loaded.config), rotary.full_attention_inv_freq.float(), **exact)
    torch.testing.assert_close(rope_inv_freq(loaded.config, sliding=True), rotary.sliding_attention_inv_freq.float(),
                               **exact)


# google/gemma-3-4b-it's text_config as the hub holds it (transformers 4.50): everything it omits
# is Gemma3TextConfig's default, and RoPE is in the old keys.
HUB_4B_TEXT = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
               "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}


def test_hub_style_gemma3_config_reads_like_transformers():
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
          "text_config": dict(HUB_4B_TEXT), "vision_config": {"model_type": "siglip_vision_model"}}
    cfg = ModelConfig.from_hf(hf)
    ref = transformers.Gemma3Config(**hf).text_config
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        "gemma3", ref.vocab_size, 2560, 10240, 34)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (ref.num_attention_heads, ref.num_key_value_heads,
                                                               ref.head_dim) == (8, 4, 256)
    assert cfg.query_pre_attn_scalar == ref.query_pre_attn_scalar and cfg.tie_word_embeddings
    assert cfg.layer_windows == [1024 if t == "sliding_attention" else None for t in ref.layer_types]
    assert cfg.layer_windows.count(None) == 5  # layers 5, 11, 17, 23, 29 are global
    full, local = ref.rope_parameters["full_attention"], ref.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == (
        full["rope_theta"], "linear", 8.0)
    assert cfg.sliding_rope == (local["rope_theta"], None)
    # the older gemma3_text keys (rope_local_base_freq, sliding_window_pattern) as gemma-3-1b-it has them
    text = dict(HUB_4B_TEXT, rope_scaling=None, rope_theta=500000.0, rope_local_base_freq=5000.0,
                sliding_window_pattern=3, num_hidden_layers=6)
    cfg = ModelConfig.from_hf(text)
    ref = transformers.Gemma3TextConfig(**text)
    assert cfg.layer_windows == [1024 if t == "sliding_attention" else None for t in ref.layer_types]
    assert cfg.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"] == 500000.0
    assert cfg.rope_scaling is None and cfg.sliding_rope == (5000.0, None)


@pytest.mark.parametrize("change, words", [
    ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping", "50.0"]),
    ({"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
    ({"hidden_activation": "relu"}, ["relu", "gelu_pytorch_tanh"]),
])
def test_unsupported_gemma3_settings_are_refused(change, words):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf({**HUB_4B_TEXT, **change})
    for word in words:
        assert word in str(err.value)


@torch.inference_mode()
def test_final_logit_softcapping_matches_transformers(tmp_path):
    # a cap well below the tiny model's logits (tens), so capping changes every one of them
    path = save_tiny_checkpoint("gemma3", tmp_path / "capped", seed=5, num_hidden_layers=2,
                                layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=4.0)
    loaded = load_model(path, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(loaded.config.vocab_size, (23,))
    _, logits = assert_greedy_matches_transformers(loaded, hf, prompts, NEW_TOKENS)
    assert all(float(row.abs().max()) < 4.0 for row in logits)


def save_tiny_multimodal(path, seed: int = 1):
    """A tiny Gemma3ForConditionalGeneration (a one-layer SigLIP tower) with our tiny text model."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=tiny_config("gemma3").to_dict(), vision_config=vision,
                                       mm_tokens_per_image=4)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    return model


def save_tiny_tokenizer(path, eos_ids: list[int]) -> None:
    """A Gemma tokenizer of a few characters and a Gemma-style chat template, and a generation
    config naming several eos ids (as the hub's Gemma 3 models do: <eos> and <end_of_turn>)."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *"abcdefghijklmnopqrstuvwxyz▁",
                                          "<start_of_turn>", "<end_of_turn>"])}
    tok = transformers.GemmaTokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                         "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": eos_ids}))


@torch.inference_mode()
def test_multimodal_checkpoint_loads_its_text_model(tmp_path, caplog):
    path = tmp_path / "gemma3-mm"
    hf = save_tiny_multimodal(path)
    save_tiny_tokenizer(path, [1, 32])
    with caplog.at_level(logging.INFO, logger="tierkv.engine.loader"):
        loaded = load_model(path, device="cpu")
    assert loaded.config.model_type == "gemma3" and loaded.config.layer_windows == [8, 8, 8, 8, 8, None]
    skipped = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(skipped) == 1 and "skipped" in skipped[0], skipped
    prompts = random_prompts(loaded.config.vocab_size, (23,))
    ours, prompt_logits = paged_greedy(loaded.model, prompts, NEW_TOKENS, block_size=4)
    for prompt, tokens, logits in zip(prompts, ours, prompt_logits):
        assert_logits_close(logits, hf(input_ids=torch.tensor([prompt])).logits[0, -1])
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)
    # the tokenizer and chat template of a gemma3 directory; every eos id of generation_config stops
    tok = loaded.tokenizer
    assert tok.eos_token_ids == [1, 32]
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<bos><start_of_turn>user\nhi<end_of_turn>\n" \
                                                                   "<start_of_turn>model\n"


def test_every_eos_id_of_generation_config_stops(gemma3, tmp_path):
    """Gemma 3 ships generation_config eos_token_id [1, 106] (<eos>, <end_of_turn>): through the
    engine, a request ends at whichever of them it samples first."""
    loaded, _ = gemma3
    path = tmp_path / "gemma3"
    shutil.copytree(loaded.model_dir, path)
    save_word_tokenizer(path, loaded.config.vocab_size)
    prompts = random_prompts(loaded.config.vocab_size, (12, 30))
    free, _ = paged_greedy(loaded.model, prompts, NEW_TOKENS)  # what each would say without stopping

    def stop_token(mine: list[int], other: list[int]) -> int:  # one that ends `mine` early and not `other`
        return next(t for i, t in enumerate(mine) if i >= 2 and t not in mine[:i] and t not in other)

    eos = [stop_token(free[0], free[1]), stop_token(free[1], free[0])]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    llm = LLM(str(path), device="cpu", block_size=4, l1=1 << 20)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    finally:
        llm.close()
    for out, tokens, stop in zip(outs, free, eos):
        assert out.outputs[0].token_ids == tokens[: tokens.index(stop) + 1]
        assert out.outputs[0].finish_reason == "stop"


@pytest.mark.gpu
@needs_cuda
def test_bf16_on_gpu_agrees_with_transformers(tmp_path):
    """test_model.py's bf16 criterion (>= 90% of 64 prompts give transformers' 32 greedy tokens)."""
    bf16_agreement("gemma3", tmp_path)
