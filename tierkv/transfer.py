"""Moves blocks between L1 (device pool) and L2 (host pool).

On CUDA every move runs on one dedicated copy stream, so moves never block the compute stream
and are ordered among themselves (a slot written by one move and read by a later one needs no
extra sync). L1 blocks are gathered into a device staging buffer by one kernel, then copied to
host as one DMA per run of neighbouring L2 slots (and the reverse for loads). On CPU a move is
a plain copy that is done on return. This file decides nothing about which blocks move.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from . import kernels
from .tiers import DevicePool, HostPool

STAGING_BYTES = 256 * 2**20  # device staging buffer: big enough for full-speed DMA, small next to L1


class Transfer:
    """A batch of copies in flight; `wait()` orders the current stream after it without blocking the host."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Make the current CUDA stream wait for this transfer (no host sync)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        """Block the calling thread until the copies are complete (needed before the CPU reads L2)."""
        if self.event is not None:
            self.event.synchronize()


DONE = Transfer()


def runs(slots: list[int]) -> Iterator[tuple[int, int, int]]:
    """Split `slots` into runs of consecutive numbers: yields (position in slots, first slot, length)."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, slots[start], i - start
            start = i


class BlockMover:
    def __init__(self, l1: DevicePool, l2: HostPool) -> None:
        self.l1, self.l2 = l1, l2
        self.device = l1.device
        self.cuda = self.device.type == "cuda"
        self.last = DONE  # the most recent move; every earlier one is complete when it is
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            n = max(1, min(l1.num_blocks, STAGING_BYTES // l1.layout.bytes_per_block))
            self.staging = torch.empty((n, *l1.layout.block_shape), dtype=l1.layout.dtype, device=self.device)

    def _index(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def l1_to_l2(self, l1_slots: list[int], l2_slots: list[int]) -> Transfer:
        """Copy L1 blocks `l1_slots` into L2 slots `l2_slots` (same length)."""
        assert len(l1_slots) == len(l2_slots)
        if not l1_slots:
            return DONE
        if not self.cuda:
            # [layers, n, 2, bs, h, d] -> [n, layers, 2, bs, h, d]
            self.l2.kv[torch.tensor(l2_slots)] = self.l1.kv[:, torch.tensor(l1_slots)].transpose(0, 1)
            return DONE
        return self._on_stream(self._d2h, l1_slots, l2_slots)

    def l2_to_l1(self, l2_slots: list[int], l1_slots: list[int]) -> Transfer:
        """Copy L2 blocks `l2_slots` into L1 slots `l1_slots` (same length)."""
        assert len(l1_slots) == len(l2_slots)
        if not l1_slots:
            return DONE
        if not self.cuda:
            self.l1.kv[:, torch.tensor(l1_slots)] = self.l2.kv[torch.tensor(l2_slots)].transpose(0, 1)
            return DONE
        return self._on_stream(self._h2d, l2_slots, l1_slots)

    def read_l2(self, l2_slots: list[int]) -> torch.Tensor:
        """L2 blocks copied to the L1 device: [n, layers, 2, bs, h, d]. Ordered after earlier moves."""
        if not self.cuda:
            return self.l2.kv.index_select(0, torch.tensor(l2_slots, dtype=torch.int64))
        out = torch.empty((len(l2_slots), *self.l1.layout.block_shape), dtype=self.l1.layout.dtype, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for pos, first, n in runs(l2_slots):
                out[pos : pos + n].copy_(self.l2.kv[first : first + n], non_blocking=True)
            out.record_stream(torch.cuda.current_stream(self.device))
        event = torch.cuda.Event()
        event.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        return out

    def fence(self) -> None:
        """Make the current stream wait for every move issued so far (before reusing an evicted L1 slot)."""
        self.last.wait()

    def _on_stream(self, chunk_fn, src: list[int], dst: list[int]) -> Transfer:
        # The copy stream must see everything the compute stream wrote to these blocks so far,
        # and must not overwrite an L1 slot the compute stream may still be reading.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        cap = self.staging.shape[0]
        with torch.cuda.stream(self.stream):
            for i in range(0, len(src), cap):
                chunk_fn(src[i : i + cap], dst[i : i + cap])
        event = torch.cuda.Event()
        event.record(self.stream)
        self.last = Transfer(event)
        return self.last

    def _d2h(self, l1_slots: list[int], l2_slots: list[int]) -> None:
        staged = self.staging[: len(l1_slots)]
        kernels.gather_blocks(self.l1.kv, self._index(l1_slots), staged)
        for pos, first, n in runs(l2_slots):
            self.l2.kv[first : first + n].copy_(staged[pos : pos + n], non_blocking=True)

    def _h2d(self, l2_slots: list[int], l1_slots: list[int]) -> None:
        staged = self.staging[: len(l1_slots)]
        for pos, first, n in runs(l2_slots):
            staged[pos : pos + n].copy_(self.l2.kv[first : first + n], non_blocking=True)
        kernels.scatter_blocks(staged, self.l1.kv, self._index(l1_slots))
