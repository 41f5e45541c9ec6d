"""MXFP4 expert weights (the hub's gpt-oss checkpoints) -> dense tensors in the model's dtype, at load.

openai/gpt-oss-20b and -120b store each MoE expert matrix as two tensors: `<name>_blocks` [E, rows,
G, 16] uint8, two 4-bit e2m1 values a byte (low nibble first) for G groups of 32 input features, and
`<name>_scales` [E, rows, G] uint8, each group's power-of-two scale as a biased exponent (2^(s - 127),
OCP MX's E8M0). The engine does not run MXFP4 experts: it dequantises them once, as the checkpoint is
read, into the model dtype (bf16 on the GPU), so a gpt-oss model takes the memory of its bf16 weights
(gpt-oss-20b ~42 GB; gpt-oss-120b does not fit one H200 and needs tensor parallelism). Values are
exactly transformers' (integrations/mxfp4.py convert_moe_packed_tensors). This file only converts
tensors it is handed; it never opens files.
"""

from __future__ import annotations

import torch

from tierkv.errors import ModelLoadError

# e2m1: sign, 2 exponent bits, 1 mantissa bit; index = the nibble
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SUFFIXES = ("_blocks", "_scales")


CHUNK_BYTES = 1 << 24  # packed bytes converted at a time: bounds the index temporaries (8 bytes a nibble)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., rows, G, B] uint8 and scales [..., rows, G] uint8 -> [..., rows, G * 2B] in dtype:
    each row's input features in order (transformers' gpt-oss layout is its transpose, [E, in, out])."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelLoadError(f"MXFP4 scales {tuple(scales.shape)} must be the blocks' shape {tuple(blocks.shape)} "
                             "less its last dim (one scale per 32 values)")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    width = blocks.shape[-1]
    packed = blocks.reshape(-1, width)                                       # [groups, B]
    exponents = scales.reshape(-1, 1, 1).to(torch.int32) - 127              # [groups, 1, 1]
    out = torch.empty(packed.shape[0], width, 2, dtype=dtype, device=blocks.device)
    step = max(1, CHUNK_BYTES // width)
    for start in range(0, packed.shape[0], step):
        part, values = packed[start : start + step], out[start : start + step]   # [n, B], [n, B, 2]
        values[..., 0] = lut[(part & 0x0F).long()]                           # low nibble: the even feature
        values[..., 1] = lut[(part >> 4).long()]
        # times 2^(s - 127), in dtype (ldexp, as transformers), so bf16 results round alike
        torch.ldexp(values, exponents[start : start + step], out=values)
    return out.view(*blocks.shape[:-2], blocks.shape[-2] * width * 2)


class Mxfp4Pairs:
    """Pairs each `<name>_blocks` with its `<name>_scales` as the loader reads them (they may sit in
    different shards) and hands back (name, dense tensor in transformers' [E, in, out] layout)
    once both are there; finish() fails naming any half left alone."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._halves: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def claims(name: str) -> bool:
        return ".mlp.experts." in name and name.endswith(SUFFIXES)

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        base, suffix = name[:-len("_blocks")], name[-len("_blocks"):]
        halves = self._halves.setdefault(base, {})
        halves[suffix] = tensor
        if len(halves) < 2:
            return None
        del self._halves[base]
        dense = dequantize(halves["_blocks"], halves["_scales"], self.dtype)   # [E, out, in]
        return base, dense.transpose(1, 2)                                   # [E, in, out], a view

    def finish(self) -> None:
        for base, halves in self._halves.items():
            missing = next(s for s in SUFFIXES if s not in halves)
            raise ModelLoadError(f"the checkpoint has {base}{next(iter(halves))} but not {base}{missing} "
                                 "(MXFP4 weights need both)")
