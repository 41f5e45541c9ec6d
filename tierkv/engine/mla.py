"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2: model_type deepseek_v3), as transformers'
DeepseekV3Attention computes it, over a paged pool of latents.

Per token the cache holds ONE latent, not K and V per head: the normalised compressed KV c_kv
[kv_lora_rank] and the rotated shared rope key k_pe [qk_rope_head_dim]. It lives in a one-head pool
[num_blocks, 2, block_size, 1, D] with D = (kv_lora_rank + rope) / 2: latent[:D] in the K plane and
latent[D:] in the V plane, so no byte is wasted and every tier moves it as any other KV (one head,
the same on every tensor-parallel rank). This file and kernels/mla.py are the only code that knows
that split.

- Decode (one new token per sequence) uses the absorbed form: q_nope @ W_UK per head is a query in
  latent space, scores = q_latent . c_kv + q_pe . k_pe over the latent cache (kernels.mla_decode
  reads each latent once for all heads), and the latent-space output @ W_UV per head gives the values.
- Prefill (and mixed batches) up-projects the cached latents of the batch's blocks into per-head K
  (k_nope, k_pe) and V through kv_b_proj and attends with kernels.paged_prefill: prefill is
  compute-bound, where the absorbed form would cost (kv_lora_rank + rope) / (nope + rope) = 3x the
  attention FLOPs at DeepSeek's sizes, and the prefill kernel (causal, chunked, split) serves
  up-projected heads unchanged. The cost: every block of the batch's block tables is up-projected,
  a decode's whole context too when it shares a step with a prefill chunk.

Tensor parallel: each rank holds its q heads (q_proj / q_b_proj rows) and their kv_b_proj rows; the
latent projections (q_a, kv_a) and the latent itself are replicated; o_proj is row-parallel. This
file never reads checkpoints (the loader asks `shard` which rows a rank reads) and never allocates KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tierkv import kernels
from tierkv.errors import ConfigError

from .attention import AttentionMetadata, paged_attention
from .layers import Linear, RMSNorm, RowParallelLinear, yarn_mscale
from .parallel import TensorParallel

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class MLASpec:
    """The attention shape of a deepseek_v3 config.json (names as Hugging Face's)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope features in interleaved pairs (transformers' apply_rotary_pos_emb_interleave)
    attention_bias: bool  # bias on q_a_proj, kv_a_proj_with_mqa and o_proj
    scale: float  # softmax scale: qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) ** 2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent(self) -> int:
        """Values cached per token: c_kv and k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def pool_head_dim(self) -> int:
        """D of the one-head pool holding the latent over its K and V planes."""
        return self.latent // 2

    @classmethod
    def from_hf(cls, hf: dict) -> MLASpec:
        """The spec of a deepseek_v3 config.json; ConfigError for what the engine cannot run."""
        method = (hf.get("quantization_config") or {}).get("quant_method")
        if method is not None:
            # DeepSeek-V3/R1's and Kimi K2's hub weights are fp8 with a scale per 128 x 128 block
            raise ConfigError(
                f"deepseek_v3 checkpoints quantised with {method!r} are not supported by the tierkv engine; "
                "use a bf16 copy (DeepSeek's inference/fp8_cast_bf16.py converts the hub's fp8 weights)"
            )
        lat, rope = int(hf["kv_lora_rank"]), int(hf["qk_rope_head_dim"])
        if (lat + rope) % 2 or rope % 2:
            raise ConfigError(
                f"kv_lora_rank {lat} + qk_rope_head_dim {rope} must be even (and the rope dim even): the latent is "
                "stored as two equal halves in the KV pool's K and V planes"
            )
        nope = int(hf["qk_nope_head_dim"])
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        scale = (nope + rope) ** -0.5
        # transformers' yarn_apply_mscale: any scaled RoPE with mscale_all_dim sharpens the softmax
        if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
            scale *= yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
        return cls(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=lat, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                   v_head_dim=int(hf["v_head_dim"]), rope_interleave=bool(hf.get("rope_interleave", True)),
                   attention_bias=bool(hf.get("attention_bias", False)), scale=scale)


def shard(module: str, suffix: str, spec: MLASpec, heads: slice) -> tuple[int, slice] | None:
    """(dim, indices) of checkpoint tensor `...self_attn.<module>.<suffix>` that the rank owning query
    heads `heads` reads; None: all of it (the latent projections, their norms, o_proj's bias)."""
    if module in ("q_proj", "q_b_proj"):  # output rows of this rank's heads
        return 0, slice(heads.start * spec.qk_head_dim, heads.stop * spec.qk_head_dim)
    per_head = spec.qk_nope_head_dim + spec.v_head_dim
    if module == "kv_b_proj":  # each head's k_nope rows then its v rows
        return 0, slice(heads.start * per_head, heads.stop * per_head)
    if module == "o_proj" and suffix == "weight":  # input columns of this rank's heads' values
        return 1, slice(heads.start * spec.v_head_dim, heads.stop * spec.v_head_dim)
    return None


def compile_variants(spec: MLASpec, kv: torch.Tensor, num_heads: int) -> int:
    """kernels.compile_variants for a model with MLA: its prefill runs paged_prefill over the
    up-projected heads ([blocks, 2, bs, num_heads, max(qk_head_dim, v_head_dim)]), never over the
    latent pool kv itself, so the variants to compile are those of that shape (the decode kernel
    compiles when the decode CUDA graphs are captured). Returns the number of variants."""
    width = max(spec.qk_head_dim, spec.v_head_dim)
    up = kv.new_zeros(1, 2, kv.shape[2], num_heads, width)  # one block: compile_variants reads block 0 only
    return kernels.compile_variants(up, num_heads, spec.scale)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of x [T, H, R] with cos, sin [T, R] (cat(freqs, freqs) layout), each op as transformers
    orders it. Interleaved: pairs (x0, x1), (x2, x3), ... each rotated by one frequency, written out
    de-interleaved (the rotated evens, then the rotated odds), as apply_rotary_pos_emb_interleave does."""
    if interleave:
        half = cos.shape[-1] // 2
        cos, sin = cos[:, None, :half], sin[:, None, :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class MLAttention(nn.Module):
    """DeepseekV3Attention over the paged latent pool (module docstring). Parameter names are
    transformers' (q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj, o_proj), each holding this rank's heads."""

    def __init__(self, spec: MLASpec, hidden: int, num_heads: int, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        part = tp.part(num_heads)
        self.spec, self.layer = spec, layer
        self.sliding_window = None  # no DeepSeek layer slides
        self.num_heads = h = part.stop - part.start
        q_out = h * spec.qk_head_dim
        if spec.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden, spec.q_lora_rank, bias=spec.attention_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(spec.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, spec.latent, bias=spec.attention_bias)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(spec.kv_lora_rank, h * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
        self.o_proj = RowParallelLinear(h * spec.v_head_dim, hidden, spec.attention_bias, tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x [T, hidden], cos/sin [T, rope] -> [T, hidden] (summed over the ranks); writes each new
        token's latent into kv [num_blocks, 2, bs, 1, D] at meta.slot_mapping first."""
        spec, t = self.spec, x.shape[0]
        if spec.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, spec.qk_head_dim).split(
            [spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)          # [T, H, nope], [T, H, R]
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        q_pe = _rotate(q_pe, cos, sin, spec.rope_interleave)
        k_pe = _rotate(k_pe[:, None], cos, sin, spec.rope_interleave)[:, 0]  # [T, R], shared by the heads
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)      # [T, L + R]
        d = spec.pool_head_dim
        kernels.kv_write(latent[:, None, :d], latent[:, None, d:], kv, meta.slot_mapping)
        q = torch.cat([q_nope, q_pe], dim=-1)                              # [T, H, nope + R]
        out = paged_attention(q, kv, meta, spec.scale, None, self.layer, attend=self._attend)  # [T, H, v]
        return self.o_proj(out.reshape(t, self.num_heads * spec.v_head_dim))

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, nope + R] over the latent pool kv -> [T, H, v]."""
        spec = self.spec
        w = self.kv_b_proj.weight.view(self.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
        w_uk, w_uv = w.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=1)   # [H, nope, L], [H, v, L]
        q_nope, q_pe = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        if meta.is_decode:
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, L]
            out = kernels.mla_decode(q_latent.contiguous(), q_pe, kv, meta.block_tables, meta.seq_lens, spec.scale)
            return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)   # [B, H, v]
        return self._attend_up_projected(q, kv, meta)

    def _attend_up_projected(self, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Prefill: the latents of every block in the batch's block tables, up-projected into a
        temporary pool of per-head K = cat(k_nope, k_pe) and V (zero-padded to one width), attended
        causally by kernels.paged_prefill."""
        spec, h = self.spec, self.num_heads
        blocks = meta.block_tables.long().clamp(0, kv.shape[0] - 1)    # padding entries: any block, never read
        rows, width = blocks.shape
        pages = kv[blocks.view(-1)]                                    # [rows * width, 2, bs, 1, D]
        latent = torch.cat([pages[:, 0, :, 0], pages[:, 1, :, 0]], dim=-1)  # [n, bs, L + R]
        c_kv, k_pe = latent.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c_kv).view(*c_kv.shape[:2], h, -1).split(
            [spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)         # [n, bs, H, nope], [n, bs, H, v]
        keys = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, h, -1)], dim=-1)   # [n, bs, H, nope + R]
        dim = max(spec.qk_head_dim, spec.v_head_dim)
        up = torch.stack([F.pad(keys, (0, dim - spec.qk_head_dim)), F.pad(v, (0, dim - spec.v_head_dim))], dim=1)
        tables = torch.arange(rows * width, dtype=torch.int32, device=q.device).view(rows, width)
        out = kernels.paged_prefill(F.pad(q, (0, dim - spec.qk_head_dim)), up, tables, meta.cu_seqlens_q,
                                    meta.seq_lens, spec.scale, None, meta.context, plans=meta.plans)
        return out[..., : spec.v_head_dim]
