"""What the L1 and L2 pools share: a free list of fixed-size slots and the memory check.

Slots are handed out from a stack, lowest index first, so that blocks allocated together tend
to be neighbours (long contiguous copies). Nothing here allocates on the hot path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import CacheFullError, ConfigError, OutOfMemoryError
from ..host_memory import host_available_bytes


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class FreeSlots:
    """The free slot numbers of a pool of `capacity` slots."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._stack = list(range(capacity - 1, -1, -1))  # pop() yields 0, 1, 2, ...

    def __len__(self) -> int:
        return len(self._stack)

    def take(self, n: int) -> list[int]:
        if n > len(self._stack):
            raise CacheFullError(f"asked for {n} free slots, {len(self._stack)} are free")
        if n == 0:
            return []
        taken = self._stack[-n:]
        del self._stack[-n:]
        # ascending: slots given back in reverse (an LRU evicts a sequence tail first) still form
        # runs of neighbours, which a move copies in one DMA each
        taken.sort()
        return taken

    def give(self, slots: list[int]) -> None:
        # Pushed in reverse so that the next take() hands them out in their original order.
        self._stack.extend(reversed(slots))

    def take_oldest(self, n: int, accept: Callable[[int], bool]) -> list[int]:
        """Up to `n` slots for which `accept(slot)` holds, the longest free first (the bottom of
        the stack); the scan stops once it has them."""
        taken, scanned = [], 0
        for slot in self._stack:
            if len(taken) == n:
                break
            scanned += 1
            if accept(slot):
                taken.append(slot)
        if taken:
            chosen = set(taken)
            self._stack[:scanned] = [s for s in self._stack[:scanned] if s not in chosen]
        return taken


def blocks_for(nbytes: int, bytes_per_block: int, field_name: str) -> int:
    """How many whole blocks fit in `nbytes`; a non-zero size too small for one block is an error."""
    n = nbytes // bytes_per_block
    if nbytes > 0 and n == 0:
        raise ConfigError(
            f"{field_name} = {nbytes} bytes holds no block: one block takes {bytes_per_block} bytes; "
            f"raise {field_name} to at least {bytes_per_block}"
        )
    return n


def check_fits(nbytes: int, device: torch.device, field_name: str) -> None:
    """Fail before allocating when `device` cannot hold `nbytes`, with both sizes in the message."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        where = f"{device} has {gib(free)} free of {gib(total)}"
    else:
        free = host_available_bytes()
        where = f"this host has {gib(free)} available"
    if nbytes > free:
        raise OutOfMemoryError(f"{field_name} asks for {gib(nbytes)} but {where}; lower {field_name}")
