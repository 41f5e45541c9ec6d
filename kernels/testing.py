"""Builders of paged-KV inputs for tests and benchmarks: contiguous K/V -> a shuffled paged pool.

Used by tierkv's own tests and benchmarks and by anyone testing their engine against
tierkv.kernels. It allocates test data only; it must never be imported by the kernels themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedBatch:
    kv: torch.Tensor            # [num_blocks, 2, block_size, Hkv, D] the paged pool (one layer)
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 past each sequence's blocks
    seq_lens: torch.Tensor      # [B] int32
    keys: list[torch.Tensor]    # per sequence [L_b, Hkv, D], the same K contiguous
    values: list[torch.Tensor]  # per sequence [L_b, Hkv, D]


def make_paged(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
    table_pad: int = 2,
    generator: torch.Generator | None = None,
    fill: float = float("nan"),
    table_fill: int = -1,
) -> PagedBatch:
    """Random K/V for each sequence, written into a pool whose blocks are handed out shuffled.

    The pool has `spare_blocks` more blocks than needed, and every slot no sequence owns (spare
    blocks, the tail of each last block) holds `fill` (NaN by default), so a kernel that reads
    memory it does not own returns NaN instead of a plausible answer. Block tables are padded with
    `table_pad` columns of `table_fill` past the longest sequence, and block ids are in random order.
    """
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    kv = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), fill, dtype=dtype)
    max_blocks = max(need, default=0) + table_pad
    # entries past each sequence's blocks: -1 by default; a huge id makes any read of them fault
    tables = torch.full((len(seq_lens), max_blocks), table_fill, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        ids = perm[used : used + need[b]]
        used += need[b]
        tables[b, : need[b]] = ids.to(torch.int32)
        for i, blk in enumerate(ids.tolist()):
            chunk = slice(i * block_size, min(n, (i + 1) * block_size))
            width = chunk.stop - chunk.start
            kv[blk, 0, :width] = k[chunk]
            kv[blk, 1, :width] = v[chunk]
        keys.append(k)
        values.append(v)
    device = torch.device(device)
    return PagedBatch(
        kv=kv.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys=[k.to(device) for k in keys],
        values=[v.to(device) for v in values],
    )


def cu_seqlens(q_lens: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """[B+1] int32 prefix sums of q_lens."""
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)
