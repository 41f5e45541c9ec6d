"""IndexRing: slot lists (int64) staged in one page-locked host buffer for asynchronous copies to
the GPU, so that issuing a move never allocates pinned memory.

A move's kernels read its slot lists from device memory, copied there without a host sync: a copy
from pageable memory would wait for the copy stream to drain. `tensor.pin_memory()` per list did
that, but torch's caching host allocator reuses a pinned block only once every copy queued before
its release has run, so with loads queued deep it page-locked fresh memory (cudaHostAlloc, up to
8 ms a call on an H100 in bench_rounds' trace). Here each list takes the next stretch of one ring,
and a stretch is written again only after the copy that read it has run: copies on one stream
finish in order, so the host waits (rarely, with a ring far larger than the lists in flight) only
for the oldest ones it is about to overwrite.

Holds no tier state and knows nothing of blocks; never reads the device.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

RING_SLOTS = 1 << 20  # 8 MiB of int64: ~1000 moves of a 8K-token prompt's two slot lists in flight


class IndexRing:
    def __init__(self, device: torch.device, capacity: int = RING_SLOTS) -> None:
        self.device = device
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)  # [capacity]
        self.view = self.host.numpy()
        self.capacity = capacity
        self.cursor = 0
        # (start, end, event after the copy out of host[start:end]) of copies not known to be done, oldest first
        self.pending: deque[tuple[int, int, torch.cuda.Event]] = deque()
        self.lock = threading.Lock()  # the cache's calls are serialised, but a stretch must never be given twice

    def to_device(self, slots, stream: torch.cuda.Stream) -> torch.Tensor:
        """`slots` (a list or range of ints) as an int64 device tensor [len(slots)], copied on
        `stream` and allocated from its pool (the caller records it on any other stream that reads it)."""
        n = len(slots)
        if n > self.capacity // 4:  # a list this long is rare enough to pin on its own
            with torch.cuda.stream(stream):
                return torch.tensor(slots, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        with self.lock:
            start = self.cursor if self.cursor + n <= self.capacity else 0
            end = start + n
            self._wait_for(start, end)
            self.view[start:end] = slots
            with torch.cuda.stream(stream):
                out = self.host[start:end].to(self.device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            self.pending.append((start, end, done))
            self.cursor = end
        return out

    def _wait_for(self, start: int, end: int) -> None:
        """Block until no copy still to run reads host[start:end]; forget the copies that ran."""
        self._forget_done()
        for s, e, done in self.pending:
            if s < end and start < e:
                done.synchronize()  # and so every copy issued before it, on the same stream
        self._forget_done()

    def _forget_done(self) -> None:
        """Drop the copies that ran. They ran in order (one stream), so the first still to run is
        found by bisection: with loads queued deep, hundreds of copies finish between two calls,
        and querying each took the engine's thread ~3 ms at a time (H200, bench_rounds at b964e45)."""
        lo, hi = 0, len(self.pending)  # the copies before lo ran; from hi on they have not
        while lo < hi:
            mid = (lo + hi) // 2
            if self.pending[mid][2].query():
                lo = mid + 1
            else:
                hi = mid
        for _ in range(lo):
            self.pending.popleft()
