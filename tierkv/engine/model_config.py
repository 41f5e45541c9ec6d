"""ModelConfig: the numbers and switches that define a decoder, read from a Hugging Face config.json.

Every family's config.json becomes one ModelConfig here: the supported model types, each family's
defaults and refusals (Gemma 3's text config, gpt-oss's), RoPE parameters per layer type, sliding
windows per layer, and the MoE and MLA specs (moe.py, mla.py parse their own parts). This file
builds no module and reads no weight: model.py builds the decoder from what it decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.errors import ConfigError

from .mla import MLASpec
from .moe import ROUTER_OF, MoESpec, moe_layers

# config.json "model_type" values this decoder implements.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "deepseek_v3", "qwen3_moe",
                         "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(slots=True)
class ModelConfig:
    """The handful of numbers that define a decoder, normalised from a HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", "factor": .., ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layer_windows: list[int | None] = field(default_factory=list)  # sliding window per layer
    attention_sinks: bool = False  # gpt-oss: a learned logit per q head joins each softmax (`sinks`)
    # (theta, scaling) of the sliding-window layers where they differ from rope_theta/rope_scaling
    # (Gemma 3's local layers: base 10000, unscaled)
    sliding_rope: tuple[float, dict | None] | None = None
    # Gemma 3's switches; the defaults are the Llama family's
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    norm_unit_offset: bool = False  # RMSNorms scale by (1 + weight), in fp32 before the cast back
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, before the residual add
    embed_scale: float | None = None  # the embedding is multiplied by it (in the model dtype)
    query_pre_attn_scalar: float | None = None  # attention scale = its ** -0.5 (else head_dim ** -0.5)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # mixture of experts (moe.py): the sparse block's spec, and which layers hold it (the others a dense MLP)
    moe: MoESpec | None = None
    moe_layers: list[bool] = field(default_factory=list)
    # DeepSeek's multi-head latent attention (mla.py); its latent is cached as num_kv_heads = 1 of
    # head_dim = half the latent
    mla: MLASpec | None = None

    @property
    def rope_dim(self) -> int:
        """Features RoPE rotates in each head: head_dim, or MLA's qk_rope_head_dim."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a parsed config.json; raises ConfigError naming what is supported."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = hf.get("architectures") or []
            raise ConfigError(
                f"model_type {model_type!r} (architectures {archs}) is not supported by the tierkv "
                f"engine; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, SmolLM2, Gemma 3)"
            )
        gemma = model_type in ("gemma3_text", "gemma3")
        if gemma:
            hf = _gemma3_text_config(hf)
        if model_type == "gpt_oss":
            hf = _gpt_oss_config(hf)
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        # transformers >= 5 writes "rope_parameters" (theta + scaling in one dict); older
        # checkpoints write "rope_theta" and an optional "rope_scaling".
        rope = dict(hf.get("rope_parameters") or {})
        if not rope:
            rope = dict(hf.get("rope_scaling") or {})
            rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        sliding_rope = None
        if "full_attention" in rope:  # one RoPE per layer type (Gemma 3)
            sliding_rope = _rope(rope["sliding_attention"], 10000.0)
            rope = rope["full_attention"]
        theta, scaling = _rope(rope, hf.get("rope_theta", 10000.0))
        is_qwen = model_type in ("qwen2", "qwen3", "qwen3_moe")
        mla = MLASpec.from_hf(hf) if model_type == "deepseek_v3" else None
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=1 if mla else hf.get("num_key_value_heads") or heads,
            head_dim=mla.pool_head_dim if mla else hf.get("head_dim") or hidden // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never o bias; Llama/Qwen3/Gemma "attention_bias" covers
            # all four projections; Mistral has none.
            qkv_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            o_bias=(model_type in ("llama", "qwen3", "qwen3_moe", "gpt_oss") or gemma)
            and bool(hf.get("attention_bias", False)),
            mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe") or gemma,
            layer_windows=_layer_windows(hf, num_layers, is_qwen),
            attention_sinks=model_type == "gpt_oss",
            sliding_rope=None if sliding_rope == (theta, scaling) else sliding_rope,
            hidden_act=hf["hidden_activation"] if gemma else "silu",
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            embed_scale=hidden**0.5 if gemma else None,
            query_pre_attn_scalar=hf["query_pre_attn_scalar"] if gemma else None,
            final_logit_softcapping=hf.get("final_logit_softcapping") if gemma else None,
            moe=MoESpec.from_hf(hf) if model_type in ROUTER_OF else None,
            moe_layers=moe_layers(hf, num_layers),
            mla=mla,
        )


def _rope(rope: dict, default_theta: float) -> tuple[float, dict | None]:
    """(theta, scaling or None) of one RoPE dict in transformers 5's `rope_parameters` form."""
    rope = dict(rope)
    theta = float(rope.pop("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"RoPE scaling type {rope_type!r} is not supported; use a checkpoint with one of "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported by the tierkv engine")
    rope["rope_type"] = rope_type
    return theta, None if rope_type == "default" else rope


# What transformers' Gemma3TextConfig assumes for a key config.json leaves out: the hub's
# google/gemma-3-4b-it names only 6 of them and relies on these for its heads and head_dim.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
}


def _gemma3_text_config(hf: dict) -> dict:
    """A gemma3_text or gemma3 config.json as a complete text config: a gemma3
    (Gemma3ForConditionalGeneration) one's `text_config`, transformers' defaults filled in, the
    layer types from `sliding_window_pattern` when not listed (every n-th layer global), and
    RoPE per layer type (older checkpoints write rope_theta, rope_scaling for the global layers
    and rope_local_base_freq for the local ones). Refuses what the engine does not implement."""
    model_type = hf["model_type"]
    text = {**_GEMMA3_TEXT_DEFAULTS, **((hf.get("text_config") or {}) if model_type == "gemma3" else hf)}
    text["model_type"] = model_type
    if text.get("attn_logit_softcapping") is not None:
        raise ConfigError(
            f"attn_logit_softcapping={text['attn_logit_softcapping']} (Gemma 2-style attention softcapping) is not "
            "supported by the tierkv engine; Gemma 3 checkpoints leave it null"
        )
    if text.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true (an embedding model) is not supported: the tierkv "
                          "engine generates text with causal attention")
    if text["hidden_activation"] != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation {text['hidden_activation']!r} is not supported for Gemma 3; "
                          "the tierkv engine implements gelu_pytorch_tanh")
    if text.get("layer_types") is None:
        every = int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or 6)
        text["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                               for i in range(text["num_hidden_layers"])]
    rope = text.get("rope_parameters") or {}
    if "full_attention" not in rope:
        rope = {"full_attention": {**(text.get("rope_scaling") or {}), "rope_theta": text.get("rope_theta", 1e6)},
                "sliding_attention": {"rope_type": "default", "rope_theta": text.get("rope_local_base_freq", 1e4)}}
    text["rope_parameters"] = rope
    return text


# What transformers' GptOssConfig assumes for a key config.json leaves out (openai/gpt-oss-20b's
# names them all; a config written by hand may not)
_GPT_OSS_DEFAULTS = {"head_dim": 64, "sliding_window": 128, "rms_norm_eps": 1e-5, "attention_bias": True,
                     "max_position_embeddings": 131072, "num_local_experts": 128, "num_experts_per_tok": 4,
                     "rope_theta": 150000.0}
_GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _gpt_oss_config(hf: dict) -> dict:
    """A gpt_oss config.json completed with transformers' defaults: layers alternate sliding and
    full attention (the first slides), RoPE is YaRN with theta 150000. The hub's MXFP4 expert
    weights are dequantised at load (mxfp4.py); another quantisation is refused."""
    hf = {**_GPT_OSS_DEFAULTS, **hf}
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise ConfigError(f"gpt_oss checkpoints quantised with {method!r} are not supported; use the bf16 "
                          "weights or the hub's mxfp4 ones (dequantised at load)")
    if hf.get("layer_types") is None:
        hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(hf["num_hidden_layers"])]
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        hf["rope_parameters"] = {**_GPT_OSS_YARN, "rope_theta": hf["rope_theta"]}
    return hf


def _layer_windows(hf: dict, num_layers: int, is_qwen: bool) -> list[int | None]:
    """Sliding window (tokens) of each layer, None for full attention, as transformers does."""
    window = hf.get("sliding_window")
    if is_qwen and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return [None] * num_layers
    types = hf.get("layer_types")
    if types is None:
        # Qwen: layers from max_window_layers on slide; Mistral: every layer slides.
        first = hf.get("max_window_layers", 0) if is_qwen else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return [int(window) if t == "sliding_attention" else None for t in types]
