"""L1: the paged KV pool in device memory: tierkv's own, allocated once, or an engine's own buffers.

tierkv's layout (its own pool, and the one its engine's attention reads):

    kv: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]

Layer-first, so each layer's view `kv[layer]` is one contiguous paged cache the attention
kernels index through block tables. An engine may instead register the KV tensors it already
has (`DevicePool.of_buffers`), in one of KV_LAYOUTS; tierkv then moves blocks in and out of
them where they are. Every layout is seen the same way by the moves: `planes`, a PlaneTable of
2 * num_layers views [num_blocks, block_size, kv_heads, head_dim] (K and V of each layer).
A pool claims its memory for as long as it serves a cache: no two pools in a process hand out
blocks of the same bytes. This file owns memory, free slots and the layouts' shapes, never policy.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Mapping, Sequence

import torch

from .. import kernels
from ..errors import ConfigError
from ..kernels.planes import PlaneTable
from ..layout import KVLayout
from .pool import FreeSlots, check_fits

def _vllm_half(t: torch.Tensor, c: int) -> torch.Tensor:
    """K (c=0) or V (c=1) of a vLLM 0.32 page tensor [N, H, B, 2D] (any stride order: vLLM
    picks one per attention backend), whose last axis holds K then V: a view [N, B, H, D]."""
    d = t.shape[-1] // 2
    return t.transpose(1, 2)[..., c * d : (c + 1) * d]


def _vllm_cpu_half(t: torch.Tensor, c: int) -> torch.Tensor:
    """K or V of vLLM's CPU pages: the same [N, H, B, 2D] tensor, but each (block, head) page is
    [2B, D], K's B rows then V's (cpu_attn.py), and K's bytes are packed for the CPU's vector
    unit (so copied, never read as K here). A view [N, B, H, D] over those rows."""
    n, h, b, d2 = t.shape
    if t.stride(3) != 1 or t.stride(2) != d2:
        raise ConfigError(f"vLLM CPU KV pages must be contiguous [block_size, 2*head_dim] runs; got strides {t.stride()}")
    return t.view(n, h, 2, b, d2 // 2)[:, :, c].transpose(1, 2)


# The layouts an engine's KV buffers may have: the axes of one buffer (L layers, N blocks, 2 for
# K and V, B block_size, H kv heads, D head_dim, C both K and V: 2 * head_dim; one buffer per
# layer where there is no L), and plane(buffer, layer in it, c): K (c=0) or V (c=1) of that layer
# as a view [N, B, H, D]. "vllm" is older vLLM's per-layer [2, N, B, H, D]; "vllm_paged" is what
# vLLM 0.32 (the version tierkv's connector is tested with) registers on its CUDA backends
# (FlashAttention, FlashInfer), "vllm_cpu" on its CPU backend.
KV_LAYOUTS = {
    "tierkv": ("LN2BHD", lambda t, layer, c: t[layer, :, c]),
    "vllm": ("2NBHD", lambda t, layer, c: t[c]),
    "vllm_paged": ("NHBC", lambda t, layer, c: _vllm_half(t, c)),
    "vllm_cpu": ("NHBC", lambda t, layer, c: _vllm_cpu_half(t, c)),
    "flashinfer_nhd": ("N2BHD", lambda t, layer, c: t[:, c]),
    "flashinfer_hnd": ("N2HBD", lambda t, layer, c: t[:, c].transpose(1, 2)),
}
_AXIS_NAMES = {"L": "layers", "N": "N", "2": "2", "B": "block_size", "H": "kv_heads", "D": "head_dim",
               "C": "2*head_dim"}

# The memory each live pool hands out blocks of: (device, first byte, end byte, the pool). Two
# caches over one engine's buffers would each give block 0 to a sequence of their own and write
# over each other's KV. A claim ends with `release` (the cache's close) or with the pool itself
# (a weak reference: the pool keeps its buffers alive, so their memory is not reused before).
_claims: list[tuple[str, int, int, weakref.ref]] = []
_claims_lock = threading.Lock()


def describe_layout(kv_layout: str) -> str:
    """How one buffer of `kv_layout` looks, for messages."""
    axes = KV_LAYOUTS[kv_layout][0]
    count = "one tensor" if "L" in axes else "one tensor per layer"
    return f"{count} [{', '.join(_AXIS_NAMES[a] for a in axes)}]"


class DevicePool:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        """tierkv's own pool of `num_blocks` blocks on `device`."""
        device = torch.device(device)
        check_fits(num_blocks * layout.bytes_per_block, device, "CacheConfig.l1")
        shape = (layout.num_layers, num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self._adopt(layout, torch.empty(shape, dtype=layout.dtype, device=device), None, "tierkv")

    @classmethod
    def of_buffers(cls, layout: KVLayout, buffers, kv_layout: str, *, claim: bool = True) -> DevicePool:
        """An engine's own KV tensors as L1, in the layout `kv_layout` names (see KV_LAYOUTS):
        a tensor for "tierkv"; a list (or a dict in layer order, as vLLM's register_kv_caches
        gets) of one tensor per layer otherwise. Their shapes, dtype and device are checked
        against `layout`; their blocks' contents are the engine's. `claim=False`: the memory is
        claimed already, by a pool over all of it (vLLM's KV-cache groups are views of shared
        buffers, and one allocator hands out their block ids: a pool per group would clash)."""
        pool = cls.__new__(cls)
        if kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"kv_layout {kv_layout!r} is unknown; accepted: "
                              + "; ".join(f"{k!r} ({describe_layout(k)})" for k in KV_LAYOUTS))
        if kv_layout == "tierkv":
            kv = _checked([buffers] if isinstance(buffers, torch.Tensor) else buffers, layout, kv_layout)[0]
            pool._adopt(layout, kv, None, kv_layout, claim)
        else:
            layers = _checked(list(buffers.values()) if isinstance(buffers, Mapping) else buffers, layout, kv_layout)
            pool._adopt(layout, None, layers, kv_layout, claim)
        if layout.block_size == layout.num_kv_heads:
            # Token-major (NHD) and head-major (HND) buffers then have one shape: the declared
            # order cannot be checked, and a wrong one reads every block out transposed.
            order = "".join(a for a in KV_LAYOUTS[kv_layout][0] if a in "BH")
            pool.unconfirmed = f"-declared-{order}"
        return pool

    def _adopt(self, layout: KVLayout, kv: torch.Tensor | None, layers: list[torch.Tensor] | None,
               kv_layout: str, claim: bool = True) -> None:
        self.layout, self.kv_layout = layout, kv_layout
        # kv: the pool in tierkv's layout, which its attention kernels and streaming read; None
        # when an engine's buffers have another layout (only the moves below reach them)
        self.kv = kv
        self.layers = layers  # an engine's per-layer tensors, kept alive with the pool
        # What the shape checks could not confirm about an engine's buffers ("" when nothing): the
        # cache names its blocks by it (Admission.namespace), so KV read out of them the declared
        # way is shared, in L3 too, only with caches that read their buffers the same way.
        self.unconfirmed = ""
        planes = _planes(kv if kv is not None else layers, kv_layout, layout.num_layers)
        self.device = planes[0].device
        self.planes = PlaneTable(planes)  # [2 * layers] x [N, bs, H, D]
        self.num_blocks = self.planes.num_blocks
        if claim:
            self._claim([kv] if kv is not None else layers)
        if layout.windows:
            # A hit loads the window layers of its last blocks only (Admission.allocate): the
            # older blocks' window layers keep what the slot held, which attention reads masked
            # (a tile straddling the window's start). Zeros, then other sequences' KV, are finite
            # there; the bytes of a fresh allocation may be NaN, and 0 * NaN is not 0.
            for t in [kv] if kv is not None else layers:
                t.zero_()
        self.free = FreeSlots(self.num_blocks)

    def _claim(self, tensors: list[torch.Tensor]) -> None:
        """Claim the memory of `tensors` for this pool; ConfigError if a live pool holds any of it."""
        spans = [_span(t) for t in tensors]
        with _claims_lock:
            for first_try in (True, False):
                _claims[:] = [c for c in _claims if c[3]() is not None]
                clash = next((i for i, (dev, a, b) in enumerate(spans)
                              for other, c, d, _ in _claims if other == dev and a < d and c < b), None)
                if clash is None:
                    break
                if first_try:  # a cache dropped without close() may still wait in a reference cycle
                    gc.collect()
            else:
                raise ConfigError(f"KV buffer {clash} shares memory with the L1 of another TieredKVCache that is still "
                                  "open: two caches over the same buffers would both hand out block 0 and write over "
                                  "each other's KV. close() that cache first, or give this one buffers of its own")
            me = weakref.ref(self)
            _claims.extend((dev, a, b, me) for dev, a, b in spans)

    def release(self) -> None:
        """End this pool's claim on its memory (its cache is closed): another cache may use the buffers."""
        with _claims_lock:
            _claims[:] = [c for c in _claims if c[3]() is not self]

    def layer(self, i: int) -> torch.Tensor:
        """[num_blocks, 2, block_size, kv_heads, head_dim] view of layer i (tierkv's layout)."""
        return self.kv[i]

    def read(self, slots: list[int]) -> torch.Tensor:
        """Blocks `slots` copied out: [n, layers, 2, bs, h, d] on the pool's device, in the
        current stream's order (after what it wrote there)."""
        out = torch.empty((len(slots), *self.layout.block_shape), dtype=self.layout.dtype, device=self.device)
        kernels.copy_planes(self.planes, self._index(slots), block_planes(out), self._index(range(len(slots))))
        return out

    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        """blocks [n, layers, 2, bs, h, d] (any device) into slots `slots`, on the current stream."""
        blocks = blocks.to(self.device).contiguous()
        kernels.copy_planes(block_planes(blocks), self._index(range(len(slots))), self.planes, self._index(slots))

    def _index(self, slots) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64).to(self.device, non_blocking=True)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block


def block_planes(blocks: torch.Tensor, device: torch.device | str | None = None) -> PlaneTable:
    """The planes of block-first storage [n, layers, 2, bs, h, d] (L2, staging, a read's output);
    `device`: where the copies that address it run (a GPU, for pinned host memory)."""
    layers = blocks.shape[1]
    return PlaneTable([blocks[:, l, c] for l in range(layers) for c in (0, 1)], device)


def _planes(buffers, kv_layout: str, num_layers: int) -> list[torch.Tensor]:
    """K and V of every layer as views [N, bs, H, D], layer by layer: plane 2 * l + c."""
    axes, plane = KV_LAYOUTS[kv_layout]
    if "L" in axes:  # one tensor holds every layer
        return [plane(buffers, layer, c) for layer in range(num_layers) for c in (0, 1)]
    return [plane(t, 0, c) for t in buffers for c in (0, 1)]


def _checked(buffers, layout: KVLayout, kv_layout: str) -> list[torch.Tensor]:
    """`buffers` as a list of tensors whose shapes, dtype and device fit `layout` in `kv_layout`."""
    L, _, bs, H, D = layout.block_shape
    axes = KV_LAYOUTS[kv_layout][0]
    sizes = {"L": L, "N": None, "2": 2, "B": bs, "H": H, "D": D, "C": 2 * D}
    expected = tuple(sizes[a] for a in axes)  # None: the block count, the buffers' own
    want = 1 if "L" in axes else L
    if not isinstance(buffers, Sequence) or len(buffers) != want or not all(isinstance(t, torch.Tensor) for t in buffers):
        raise ConfigError(f"kv_layout {kv_layout!r} takes {describe_layout(kv_layout)}: {want} tensor(s) for "
                          f"{L} layers, got {_describe(buffers)}")
    blocks = None
    for i, t in enumerate(buffers):
        shape = tuple(t.shape)
        n = shape[expected.index(None)] if len(shape) == len(expected) else None
        if n is None or shape != tuple(n if e is None else e for e in expected) or n == 0:
            shown = tuple("N" if e is None else e for e in expected)
            raise ConfigError(f"KV buffer {i} has shape {shape}; kv_layout {kv_layout!r} with this KVLayout needs "
                              f"{shown} (N blocks of {bs} tokens, {H} KV heads of {D})")
        if t.dtype != layout.dtype:
            raise ConfigError(f"KV buffer {i} is {t.dtype} but the KVLayout says {layout.dtype}")
        if blocks is not None and n != blocks:
            raise ConfigError(f"KV buffer {i} holds {n} blocks, buffer 0 {blocks}: every layer needs the same count")
        if t.device != buffers[0].device:
            raise ConfigError(f"KV buffer {i} is on {t.device}, buffer 0 on {buffers[0].device}: put them on one device")
        blocks = n
    return list(buffers)


def _span(t: torch.Tensor) -> tuple[str, int, int]:
    """(device, first byte, end byte) of the memory `t` covers."""
    if t.numel() == 0:
        return str(t.device), 0, 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # elements past the first, to the last
    return str(t.device), t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _describe(buffers) -> str:
    if isinstance(buffers, torch.Tensor):
        return f"one tensor of shape {tuple(buffers.shape)}"
    if isinstance(buffers, Sequence):
        return f"{len(buffers)} items"
    return type(buffers).__name__
