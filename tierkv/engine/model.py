"""One Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, SmolLM2 and Gemma 3 (text).

The variants differ only in small switches read from the Hugging Face config (qkv bias, q/k
norm, RoPE scaling, sliding window, tied embeddings; Gemma 3's (1 + w) norms around attention
and the MLP, GELU-tanh MLP, scaled embedding, attention scale and a RoPE of its own for the
sliding-window layers), so one readable model covers them all. What is big lives in a file of
its own: the sparse MoE block (moe.py) and DeepSeek-V3's multi-head latent attention (mla.py,
each layer's attention when config.mla is set).
The forward pass takes a flat batch of new tokens and reads/writes K/V only through the paged
pool via `attention.paged_attention`; it never allocates KV memory and never owns a cache.
With a TensorParallel of size > 1 the model holds one rank's shard (parallel.py says which) and
its forward runs the collectives; with the default (size 1) it is the plain model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tierkv import kernels
from tierkv.errors import ConfigError

from .attention import AttentionMetadata, paged_attention
from .layers import RMSNorm, RowParallelLinear, yarn_mscale
from .mla import MLAttention, MLASpec
from .mla import compile_variants as compile_mla_variants
from .moe import ROUTER_OF, MoESpec, SparseMoE, moe_layers
from .parallel import TensorParallel, check_tensor_parallel

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


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None, sliding: bool = False) -> torch.Tensor:
    """[rope_dim / 2] fp32 inverse frequencies, with linear, llama3 or YaRN scaling applied; `sliding`:
    those of the sliding-window layers (cfg.sliding_rope's, where it is set)."""
    theta, scaling = cfg.sliding_rope if sliding and cfg.sliding_rope else (cfg.rope_theta, cfg.rope_scaling)
    d = cfg.rope_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    scaling = scaling or {"rope_type": "default"}
    if scaling["rope_type"] == "linear":
        # stretching positions by `factor` == shrinking every frequency by it
        return inv_freq / float(scaling["factor"])
    if scaling["rope_type"] == "llama3":
        # Llama 3.1: long wavelengths (beyond the original context / low_freq_factor) are slowed
        # down by `factor`, short ones kept, and the band between is interpolated smoothly.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(is_medium, smoothed, scaled)
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(scaling, theta, d, cfg.max_position_embeddings, inv_freq)
    return inv_freq


def _yarn_factor(scaling: dict, max_positions: int) -> float:
    # DeepSeek-V3-style configs may leave factor null: the context's growth over the original's
    factor = scaling.get("factor")
    return float(factor) if factor is not None else max_positions / _yarn_original_context(scaling, max_positions)


def _yarn_original_context(scaling: dict, max_positions: int) -> int:
    # left out, it is max_position_embeddings (transformers' standardize_rope_params)
    return scaling.get("original_max_position_embeddings") or max_positions


def _yarn_inv_freq(scaling: dict, theta: float, d: int, max_positions: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters, op for op): frequencies that turn fewer than
    beta_slow times over the original context are interpolated (divided by factor), those that turn
    more than beta_fast times kept, with a linear ramp between (over dims rounded outwards unless
    `truncate` is false, as gpt-oss sets)."""
    factor = _yarn_factor(scaling, max_positions)
    old_ctx = _yarn_original_context(scaling, max_positions)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over old_ctx
        return (d * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = 1.0 / inv_freq  # theta ** (2i / d), as transformers computes it
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (its `attention_factor`, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are set, else mscale(factor));
    1 for every other RoPE."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, cfg.max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint holds w and the norm scales by (1 + w), in fp32 before the
    cast back (Llama casts first), as transformers' Gemma3RMSNorm does, so bf16 rounds the same."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual, unit_offset=True)


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return UnitOffsetRMSNorm(dim, cfg.rms_norm_eps) if cfg.norm_unit_offset else RMSNorm(dim, cfg.rms_norm_eps)


def _len(s: slice) -> int:
    return s.stop - s.start


class VocabParallelEmbedding(nn.Embedding):
    """The embedding's rows `tp.vocab(vocab_size)` (padded past the vocab with zero rows): a rank
    looks up the ids it holds, gives zeros for the others, and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(tp.vocab_per_rank(vocab_size), hidden_size)
        self.tp = tp
        self.first = tp.vocab(vocab_size).start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().forward(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)  # [T] ids another rank holds
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        # this rank's q heads and KV heads (a KV head may be replicated on several ranks)
        self.num_heads, self.num_kv_heads = _len(tp.part(cfg.num_heads)), _len(tp.kv_heads(cfg.num_kv_heads))
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.layer = layer
        self.sliding_window = cfg.layer_windows[layer] if cfg.layer_windows else None
        # q, k and v in one GEMM: one weight read and one launch instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        # q/k norms act within one head: every rank holds the whole [D] weight
        self.q_norm = _norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        # gpt-oss: this rank's heads' sink logits, in the model dtype as transformers holds them
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)     # [T, Hq, D] (strided views of one GEMM output)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            # Qwen3, Gemma 3: RMSNorm over each head's D features, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        # one kernel rotates q and k and writes k and v into the pool; attention then reads
        # every key through the pool, the new ones included
        q = kernels.rope_kv_write(q, k, v, cos, sin, kv, meta.slot_mapping)  # [T, Hq, D]
        out = paged_attention(q, kv, meta, self.scale, self.sliding_window, self.layer, sinks=self.sinks)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.q_size))  # [T, hidden], summed over the ranks


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.inter = _len(tp.part(cfg.intermediate_size))  # this rank's intermediate features
        # gate and up in one GEMM, split after: this rank's gate rows, then its up rows
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, cfg.mlp_bias, tp)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        # SwiGLU, or Gemma's GeGLU (transformers' gelu_pytorch_tanh): [T, I] -> [T, hidden]
        return self.down_proj(kernels.gelu_tanh_mul(gate_up) if self.gelu else kernels.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        if cfg.mla:
            self.self_attn = MLAttention(cfg.mla, cfg.hidden_size, cfg.num_heads, layer, tp)
        else:
            self.self_attn = Attention(cfg, layer, tp)
        self.mlp = SparseMoE(cfg.moe, tp) if cfg.moe_layers and cfg.moe_layers[layer] else MLP(cfg, tp)
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm normalises the attention output itself
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        self.sandwich = cfg.sandwich_norms

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it adds in): the residual add is
        folded into the next norm, so the stream after layer l is h_l + residual_l."""
        if residual is None:  # the first layer: the stream is the embedding itself
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv, meta)
        if self.sandwich:  # residual += norm(attn); h = norm(residual); the MLP's output normalised too
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Decoder(nn.Module):
    """Embedding, the layers and the final norm; parameter names follow HF's `model.*`."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = _norm(cfg, cfg.hidden_size)


class CausalLM(nn.Module):
    """The whole model: flat new tokens in, logits of the requested tokens out.

    Parameter names mirror the HF checkpoints except that q/k/v and gate/up are fused
    (`qkv_proj`, `gate_up_proj`); the loader concatenates them. `config` is the whole model's;
    with `tp` of size > 1 the parameters are this rank's shard, and the pool it is given holds
    its `num_local_kv_heads` KV heads only.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        check_tensor_parallel(tp.size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
        self.config = cfg
        self.tp = tp
        self.model = Decoder(cfg, tp)
        self.num_local_heads = _len(tp.part(cfg.num_heads))
        self.num_local_kv_heads = _len(tp.kv_heads(cfg.num_kv_heads))
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_per_rank(cfg.vocab_size), bias=False)  # this rank's rows
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope_scale = rope_attention_factor(cfg)  # YaRN scales cos and sin (in fp32, before the cast)
        sliding = rope_inv_freq(cfg, sliding=True) if cfg.sliding_rope else None
        self.register_buffer("sliding_inv_freq", sliding, persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when the checkpoint ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compile_kernels(self, kv: torch.Tensor) -> int:
        """Compile now every attention kernel variant this model's steps may pick on a layer pool
        `kv` like the cache's (Triton only; 0 where the reference serves): the regular pool's
        prefill variants per sliding window, with sinks where the layers have them, or MLA's over
        its up-projected heads (mla.compile_variants). Returns the number of variants."""
        cfg = self.config
        if cfg.mla is not None:
            return compile_mla_variants(cfg.mla, kv, self.num_local_heads)
        windows = set(cfg.layer_windows or [None])
        scale = self.model.layers[0].self_attn.scale
        return kernels.compile_variants(kv, self.num_local_heads, scale, windows, sinks=cfg.attention_sinks)

    def reset_rope(self) -> None:
        """Recompute the RoPE frequencies on the current device (after loading from `meta`)."""
        self.inv_freq = rope_inv_freq(self.config, self.model.embed_tokens.weight.device)
        if self.config.sliding_rope:
            self.sliding_inv_freq = rope_inv_freq(self.config, self.model.embed_tokens.weight.device, sliding=True)

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype, sliding: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for positions [T] (of the sliding-window layers' RoPE with `sliding`);
        angles in fp32, then cast like transformers."""
        inv_freq = self.sliding_inv_freq if sliding else self.inv_freq
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos.to(dtype), sin.to(dtype)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor | Sequence[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Residual stream [T, hidden] after the last layer, before the final norm.

        K/V of every new token are written into the pool as a side effect.

        input_ids, positions: [T] int64; kv_pool[i] is layer i's pool
        [num_blocks, 2, block_size, Hkv, D] (one [layers, ...] tensor or a list of them), Hkv = num_local_kv_heads.
        """
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.config.embed_scale is not None:  # Gemma: rounded to the model dtype first, as transformers does
            x = x * torch.tensor(self.config.embed_scale).to(x.dtype).item()
        cos, sin = self.rope(positions, x.dtype)  # [T, D] each
        # Gemma 3's sliding-window layers have a RoPE of their own
        local = self.rope(positions, x.dtype, sliding=True) if self.config.sliding_rope else (cos, sin)
        residual = None
        for i, layer in enumerate(self.model.layers):
            if meta.wait_layer is not None:
                meta.wait_layer(i)
            c, s = local if layer.self_attn.sliding_window is not None else (cos, sin)
            x, residual = layer(x, residual, c, s, kv_pool[i], meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [n, hidden] -> fp32 logits [n, vocab], the whole vocab on every rank."""
        logits = self.lm_head(self.model.norm(hidden))  # [n, vocab rows of this rank]
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers does
            logits = torch.tanh(logits / cap) * cap
        # gathered before the cast: half the traffic in bf16, and the cast is exact either way
        return self.tp.gather_vocab(logits, self.config.vocab_size).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor | Sequence[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Logits [len(meta.logits_indices), vocab] (fp32) of the tokens the step samples from.

        Only those rows go through the final norm (per token) and the LM head: a long prefill
        chunk needs at most one.
        """
        hidden = self.hidden_states(input_ids, positions, kv_pool, meta)
        return self.compute_logits(hidden.index_select(0, meta.logits_indices))
