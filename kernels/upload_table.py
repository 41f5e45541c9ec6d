"""UploadTable: host arrays paired once with the device buffers a step's inputs go to.

Each pair is a 1-D host array (pinned where the device is a GPU) and a device buffer of the same
dtype and length; `kernels.upload` copies a prefix of each, every array of a step in one launch.
The table holds, on the device, the arrays' addresses and the address of a pinned header of
per-array counts (int32 words) that the host writes before each upload and the kernel reads when
it runs: the launch's arguments never change with the step. This file describes memory only: it
must never copy data or import triton (CPU installs may lack it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import ShapeError


class UploadTable:
    """sources[i] (host) -> targets[i] (device), for i in order.

    sources: 1-D contiguous host tensors, pinned when the targets are on a GPU (the GPU reads them
             over PCIe through unified addressing); targets: 1-D contiguous tensors on one device,
             each of its source's dtype and at least its length. Element sizes must be multiples of
             4 bytes (the copy moves int32 words: int32, int64, float32).
    Build it once per set of host arrays and reuse it: construction copies the addresses to the
    device. The host arrays' first counts must not be rewritten until an upload that read them ran
    (the caller's double buffering, as for any copy from pinned memory).
    """

    __slots__ = ("sources", "targets", "device", "counts", "ptrs")

    def __init__(self, sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
        sources, targets = tuple(sources), tuple(targets)
        if not sources or len(sources) != len(targets):
            raise ShapeError(f"an UploadTable pairs each source with a target: got {len(sources)} sources "
                             f"and {len(targets)} targets")
        device = targets[0].device
        for i, (s, t) in enumerate(zip(sources, targets)):
            if s.dim() != 1 or t.dim() != 1 or not (s.is_contiguous() and t.is_contiguous()):
                raise ShapeError(f"pair {i}: sources and targets must be 1-D and contiguous, got {tuple(s.shape)} "
                                 f"and {tuple(t.shape)}")
            if s.dtype != t.dtype or s.element_size() % 4 or t.numel() < s.numel():
                raise ShapeError(f"pair {i}: a target needs its source's dtype (4 or 8 bytes an element) and at "
                                 f"least its length; got {s.dtype} [{s.numel()}] -> {t.dtype} [{t.numel()}]")
            if t.device != device or s.device.type != "cpu":
                raise ShapeError(f"pair {i}: sources live on the host and targets on one device, got {s.device} "
                                 f"-> {t.device} (first target on {device})")
            if device.type == "cuda" and not s.is_pinned():
                raise ShapeError(f"pair {i}: the GPU reads the source over PCIe, so it must be pinned memory")
        self.sources, self.targets, self.device = sources, targets, device
        # [n] int64 on the host: the int32 words each pair copies this time, read by the kernel as it runs
        self.counts = torch.zeros(len(sources), dtype=torch.int64, pin_memory=device.type == "cuda")
        addresses = [s.data_ptr() for s in sources] + [t.data_ptr() for t in targets] + [self.counts.data_ptr()]
        self.ptrs = torch.tensor(addresses, dtype=torch.int64).to(device)  # [2n + 1]: sources, targets, counts

    def __len__(self) -> int:
        return len(self.sources)

    def set_counts(self, counts: Sequence[int]) -> list[int]:
        """Write this upload's element counts (one per pair, at most its source's length) into the
        header as int32 words; returns them as elements."""
        if len(counts) != len(self.sources):
            raise ShapeError(f"upload takes a count per pair: {len(self.sources)} pairs, {len(counts)} counts")
        words = self.counts.numpy()
        for i, (n, s) in enumerate(zip(counts, self.sources)):
            if not 0 <= n <= s.numel():
                raise ShapeError(f"pair {i}: cannot upload {n} elements of a source of {s.numel()}")
            words[i] = n * (s.element_size() // 4)
        return list(counts)
