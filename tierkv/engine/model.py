"""One Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3 and SmolLM2.

The variants differ only in small switches read from the Hugging Face config (qkv bias, q/k
norm, RoPE scaling, sliding window, tied embeddings), so one readable model covers them all.
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
from .moe import ROUTER_OF, MoESpec, SparseMoE, moe_layers
from .parallel import TensorParallel, check_tensor_parallel

# config.json "model_type" values this decoder implements.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    # mixture of experts (moe.py): the sparse block's spec, and which layers hold it (the others a dense MLP)
    moe: MoESpec | None = None
    moe_layers: list[bool] = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a parsed config.json; raises ConfigError naming what is supported."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = hf.get("architectures") or []
            raise ConfigError(
                f"model_type {model_type!r} (architectures {archs}) is not supported by the tierkv "
                f"engine; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, SmolLM2)"
            )
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        # transformers >= 5 writes "rope_parameters" (theta + scaling in one dict); older
        # checkpoints write "rope_theta" and an optional "rope_scaling".
        rope = dict(hf.get("rope_parameters") or {})
        if not rope:
            rope = dict(hf.get("rope_scaling") or {})
            rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"RoPE scaling type {rope_type!r} is not supported; use a checkpoint with one of "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError("partial_rotary_factor != 1 is not supported by the tierkv engine")
        rope["rope_type"] = rope_type
        is_qwen = model_type in ("qwen2", "qwen3", "qwen3_moe")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never o bias; Llama/Qwen3 "attention_bias" covers
            # all four projections; Mistral has none.
            qkv_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            o_bias=model_type in ("llama", "qwen3", "qwen3_moe") and bool(hf.get("attention_bias", False)),
            mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            layer_windows=_layer_windows(hf, num_layers, is_qwen),
            moe=MoESpec.from_hf(hf) if model_type in ROUTER_OF else None,
            moe_layers=moe_layers(hf, num_layers),
        )


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


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, with linear or llama3 scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    scaling = cfg.rope_scaling or {"rope_type": "default"}
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
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual) in one kernel.

        Normalised in fp32 and cast back before the weight, in the same order as transformers,
        so bf16 results round the same way (on CPU exactly; the GPU kernel sums in another order).
        """
        return kernels.rms_norm(x, self.weight, self.eps, residual)


def _len(s: slice) -> int:
    return s.stop - s.start


class RowParallelLinear(nn.Linear):
    """A Linear whose input features are split over the ranks (o_proj, down_proj): each rank
    multiplies its slice, one all-reduce sums the partials, and only then is the bias (whole on
    every rank) added, so that it counts once and not `size` times."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().forward(x)
        out = self.tp.all_reduce(F.linear(x, self.weight))  # [T, out], summed over the ranks
        return out if self.bias is None else out + self.bias


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
        self.scale = cfg.head_dim**-0.5
        self.layer = layer
        self.sliding_window = cfg.layer_windows[layer] if cfg.layer_windows else None
        # q, k and v in one GEMM: one weight read and one launch instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        # q/k norms act within one head: every rank holds the whole [D] weight
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)     # [T, Hq, D] (strided views of one GEMM output)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            # Qwen3: RMSNorm over each head's D features, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        # one kernel rotates q and k and writes k and v into the pool; attention then reads
        # every key through the pool, the new ones included
        q = kernels.rope_kv_write(q, k, v, cos, sin, kv, meta.slot_mapping)  # [T, Hq, D]
        out = paged_attention(q, kv, meta, self.scale, self.sliding_window, self.layer)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.q_size))  # [T, hidden], summed over the ranks


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.inter = _len(tp.part(cfg.intermediate_size))  # this rank's intermediate features
        # gate and up in one GEMM, split after: this rank's gate rows, then its up rows
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_up_proj(x)))  # [T, 2I] -> SwiGLU [T, I] -> [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.mlp = SparseMoE(cfg.moe, tp) if cfg.moe_layers and cfg.moe_layers[layer] else MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

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
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Decoder(nn.Module):
    """Embedding, the layers and the final norm; parameter names follow HF's `model.*`."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


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
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when the checkpoint ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_rope(self) -> None:
        """Recompute the RoPE frequencies on the current device (after loading from `meta`)."""
        self.inv_freq = rope_inv_freq(self.config, self.model.embed_tokens.weight.device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for positions [T]; angles in fp32, then cast like transformers."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

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
        cos, sin = self.rope(positions, x.dtype)  # [T, D] each
        residual = None
        for i, layer in enumerate(self.model.layers):
            if meta.wait_layer is not None:
                meta.wait_layer(i)
            x, residual = layer(x, residual, cos, sin, kv_pool[i], meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [n, hidden] -> fp32 logits [n, vocab], the whole vocab on every rank."""
        logits = self.lm_head(self.model.norm(hidden))  # [n, vocab rows of this rank]
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
