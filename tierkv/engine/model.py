"""One decoder for every family the engine runs: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3,
SmolLM2, Gemma 3 (text), Qwen3-MoE, gpt-oss and DeepSeek-V3.

The variants differ only in switches that model_config.py reads from the Hugging Face config (qkv bias, q/k
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

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tierkv import kernels

from .attention import AttentionMetadata, paged_attention
from .layers import Linear, RMSNorm, RowParallelLinear
from .mla import MLAttention
from .mla import compile_variants as compile_mla_variants
from .model_config import ModelConfig
from .moe import SparseMoE
from .parallel import TensorParallel, check_tensor_parallel
from .rope import rope_attention_factor, rope_inv_freq

def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)


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
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
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
        # one kernel rotates q and k and writes k and v into the pool; attention then reads
        # every key through the pool, the new ones included
        if self.q_norm is None:
            q = kernels.rope_kv_write(q, k, v, cos, sin, kv, meta.slot_mapping)  # [T, Hq, D]
        else:
            # Qwen3, Gemma 3: RMSNorm over each head's D features before RoPE, in the same launch
            # (the norm modules hold the weights; their own forward is not called)
            q = kernels.rope_kv_write(
                q, k, v, cos, sin, kv, meta.slot_mapping, self.q_norm.weight, self.k_norm.weight,
                self.q_norm.eps, self.q_norm.unit_offset,
            )
        out = paged_attention(q, kv, meta, self.scale, self.sliding_window, self.layer, sinks=self.sinks)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.q_size))  # [T, hidden], summed over the ranks


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.inter = _len(tp.part(cfg.intermediate_size))  # this rank's intermediate features
        # gate and up in one GEMM, split after: this rank's gate rows, then its up rows
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
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
        self.lm_head = Linear(cfg.hidden_size, tp.vocab_per_rank(cfg.vocab_size), bias=False)  # this rank's rows
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
            x, residual = layer(x, residual, c, s, kv_pool[i], meta.for_layer(i))
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
