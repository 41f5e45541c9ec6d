"""Plain-torch kernels: the ground truth for tests and the implementation used on CPU.

Each function here has the same signature as its Triton counterpart in this package. They favour
clarity over speed (a Python loop over sequences, fp32 math) and must never depend on anything
outside torch. Shapes: kv is one layer's paged cache [num_blocks, 2 (K, V), block_size, Hkv, D].
"""

from __future__ import annotations

import torch

from . import _checks


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
) -> torch.Tensor:
    """Masked attention of n queries over one sequence's L keys, fp32 throughout.

    q: [n, Hq, D]; k, v: [L, Hkv, D]; q_pos: [n] position of each query in the sequence.
    Query at position p sees key positions j with j <= p and (no window or j > p - W).
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
    probs = torch.softmax(scores, dim=-1)                  # [Hq, n, L]
    return torch.einsum("hnl,lhd->nhd", probs, v)          # [n, Hq, D]


def paged_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One new query token per sequence attending to all its tokens in the paged pool.

    q:            [B, Hq, D]
    kv:           [num_blocks, 2, block_size, Hkv, D]
    block_tables: [B, max_blocks] int; entries past a sequence's length are never read
    seq_lens:     [B] int, tokens in the pool per sequence (the query's own K/V included)
    returns       [B, Hq, D] in q's dtype
    """
    _checks.check_decode(q, kv, block_tables, seq_lens, sliding_window)
    out = torch.zeros_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        if length <= 0:
            continue  # an empty sequence has nothing to attend to: output stays zero
        k, v = _sequence_kv(kv, block_tables[b], length)
        q_pos = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, q_pos, scale, sliding_window)[0].to(q.dtype)
    return out


def paged_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """A flat varlen batch of new tokens attending causally to their sequence in the paged pool.

    q:            [T, Hq, D], sequence b's new tokens are rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    kv:           [num_blocks, 2, block_size, Hkv, D], new tokens' K/V already written
    block_tables: [B, max_blocks] int
    cu_seqlens_q: [B+1] int
    seq_lens:     [B] int, cached prefix + new tokens per sequence
    New token j of sequence b sits at position seq_lens[b] - q_len_b + j.
    returns       [T, Hq, D] in q's dtype
    """
    _checks.check_prefill(q, kv, block_tables, cu_seqlens_q, seq_lens, sliding_window)
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
        out[start:end] = _attend(q[start:end], k, v, q_pos, scale, sliding_window).to(q.dtype)
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
