"""L2: the host KV pool, allocated once, pinned when a GPU is there to copy to.

    kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

Block-first: a block is one contiguous run of bytes, so L2<->L3 is a single read or write and
neighbouring slots form long DMA transfers. This file owns memory and free slots, never policy.
"""

from __future__ import annotations

import logging

import torch

from ..layout import KVLayout
from .pool import FreeSlots, check_fits, gib

log = logging.getLogger(__name__)


class HostPool:
    def __init__(self, layout: KVLayout, num_blocks: int, pin: bool | None = None) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        nbytes = num_blocks * layout.bytes_per_block
        check_fits(nbytes, torch.device("cpu"), "CacheConfig.l2")
        if pin is None:
            pin = torch.cuda.is_available()
        shape = (num_blocks, *layout.block_shape)
        try:
            self.kv = torch.empty(shape, dtype=layout.dtype, pin_memory=pin and num_blocks > 0)
        except RuntimeError as err:  # the OS refused to lock that much memory
            log.warning("could not pin %s for L2 (%s); using pageable memory, copies will be slower", gib(nbytes), err)
            self.kv = torch.empty(shape, dtype=layout.dtype)
        self.pinned = self.kv.is_pinned() if num_blocks else False
        self.free = FreeSlots(num_blocks)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
