"""L1: the paged KV pool in device memory, allocated once.

    kv: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]

Layer-first, so each layer's view `kv[layer]` is one contiguous paged cache the attention
kernels index through block tables. This file owns memory and free slots, never policy.
"""

from __future__ import annotations

import torch

from ..layout import KVLayout
from .pool import FreeSlots, check_fits


class DevicePool:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        check_fits(num_blocks * layout.bytes_per_block, self.device, "CacheConfig.l1")
        shape = (layout.num_layers, num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.kv = torch.empty(shape, dtype=layout.dtype, device=self.device)
        self.free = FreeSlots(num_blocks)

    def layer(self, i: int) -> torch.Tensor:
        """[num_blocks, 2, block_size, kv_heads, head_dim] view of layer i."""
        return self.kv[i]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
