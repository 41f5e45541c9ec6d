"""KVLayout: the shape of one KV block, shared by every tier, kernel and hash namespace.

A block is `block_size` tokens of K and V for all layers. In L2/L3 a block is stored with all
its layers contiguous: `[num_layers, 2, block_size, num_kv_heads, head_dim]`. This file only
describes shapes; it never allocates memory.

With `CacheConfig.kv_offload_dtype` set, L2 and L3 hold blocks in another format than L1's:
`OffloadLayout` describes it (fp8 values plus per-head scales, packed into one run of bytes).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from .config import check_offload_dtype
from .errors import ConfigError

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            try:  # any integer type (numpy's, a config's) counts, stored as a plain int; bool does not
                number = operator.index(value)
            except TypeError:
                number = None
            if number is None or isinstance(value, bool) or number <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, number)
        if self.dtype not in _DTYPE_NAMES:
            accepted = ", ".join(f"torch.{n}" for n in _DTYPE_NAMES.values())
            raise ConfigError(f"KVLayout.dtype {self.dtype!r} is not supported; use one of {accepted}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block as L2/L3 hold it: [layers, 2 (K,V), block_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.dtype]

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def fingerprint(self) -> str:
        """A stable string naming this layout; equal layouts give equal strings on any machine."""
        return (
            f"kv1-L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}"
            f"-{self.dtype_name}-B{self.block_size}"
        )

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the KV of `num_tokens` consecutive tokens, as `store` takes and `retrieve` returns."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_storage(self) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one block in an L2 pool of this layout: the block itself."""
        return self.block_shape, self.dtype


# config.KV_OFFLOAD_DTYPES names -> the torch dtype L2/L3 hold the values in
OFFLOAD_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True, slots=True)
class OffloadLayout:
    """One block as L2 and L3 hold it when they store fp8: `kv` (the L1 layout) quantised.

    A block is one run of `bytes_per_block` bytes, each part starting 16-byte aligned:

        payload  [layers, 2, block_size, kv_heads, head_dim] float8_e4m3fn
        scales   [layers, 2, kv_heads] float32

    "Per block, per head": one scale for each (layer, K or V, kv head) of the block, over its
    block_size tokens x head_dim values (scale = amax / 448, so the largest value maps to fp8's
    largest). Finer (per token) would cost block_size times the scale bytes for little gain at
    16 tokens; coarser (per layer) lets one outlier head flatten the others. The scales add
    4 / (block_size * head_dim) to the payload: 0.2% at 16 x 128, so L2 holds ~2x the blocks of
    a bf16 one (4x of fp32). Stores and L2 see only bytes_per_block, block_size and the
    fingerprint, which names the format, so a bf16 reader never takes an fp8 object, or back.
    """

    kv: KVLayout
    offload_dtype: str = "fp8_e4m3"

    def __post_init__(self) -> None:
        check_offload_dtype(self.offload_dtype)
        if self.offload_dtype is None:
            raise ConfigError("OffloadLayout needs a kv_offload_dtype; for the model's dtype use the KVLayout itself")

    @property
    def dtype(self) -> torch.dtype:
        return OFFLOAD_DTYPES[self.offload_dtype]

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def values_bytes(self) -> int:
        """Bytes of the fp8 values of one block."""
        return math.prod(self.kv.block_shape) * self.dtype.itemsize

    @property
    def payload_bytes(self) -> int:
        """values_bytes rounded up to 16: where the scales start."""
        return _aligned(self.values_bytes)

    @property
    def scales_shape(self) -> tuple[int, int, int]:
        return (self.kv.num_layers, 2, self.kv.num_kv_heads)

    @property
    def scales_bytes(self) -> int:
        return math.prod(self.scales_shape) * 4  # fp32

    @property
    def bytes_per_block(self) -> int:
        return self.payload_bytes + _aligned(self.scales_bytes)

    @property
    def fingerprint(self) -> str:
        """The L1 layout's fingerprint and the stored format: `...-B16-fp8_e4m3-sLKH` (scales per
        layer, K/V and head)."""
        return f"{self.kv.fingerprint}-{self.offload_dtype}-sLKH"

    @property
    def block_storage(self) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one block in an L2 pool of this layout: its bytes."""
        return (self.bytes_per_block,), torch.uint8

    def payload(self, rows: torch.Tensor) -> torch.Tensor:
        """The fp8 values in packed blocks rows [n, bytes_per_block] uint8: a view
        [n, layers, 2, block_size, kv_heads, head_dim] (rows may be pinned host or device)."""
        return rows[:, : self.values_bytes].view(self.dtype).view(rows.shape[0], *self.kv.block_shape)

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """The scales in packed blocks rows [n, bytes_per_block] uint8: a view [n, layers, 2, kv_heads] fp32."""
        start = self.payload_bytes
        return rows[:, start : start + self.scales_bytes].view(torch.float32).view(rows.shape[0], *self.scales_shape)


def _aligned(n: int) -> int:
    """`n` bytes rounded up to 16: each part of a packed block starts 16-byte aligned."""
    return -(-n // 16) * 16


def stored_layout(kv: KVLayout, offload_dtype: str | None) -> KVLayout | OffloadLayout:
    """How L2 and L3 hold blocks of `kv`: as L1 does (None), or in the offload format named."""
    return kv if offload_dtype is None else OffloadLayout(kv, offload_dtype)
