"""Triton silu_mul and gelu_tanh_mul: a decoder MLP's gated activation, act(gate) * up, on the
fused gate_up GEMM output (SwiGLU; Gemma's GeGLU with the tanh GELU).

gate_up [T, 2 * I] holds gate in its first I columns and up in the last I (MLP.gate_up_proj).
Rounds in transformers' order: the activation in fp32 rounded to the dtype, then the product
(exact in fp32) rounded once; only the fp32 exp can differ from torch's, by a few fp32 ulps, so
a result is at most 1 ulp of the dtype from the reference. This file must never write gate_up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._launch import check_triton_device

BLOCK_I = 1024


@triton.jit
def _act_mul_kernel(GateUp, Out, stride_t, stride_i, inter, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr):
    # program (t, c): columns [c * BLOCK, (c + 1) * BLOCK) of row t; Out is contiguous [T, I]
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = GateUp + t * stride_t
    gate = tl.load(row + offs * stride_i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + (offs + inter) * stride_i, mask=mask, other=0.0)
    if GELU_TANH:
        # 0.5 g (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3), written as g * sigmoid(2y): the same
        # function without the cancellation in 1 + tanh(y) for negative g (torch's own formula loses
        # bits there; the test compares roundings where it does not)
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = (gate / (1.0 + tl.exp(-2.0 * y))).to(up.dtype)
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)             # F.silu, rounded to the dtype
    out = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)      # then `* up`, rounded once
    tl.store(Out + t * inter + offs, out, mask=mask)


def _act_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    tokens, inter = _checks.check_silu_mul(gate_up)
    check_triton_device(gate_up)
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    _act_mul_kernel[(tokens, triton.cdiv(inter, BLOCK_I))](
        gate_up, out, gate_up.stride(0), gate_up.stride(1), inter, BLOCK=BLOCK_I, GELU_TANH=gelu_tanh, num_warps=4,
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (rows may be strided) -> silu(gate) * up, a new contiguous [T, I]."""
    return _act_mul(gate_up, gelu_tanh=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (rows may be strided) -> gelu_tanh(gate) * up, a new contiguous [T, I]."""
    return _act_mul(gate_up, gelu_tanh=True)
