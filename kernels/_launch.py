"""Launch helpers shared by the Triton kernel modules: device facts, tile-size arithmetic and the
buffers a launch needs beside its inputs (split partials, ticket counters).

Holds no kernels. Must never import triton.language or launch a Triton kernel itself, so that the
kernel modules stay the only place where a kernel is defined.
"""

from __future__ import annotations

import functools
import os

import torch

import triton

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small fixed number under the interpreter (CPU)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def dependent_launch(device: torch.device) -> bool:
    """Whether a kernel on `device` may be launched before the one ahead of it ends (programmatic
    dependent launch: Hopper and later, never under the interpreter). Such a kernel waits for its
    predecessor (gdc_wait) before it reads anything; only its launch overlaps."""
    return device.type == "cuda" and not INTERPRETING and torch.cuda.get_device_capability(device)[0] >= 9


def pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(max(1, n)))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to tf32 (10-bit mantissa); fp16/bf16 ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Triton kernels run on CUDA, or on CPU only under TRITON_INTERPRET=1."""
    from .errors import ShapeError

    for t in tensors:
        if t.device.type != "cuda" and not INTERPRETING:
            raise ShapeError(
                f"the Triton kernels need CUDA tensors, got one on {t.device}; "
                "use tierkv.kernels (which picks the reference on CPU) or set TRITON_INTERPRET=1"
            )


def split_partials(out: torch.Tensor, rows: int, heads: int, splits: int, width: int):
    """Buffers of a split-KV attention launch: (part [rows, heads, splits, width] fp32, lse [rows,
    heads, splits] fp32, part's first three strides, lse's first two). With one split the kernel
    writes `out` directly: the placeholders are then `out` with zero strides."""
    if splits == 1:
        return out, out, (0, 0, 0), (0, 0)
    part = torch.empty(rows, heads, splits, width, dtype=torch.float32, device=out.device)
    lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=out.device)
    return part, lse, part.stride()[:3], lse.stride()[:2]


TICKETS = 4096  # ticket counters per (device, stream): a split launch of more (sequence, kv head) pairs never steals
_tickets: dict[tuple, torch.Tensor] = {}


def ticket_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """Zeroed int32 counters [TICKETS] on `device` for the current stream, kept across calls: a
    kernel that takes tickets from them leaves them zero when it ends. One set per stream, so two
    launches running at once never share one; a CUDA graph keeps the set of the stream it was
    captured on, so two graphs replayed at once on different streams must have been captured on
    different streams. None where `count` of them would not fit."""
    if count > TICKETS:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    counters = _tickets.get(key)
    if counters is None:
        # made once per stream; inside a CUDA graph's capture the zeroing is captured too, harmless
        counters = _tickets[key] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return counters
