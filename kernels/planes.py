"""PlaneTable: any paged KV layout seen as P = 2 * layers "planes" of one geometry.

Plane 2*l + c is K (c=0) or V (c=1) of layer l: a view [N, block_size, kv_heads, head_dim] with a
dense last axis and free (but shared) other strides, so tierkv's pools, vLLM's and FlashInfer's
per-layer tensors and block-first storage all describe themselves the same way, and one kernel
(copy_planes) moves blocks between any two of them. This file describes memory only: it must
never copy data or import triton (CPU installs may lack it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _checks

# the integer type a kernel moves an element as: copies move bits, never values
WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_ALIGN = 16  # bytes: what a vectorised load can use; more says nothing further


class PlaneTable:
    """A list of plane views of one geometry, with their base addresses on the device the copy
    kernel runs on. Build one per buffer, once, and reuse it: construction reads every plane's
    metadata (and, for pinned host planes addressed from a GPU, asks CUDA whether they are
    pinned); copies then only read the cached fields below.

    planes: P views [N, block_size, kv_heads, head_dim], one dtype, shape and strides, last axis
            dense; they may come from separate allocations (one tensor per layer).
    device: where the kernel that addresses them runs. Default: the planes' device. Pinned host
            planes take device="cuda": the GPU reads and writes them through unified virtual
            addressing, so their pointer table lives on the GPU (`host` says so: a copy to or
            from them crosses PCIe).
    """

    __slots__ = (
        "planes", "device", "host", "ptrs", "num_blocks", "block_size", "num_heads", "head_dim",
        "strides", "dtype", "element_size", "word_dtype", "dense", "align",
    )

    def __init__(self, planes: Sequence[torch.Tensor], device: str | torch.device | None = None):
        planes = tuple(planes)
        self.device = _checks.check_plane_views(planes, device)
        first = planes[0]
        self.planes = planes
        self.host = first.device.type == "cpu" and self.device.type == "cuda"
        self.num_blocks, self.block_size, self.num_heads, self.head_dim = first.shape
        # elements between consecutive blocks, tokens, heads; the last axis is dense
        self.strides: tuple[int, int, int] = tuple(first.stride()[:3])
        self.dtype = first.dtype
        self.element_size = first.element_size()
        self.word_dtype = WORD_DTYPES[self.element_size]
        # one contiguous run of bs * H * D elements per block: the kernel's fast path
        self.dense = _dense(self.block_size, self.num_heads, self.head_dim, self.strides)
        self.align = _alignment(planes, self.element_size)
        # [P] int64 base addresses (a view's data_ptr includes its storage offset)
        self.ptrs = torch.tensor([p.data_ptr() for p in planes], dtype=torch.int64, device=self.device)

    @property
    def num_planes(self) -> int:
        return len(self.planes)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """(block_size, kv_heads, head_dim): what both sides of a copy must agree on."""
        return self.block_size, self.num_heads, self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane."""
        return self.block_size * self.num_heads * self.head_dim * self.element_size

    def __repr__(self) -> str:
        return (f"PlaneTable({self.num_planes} planes of [{self.num_blocks}, {self.block_size}, "
                f"{self.num_heads}, {self.head_dim}] {self.dtype}, strides {self.strides}, "
                f"{'dense' if self.dense else 'strided'} blocks, on {self.device})")


def _dense(bs: int, h: int, d: int, strides: tuple[int, int, int]) -> bool:
    """True when a block's bs x H x D elements are one row-major run (axes of size 1 never move)."""
    _, s_tok, s_head = strides
    return (bs == 1 or s_tok == h * d) and (h == 1 or s_head == d)


def _alignment(planes: tuple[torch.Tensor, ...], elt: int) -> int:
    """The largest power of two (<= 16 bytes) dividing every plane's base address: what the kernel
    may promise the compiler about them (Triton learns the strides' divisibility by itself)."""
    align = _MAX_ALIGN
    for value in (p.data_ptr() for p in planes):
        while value % align:
            align //= 2
    return max(align, elt)
