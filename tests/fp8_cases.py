"""Inputs shared by the fp8 kernel tests (GPU and Triton interpreter)."""

from __future__ import annotations

import torch


def rounding_sweep(logspace_points: int) -> torch.Tensor:
    """Blocks [n, 1, 2, 16, 1, 128] fp32 holding every fp8 value, every midpoint between
    neighbours and one fp32 step either side of it (ties go to even), `logspace_points` values
    down to fp8's subnormals and below, both signs; a 448 opens each head, so its scale is exactly
    1 and quantising must give torch's own cast of the values."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[torch.isfinite(codes) & (codes >= 0)].sort().values
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    sweep = torch.cat([values, mids, up, down, torch.logspace(-14, 2.65, logspace_points),
                       torch.tensor([2**-10, 1e-30, 0.0])])
    sweep = sweep[sweep <= 448]
    sweep = torch.cat([sweep, -sweep])
    per = 16 * 128 - 1  # one head of one block, less the 448
    n = -(-sweep.numel() // per)
    x = torch.zeros(n * per)
    x[: sweep.numel()] = sweep
    x = torch.cat([torch.full((n, 1), 448.0), x.view(n, per)], 1).view(n, 1, 1, 16, 1, 128)
    return x.expand(n, 1, 2, 16, 1, 128).contiguous()
