"""Building blocks shared by the decoder (model.py), its attention variants (mla.py) and MoE:
the RMSNorm in transformers' rounding order, the Linear every projection is (and its row-parallel
form for tensor parallelism), and YaRN's attention temperature (RoPE and MLA's softmax scale both
use it). A Linear multiplies through kernels.linear: cuBLAS, except one row of activations in a
CUDA graph (batch-1 decode), which a Triton GEMV reads faster (kernels/matvec.py).

They hold weights and call kernels; they never know which model they sit in.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tierkv import kernels

from .parallel import TensorParallel


class RMSNorm(nn.Module):
    """`unit_offset`: Gemma's norm, whose checkpoint holds w and which scales by (1 + w) in fp32
    before the cast back (Llama casts first), as transformers' Gemma3RMSNorm does."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual) in one kernel.

        Normalised in fp32 and cast back before the weight, in the same order as transformers,
        so bf16 results round the same way (on CPU exactly; the GPU kernel sums in another order).
        """
        return kernels.rms_norm(x, self.weight, self.eps, residual, unit_offset=self.unit_offset)


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) whose product is kernels.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A Linear whose input features are split over the ranks (o_proj, down_proj): each rank
    multiplies its slice, one all-reduce sums the partials, and only then is the bias (whole on
    every rank) added, so that it counts once and not `size` times."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().forward(x)
        out = self.tp.all_reduce(kernels.linear(x, self.weight))  # [T, out], summed over the ranks
        return out if self.bias is None else out + self.bias


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
