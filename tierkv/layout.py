"""KVLayout: the shape of one KV block, shared by every tier, kernel and hash namespace.

A block is `block_size` tokens of K and V for all layers. In L2/L3 a block is stored with all
its layers contiguous: `[num_layers, 2, block_size, num_kv_heads, head_dim]`. This file only
describes shapes; it never allocates memory.

Layers fall into groups by what attention reads of them (`KVLayout.groups`): full-attention
layers read every token before the query, a sliding-window layer only its last `window` tokens.
A hit therefore needs the window layers of its last blocks only (`KVLayout.window_start`), and
the cache loads the older blocks' full-attention layers alone. A multi-head latent attention
model (DeepSeek) keeps one latent per token instead of per-head K and V (`latent=True`).

With `CacheConfig.kv_offload_dtype` set, L2 and L3 hold blocks in another format than L1's:
`OffloadLayout` describes it (fp8 values plus per-head scales, packed into one run of bytes).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace

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
class LayerGroup:
    """Layers whose attention reads the same part of the prefix: with `window` W, a query at
    position p reads the keys at positions > p - W (its last W tokens, itself included); with
    None, every key up to p."""

    layers: tuple[int, ...]
    window: int | None = None


def group_tag(index: int, window: int | None) -> str:
    """The name of KV-cache group `index` (with sliding window `window`, None for full attention),
    which sets its blocks apart in L2 and L3: `g<index>` or `g<index>w<window>`, as vLLM numbers
    its groups. Two groups of equal shape hold different layers, so their blocks must never meet."""
    return f"g{index}" + (f"w{window}" if window else "")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one KV block.

    windows: each layer's sliding window in tokens, None for full attention; () means every
        layer attends fully. Windows change what a hit must load, never the block's bytes, so
        they are not part of the fingerprint.
    latent: each token holds one multi-head latent attention (MLA) vector of 2 * head_dim values
        (kv_lora_rank + rope dims) rather than K and V: its first half in the K plane, its second
        in the V plane, with num_kv_heads 1. The latent is the same on every tensor-parallel rank,
        so its blocks are too.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    windows: tuple[int | None, ...] = ()
    latent: bool = False

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
        windows = tuple(self.windows)
        if windows and (len(windows) != self.num_layers
                        or any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0)
                               for w in windows)):
            raise ConfigError(f"KVLayout.windows must give each of the {self.num_layers} layers a window "
                              f"(an int > 0) or None for full attention, got {self.windows!r}")
        # all-full is stored as (): equal layouts compare equal however they were written
        object.__setattr__(self, "windows", windows if any(w is not None for w in windows) else ())
        if self.latent and self.num_kv_heads != 1:
            raise ConfigError(f"KVLayout(latent=True) holds one latent per token: num_kv_heads must be 1, "
                              f"got {self.num_kv_heads}")

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layers grouped by window: full attention first, then windows from small to large."""
        windows = self.windows or (None,) * self.num_layers
        keys = sorted(set(windows), key=lambda w: -1 if w is None else w)
        return tuple(LayerGroup(tuple(i for i, w in enumerate(windows) if w == k), k) for k in keys)

    def of_group(self, group: LayerGroup) -> KVLayout:
        """The layout of `group`'s layers alone, for a cache that holds only them (groups.py)."""
        n = len(group.layers)
        return replace(self, num_layers=n, windows=(group.window,) * n if group.window else ())

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The layers that attend to the whole prefix (all of them without windows)."""
        return tuple(range(self.num_layers)) if not self.windows else \
            tuple(i for i, w in enumerate(self.windows) if w is None)

    def window_start(self, first_query: int) -> int:
        """The first block that some window layer still reads once queries start at position
        `first_query` (later queries read later keys): blocks before it need only `full_layers`.
        0 without windows (every layer reads every block)."""
        if not self.windows:
            return 0
        widest = max(w for w in self.windows if w is not None)
        # the query at first_query reads keys > first_query - widest
        return max(0, first_query - widest + 1) // self.block_size

    @property
    def widest_window(self) -> int | None:
        """The widest window when every layer is windowed; None while some layer attends fully."""
        return None if not self.windows or None in self.windows else max(self.windows)

    def first_block_read(self, first_query: int) -> int:
        """The first block any layer still reads once queries start at position `first_query`:
        a sequence may let go of the blocks before it (PagedCache.release). 0 while some layer
        attends fully; with every layer windowed, the widest window's start. (Asked for every
        running sequence each step: it builds nothing.)"""
        return 0 if self.widest_window is None else self.window_start(first_query)

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
            f"-{self.dtype_name}-B{self.block_size}{'-mla' if self.latent else ''}"
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
