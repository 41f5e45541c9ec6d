"""Convert a llama-architecture GGUF (llama.cpp's file) into a Hugging Face model directory.

Used once per cache dir for the bundled SmolLM2 (loader.bundled_model_dir); the result is a plain
directory the loader reads like any other. Dequantizes every tensor to fp32, undoes llama.cpp's
rotary row order, writes config.json from the file's metadata and the tokenizer through
transformers. This file never loads a model and never reads anything but the GGUF it is given.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tierkv.errors import ModelLoadError

# GGUF tensor names (llama.cpp) -> Hugging Face names; "blk.N." maps to "model.layers.N.".
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. w: [n_head * D, hidden]. llama.cpp interleaves the two
    rotary halves of each head (rows 0, D/2, 1, D/2+1, ...); HF rotates split halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a llama-architecture GGUF into a HF directory (fp32 safetensors, config.json,
    generation_config.json, tokenizer files). Only the tokenizer goes through transformers."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(gguf_path))

    def meta(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{gguf_path.name}: GGUF architecture {arch!r} cannot be converted; only llama")
    heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # dequantize gives numpy [out, in] (GGUF lists dims innermost first)
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
        stem, suffix = t.name.rsplit(".", 1)
        if stem.startswith("blk."):
            _, layer, kind = stem.split(".", 2)
            if kind == "attn_q":
                w = _unpermute(w, heads)
            elif kind == "attn_k":
                w = _unpermute(w, kv_heads)
            name = f"model.layers.{layer}.{_GGUF_BLOCK[kind]}.{suffix}"
        else:
            name = f"{_GGUF_TOP[stem]}.{suffix}"
        tensors[name] = w.contiguous()
    hidden = meta("llama.embedding_length")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": meta("llama.feed_forward_length"),
        "num_hidden_layers": meta("llama.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": meta("llama.rope.dimension_count", hidden // heads),
        "rms_norm_eps": float(meta("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta("llama.context_length"),
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        # no separate output matrix in the file: the LM head is the embedding
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": False, "mlp_bias": False,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"), "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # transformers versions disagree on which GGUF ids become bos/eos; the file's metadata decides
    for role in ("bos", "eos"):
        token_id = config[f"{role}_token_id"]
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))
    tokenizer.save_pretrained(str(out_dir))
