"""EngineBlocks: L1 when the engine owns it (its block manager, its buffers, maybe in another process).

tierkv then keeps L2 and L3 only. It never holds, frees or reads an L1 block: the engine gives
the block ids (`allocate(..., slots=)`, `append(..., slots=)`), and the L1<->L2 copies are
recorded for the engine to run on its buffers (recorded_moves.EngineMover). This record stands where
the DevicePool would, with the little the cache reads of one: no blocks of tierkv's own, and the
format the engine's pages hold, which names the blocks (Admission.namespace). It owns nothing.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..layout import KVLayout
from .pool import FreeSlots


class EngineBlocks:
    kv = None  # no memory here (streamed attention reads tierkv's own pool only)
    planes = None
    num_blocks = 0  # L1 blocks tierkv holds: none
    device = torch.device("cpu")

    def __init__(self, layout: KVLayout, engine_blocks: int, kv_format: str = "") -> None:
        """`engine_blocks`: how many blocks the engine has (block ids are 0..engine_blocks-1).
        `kv_format`: what the engine's pages hold when it is not tierkv's canonical K and V per
        token and head (e.g. vLLM's CPU pages, whose K is packed for the CPU's vector unit): blocks
        of another format are named apart, so they are never read back as this one."""
        if not isinstance(engine_blocks, int) or engine_blocks <= 0:
            raise ConfigError(f"engine_blocks must be the engine's number of KV blocks (> 0), got {engine_blocks!r}")
        self.layout, self.engine_blocks = layout, engine_blocks
        self.unconfirmed = f"-{kv_format}" if kv_format else ""
        self.free = FreeSlots(0)

    def release(self) -> None:
        pass  # nothing claimed
