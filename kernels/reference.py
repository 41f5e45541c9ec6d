"""Plain-torch kernels: the ground truth for tests and the implementation used on CPU.

Each function here has the same signature as its Triton counterpart in this package. They favour
clarity over speed (a Python loop over sequences, fp32 math) and must never depend on anything
outside torch. Shapes: kv is one layer's paged cache [num_blocks, 2 (K, V), block_size, Hkv, D].
"""

from __future__ import annotations

import torch

from . import _checks
from .reference_moe import fused_moe, moe_activation, moe_topk  # noqa: F401  (one module of references)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V into pool slots, in place.

    k, v:         [T, Hkv, D]
    kv:           [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: [T] int, slot = block * block_size + offset; -1 means "skip this token"
    """
    _checks.check_kv_write(k, v, kv, slot_mapping)
    bs = kv.shape[2]
    keep = slot_mapping >= 0                               # [T] bool
    slots = slot_mapping[keep].long()                      # [T']
    blocks, offsets = slots // bs, slots % bs              # [T'], [T']
    kv[blocks, 0, offsets] = k[keep]                       # [T', Hkv, D]
    kv[blocks, 1, offsets] = v[keep]


def _sequence_kv(kv: torch.Tensor, table_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `length` tokens, gathered through its block table row.

    Only the first ceil(length / block_size) table entries are read: the rest may be garbage.
    Returns K, V: [length, Hkv, D] each.
    """
    bs = kv.shape[2]
    n_blocks = (length + bs - 1) // bs
    blocks = table_row[:n_blocks].long()                   # [n_blocks]
    pages = kv[blocks]                                     # [n_blocks, 2, bs, Hkv, D]
    k = pages[:, 0].reshape(-1, *kv.shape[3:])[:length]    # [length, Hkv, D]
    v = pages[:, 1].reshape(-1, *kv.shape[3:])[:length]
    return k, v


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention of n queries over one sequence's L keys, fp32 throughout.

    q: [n, Hq, D]; k, v: [L, Hkv, D]; q_pos: [n] position of each query in the sequence.
    Query at position p sees key positions j with j <= p and (no window or j > p - W).
    sinks: None or [Hq], a logit per head that joins each softmax as one more column, dropped
    after (gpt-oss; transformers' eager_attention_forward): it takes mass, adds no value.
    Returns [n, Hq, D] fp32.
    """
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    # GQA: query head h reads kv head h // group, so repeat each kv head `group` times.
    k = k.float().repeat_interleave(group, dim=1)          # [L, Hq, D]
    v = v.float().repeat_interleave(group, dim=1)          # [L, Hq, D]
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale   # [Hq, n, L]
    k_pos = torch.arange(k.shape[0], device=q.device)      # [L]
    visible = k_pos[None, :] <= q_pos[:, None]             # [n, L]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)    # [Hq, n, 1]
        scores = torch.cat([scores, column], dim=-1)                            # [Hq, n, L + 1]
    probs = torch.softmax(scores, dim=-1)[..., : k.shape[0]]   # [Hq, n, L], the sink's share dropped
    return torch.einsum("hnl,lhd->nhd", probs, v)          # [n, Hq, D]


def paged_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new query token per sequence attending to all its tokens in the paged pool.

    q:            [B, Hq, D]
    kv:           [num_blocks, 2, block_size, Hkv, D]
    block_tables: [B, max_blocks] int; entries past a sequence's length are never read
    seq_lens:     [B] int, tokens in the pool per sequence (the query's own K/V included)
    sinks:        None or [Hq], attention-sink logits in any float dtype (see _attend)
    returns       [B, Hq, D] in q's dtype
    """
    _checks.check_decode(q, kv, block_tables, seq_lens, sliding_window, sinks)
    out = torch.zeros_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        if length <= 0:
            continue  # an empty sequence has nothing to attend to: output stays zero
        k, v = _sequence_kv(kv, block_tables[b], length)
        q_pos = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, q_pos, scale, sliding_window, sinks)[0].to(q.dtype)
    return out


def paged_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A flat varlen batch of new tokens attending causally to their sequence in the paged pool.

    q:            [T, Hq, D], sequence b's new tokens are rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    kv:           [num_blocks, 2, block_size, Hkv, D], new tokens' K/V already written
    block_tables: [B, max_blocks] int
    cu_seqlens_q: [B+1] int
    seq_lens:     [B] int, cached prefix + new tokens per sequence
    New token j of sequence b sits at position seq_lens[b] - q_len_b + j.
    sinks:        None or [Hq], attention-sink logits in any float dtype (see _attend)
    returns       [T, Hq, D] in q's dtype
    """
    _checks.check_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, sliding_window, sinks)
    out = torch.zeros_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if q_len > length:
            raise _checks.ShapeError(f"sequence {b} has {q_len} new tokens but seq_lens is only {length}")
        k, v = _sequence_kv(kv, block_tables[b], length)
        q_pos = torch.arange(length - q_len, length, device=q.device)   # [q_len]
        out[start:end] = _attend(q[start:end], k, v, q_pos, scale, sliding_window, sinks).to(q.dtype)
    return out


def gather_blocks(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy blocks out of a layer-first pool into block-first contiguous storage.

    pool:  [layers, num_slots, 2, block_size, kv_heads, head_dim]  (the L1 pool)
    slots: [n] int64, the pool slots to read, in order
    out:   [n, layers, 2, block_size, kv_heads, head_dim]          (staging / L2 layout)
    """
    _checks.check_blocks(pool, slots, out, "out")
    out.copy_(pool.index_select(1, slots.long()).transpose(0, 1))
    return out


def scatter_blocks(src: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The inverse of gather_blocks: write block-first `src` [n, layers, ...] into pool slots."""
    _checks.check_blocks(pool, slots, src, "src")
    pool.index_copy_(1, slots.long(), src.to(pool.device).transpose(0, 1))
    return pool


def copy_blocks(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor) -> torch.Tensor:
    """dst[dst_slots[i]] = src[src_slots[i]] for blocks along dim 0 (any inner shape, one dtype).

    src: [N, ...] (may be host memory), src_slots: [n]; dst: [M, ...] with the same inner shape,
    dst_slots: [n] distinct. Returns dst, written in place.
    """
    _checks.check_copy_blocks(src, src_slots, dst, dst_slots)
    rows = src.index_select(0, src_slots.to(src.device).long())
    dst.index_copy_(0, dst_slots.to(dst.device).long(), rows.to(dst.device, non_blocking=True))
    return dst



def upload(table, counts) -> None:
    """targets[i][:counts[i]] = sources[i][:counts[i]] for each pair of `table` (an UploadTable:
    kernels/upload_table.py), by torch's copies (non-blocking from pinned memory)."""
    for n, s, t in zip(table.set_counts(counts), table.sources, table.targets):
        if n:
            t[:n].copy_(s[:n], non_blocking=True)


def copy_planes(src, src_slots: torch.Tensor, dst, dst_slots: torch.Tensor,
                planes: tuple[int, int] | None = None):
    """dst.planes[p][dst_slots[i]] = src.planes[p][src_slots[i]] for p in `planes` (default all).

    src, dst: PlaneTables (kernels/planes.py), planes [N, bs, H, D] / [M, bs, H, D] of one block
    geometry and dtype; src_slots, dst_slots: [n] (dst_slots distinct). Moves bits (each plane
    viewed as the integer type of its element size), so any dtype, fp8 too, copies exactly.
    Returns dst, written in place.
    """
    first, end = _checks.check_copy_planes(src, src_slots, dst, dst_slots, planes)
    src_idx = src_slots.to(src.planes[0].device).long()       # [n]
    dst_idx = dst_slots.to(dst.planes[0].device).long()       # [n]
    for p in range(first, end):
        rows = src.planes[p].view(src.word_dtype).index_select(0, src_idx)  # [n, bs, H, D]
        dst.planes[p].view(dst.word_dtype).index_copy_(0, dst_idx, rows.to(dst_idx.device))
    return dst

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantise KV to fp8 with one scale per (leading index, kv head), in place into q and scales.

    x:      [..., T, H, D] bf16/fp16/fp32, e.g. blocks [n, layers, 2, block_size, H, D]
    q:      [..., T, H, D] float8_e4m3fn (may be a strided view into packed bytes)
    scales: [..., H] float32: amax over the head's T x D values / 448, 1 where the head is all 0
    q = clamp(x / scale, +-448) rounded to nearest fp8. Math in fp32. The Triton version (fp8.py)
    computes the same bytes in one kernel; this one is a pass of elementwise ops per piece.
    """
    _checks.check_quantize(x, q, scales, "x", "q")
    for part in _pieces(x):
        xf = x[part].float()
        amax = xf.abs().amax(dim=(-3, -1))                           # [k, ..., H]
        # divided by a tensor: torch on CUDA turns `/ 448` (a Python number) into `* (1 / 448)`,
        # a scale one ulp off the exact quotient that the CPU and the Triton kernel compute
        scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
        scales[part].copy_(scale)
        # clamp: x / (amax / 448) may round a hair above 448, which e4m3fn (no inf) cannot hold
        q[part].copy_((xf / scale[..., None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The inverse of quantize_fp8: out [..., T, H, D] = q * scales[..., None, :, None], in out's dtype."""
    _checks.check_quantize(out, q, scales, "out", "q")
    for part in _pieces(out):
        out[part].copy_(q[part].float() * scales[part][..., None, :, None])


def gather_quantize_fp8(pool: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """gather_blocks then quantize_fp8: pool [layers, N, 2, bs, H, D] blocks `slots` [n] -> q
    [n, layers, 2, bs, H, D] fp8 and scales [n, layers, 2, H] fp32, in place."""
    _checks.check_gather_quantize(pool, slots, q, scales)
    quantize_fp8(pool.index_select(1, slots.long()).transpose(0, 1), q, scales)


def dequantize_scatter_fp8(q: torch.Tensor, scales: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """The inverse of gather_quantize_fp8: q and scales dequantised into pool blocks `slots`, in the pool's dtype."""
    _checks.check_gather_quantize(pool, slots, q, scales)
    blocks = torch.empty(q.shape, dtype=pool.dtype, device=pool.device)  # [n, layers, 2, bs, H, D]
    dequantize_fp8(q, scales, blocks)
    pool.index_copy_(1, slots.long(), blocks.transpose(0, 1))


_PIECE_ELEMENTS = 1 << 23  # fp32 temporaries of one piece: 32 MiB each


def _pieces(x: torch.Tensor) -> list[slice]:
    """Slices of dim 0 (a leading dim, shared by the scales) of about _PIECE_ELEMENTS each, so a
    256 MiB staging buffer is converted without fp32 temporaries twice its size (GPU memory next
    to L1 is tight); the whole of x when it has no leading dim."""
    if x.dim() <= 3 or x.shape[0] == 0:
        return [slice(None)]
    step = max(1, _PIECE_ELEMENTS // max(1, x[0].numel()))
    return [slice(i, i + step) for i in range(0, x.shape[0], step)]


# Fused decoder ops. These must round exactly as transformers does (each torch op in the model's
# dtype, in HF's order), since the CPU engine is held token-for-token equal to transformers.


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the last dim, optionally after adding a residual.

    x:        [..., H] (any strides); weight: [H], x's dtype
    residual: None, or [..., H] like x: then s = x + residual (in x's dtype, the decoder's
              `x = x + attn(...)`) is normalised and (out, s) returned
    returns   out [..., H] = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype);
              with unit_offset (Gemma): ((x.float() * rsqrt(..)) * (1 + weight.float())).to(x.dtype)
    """
    _checks.check_rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)   # HF: normalise in fp32,
    if unit_offset:                                                    # Gemma: (1 + w) in fp32, then cast
        out = (x32 * (1.0 + weight.float())).to(x.dtype)
    else:
        out = weight * x32.to(x.dtype)                                 # Llama: cast, then the weight
    return out if residual is None else (out, x)


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
) -> torch.Tensor:
    """RoPE ("rotate half", HF layout) on q and k, then kv_write of rotated k and v.

    q:            [T, Hq, D]; k, v: [T, Hkv, D] (any strides)
    cos, sin:     [T, D] in q's dtype
    kv:           [num_blocks, 2, block_size, Hkv, D], written in place at slot_mapping [T] (-1 skips)
    q_norm, k_norm: None, or both [D] in q's dtype: Qwen3 / Gemma 3's per-head RMSNorm (rms_norm
                  with eps and unit_offset) of each q and k head before the rotation; v is never normalised
    returns       rotated q [T, Hq, D]
    """
    _checks.check_rope_kv_write(q, k, v, cos, sin, kv, slot_mapping, q_norm, k_norm, eps)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps, unit_offset=unit_offset), rms_norm(k, k_norm, eps, unit_offset=unit_offset)
    cos, sin = cos[:, None, :], sin[:, None, :]                        # [T, 1, D]
    kv_write(_rotate_half(k, cos, sin), v, kv, slot_mapping)
    return _rotate_half(q, cos, sin)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] * cos + cat(-x[D/2:], x[:D/2]) * sin, cos/sin [T, 1, D]; each op in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] times weight [N, K] (+ bias) -> [T, N]: torch's linear."""
    return torch.nn.functional.linear(x, weight, bias)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate, then up) -> F.silu(gate) * up [T, I], in gate_up's dtype."""
    _, inter = _checks.check_silu_mul(gate_up)
    gate, up = gate_up.split([inter, inter], dim=-1)                  # [T, I] each
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate, then up) -> F.gelu(gate, approximate="tanh") * up [T, I], in
    gate_up's dtype: Gemma's GeGLU (transformers' gelu_pytorch_tanh)."""
    _, inter = _checks.check_silu_mul(gate_up)
    gate, up = gate_up.split([inter, inter], dim=-1)                  # [T, I] each
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# Sampling filters. The Triton version (sampling.py) finds the same kept set without sorting.


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """A new [B, V] copy of logits [B, V] with the tokens outside each row's filters set to -inf.

    top_k: None or [B] int; a row's k < 1 or k >= V keeps all.
    top_p: None or [B] fp32 in (0, 1]; p >= 1 keeps all.
    A token x is kept iff  count(logits > x) < k  and  mass(logits > x) < p,  where mass is the
    softmax (fp32) of the whole row: top-p is not renormalised over the top-k survivors. Sorted,
    that is "rank r stays while r < k and the mass strictly before it is < p", so the top token
    always stays. Ties: tokens of equal logit share one fate, decided at the first rank of their
    run, so a tie across the boundary keeps every tied token (-0.0 and +0.0 are equal).
    """
    _checks.check_top_k_top_p(logits, top_k, top_p)
    sorted_logits, order = logits.sort(dim=-1, descending=True)              # [B, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    # the first rank of each run of equal values: count(logits > x) for every member of the run
    new_run = torch.ones_like(sorted_logits, dtype=torch.bool)
    new_run[:, 1:] = sorted_logits[:, 1:] != sorted_logits[:, :-1]
    first = torch.where(new_run, ranks, 0).cummax(dim=-1).values            # [B, V]
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = top_k.long()[:, None]                                            # [B, 1]
        keep &= (first < k) | (k < 1) | (k >= vocab)
    if top_p is not None:
        p = top_p[:, None]                                                   # [B, 1]
        probs = sorted_logits.float().softmax(dim=-1)                        # [B, V]
        before = probs.cumsum(dim=-1) - probs           # mass strictly before each rank
        keep &= (before.gather(1, first) < p) | (first == 0) | (p >= 1)
    filtered = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, filtered)


# Multi-head latent attention (DeepSeek-V2/V3). The pool holds one latent per token,
# cat(c_kv [L], k_pe [R]), split over the two planes of a one-head pool: K plane = latent[:D],
# V plane = latent[D:], D = (L + R) / 2.


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode: every query head of a sequence against its latent cache.

    q_latent:     [B, H, L] the no-rope query already multiplied by each head's W_UK (kv_lora_rank L)
    q_pe:         [B, H, R] the rotated rope part of the query
    kv:           [num_blocks, 2, block_size, 1, D], 2 * D = L + R
    block_tables: [B, max_blocks]; seq_lens: [B] (the query's own latent included)
    returns       [B, H, L] in q_latent's dtype: softmax(scale * (q_latent . c_kv + q_pe . k_pe)) @ c_kv,
                  the attention output in latent space (the caller applies each head's W_UV)
    """
    _, lat, rope = _checks.check_mla_decode(q_latent, q_pe, kv, block_tables, seq_lens)
    out = torch.zeros_like(q_latent)
    for b, length in enumerate(seq_lens.tolist()):
        if length <= 0:
            continue  # nothing to attend to: zeros, as paged_decode
        k, v = _sequence_kv(kv, block_tables[b], length)                 # [length, 1, D] each
        c_kv, k_pe = torch.cat([k[:, 0], v[:, 0]], dim=-1).float().split([lat, rope], dim=-1)
        scores = (q_latent[b].float() @ c_kv.T + q_pe[b].float() @ k_pe.T) * scale   # [H, length]
        out[b] = (torch.softmax(scores, dim=-1) @ c_kv).to(q_latent.dtype)          # [H, L]
    return out
