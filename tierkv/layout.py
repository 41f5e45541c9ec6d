"""KVLayout: the shape of one KV block, shared by every tier, kernel and hash namespace.

A block is `block_size` tokens of K and V for all layers. In L2/L3 a block is stored with all
its layers contiguous: `[num_layers, 2, block_size, num_kv_heads, head_dim]`. This file only
describes shapes; it never allocates memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive int, got {value!r}")
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
