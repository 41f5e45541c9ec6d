"""Plain-torch kernels: the ground truth for tests and the implementation used on CPU.

Each function here has the same signature as its Triton counterpart in this package. They favour
clarity over speed and must never depend on anything outside torch.
"""

from __future__ import annotations

import torch


def gather_blocks(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy blocks out of a layer-first pool into block-first contiguous storage.

    pool:  [layers, num_slots, 2, block_size, kv_heads, head_dim]  (the L1 pool)
    slots: [n] int64, the pool slots to read, in order
    out:   [n, layers, 2, block_size, kv_heads, head_dim]          (staging / L2 layout)
    """
    out.copy_(pool.index_select(1, slots).transpose(0, 1))
    return out


def scatter_blocks(src: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The inverse of gather_blocks: write block-first `src` [n, layers, ...] into pool slots."""
    pool.index_copy_(1, slots, src.transpose(0, 1))
    return pool
