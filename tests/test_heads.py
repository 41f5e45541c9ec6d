"""tierkv/heads.py: a whole-model block split into tensor-parallel ranks' KV heads and joined back,
byte for byte, in both stored formats (bf16 blocks, fp8 values with per-head scales), with heads
split or replicated as the engine assigns them (TensorParallel.kv_heads)."""

from __future__ import annotations

import pytest
import torch

from tierkv import kernels
from tierkv.engine.parallel import TensorParallel
from tierkv.heads import HeadSplit, with_heads
from tierkv.layout import KVLayout, OffloadLayout

KV = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, dtype=torch.bfloat16, block_size=4)


def ranks(heads: int, size: int) -> list[slice]:
    return [TensorParallel(r, size).kv_heads(heads) for r in range(size)]


def random_blocks(layout, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n blocks of `layout` as rows [n, bytes], and their KV [n, layers, 2, bs, H, D] (bf16)."""
    g = torch.Generator().manual_seed(seed)
    kv = layout.kv if isinstance(layout, OffloadLayout) else layout
    x = torch.randn((n, *kv.block_shape), generator=g).to(kv.dtype)
    if isinstance(layout, KVLayout):
        return x.view(torch.uint8).reshape(n, -1).clone(), x
    rows = torch.zeros((n, layout.bytes_per_block), dtype=torch.uint8)
    kernels.quantize_fp8(x, layout.payload(rows), layout.scales(rows))
    out = torch.empty_like(x)
    kernels.dequantize_fp8(layout.payload(rows), layout.scales(rows), out)
    return rows, out


@pytest.mark.parametrize("layout", [KV, OffloadLayout(KV)], ids=["bf16", "fp8"])
@pytest.mark.parametrize("size", [1, 2, 4, 8])  # 8 ranks: each of the 4 heads held twice
def test_split_then_join_gives_the_same_bytes(layout, size):
    split = HeadSplit(layout, ranks(4, size))
    blocks, kv = random_blocks(layout, 5)
    pieces = [split.split(blocks, r) for r in range(size)]
    assert all(p.shape == (5, split.part.bytes_per_block) for p in pieces)
    assert torch.equal(split.join(pieces), blocks)
    # into a buffer that held other bytes (a staging buffer): the same parts, its padding untouched
    out = torch.full_like(pieces[-1], 7)
    split.split(blocks, size - 1, out=out)
    assert torch.equal(split.join(pieces[:-1] + [out]), blocks)
    # each piece is exactly that rank's heads, read in the rank's own (smaller) layout
    for r, piece in enumerate(pieces):
        heads = ranks(4, size)[r]
        if isinstance(layout, KVLayout):
            got = piece.view(torch.bfloat16).view(5, *split.part.block_shape)
        else:
            got = torch.empty((5, *split.part.kv.block_shape), dtype=torch.bfloat16)
            kernels.dequantize_fp8(split.part.payload(piece), split.part.scales(piece), got)
        assert torch.equal(got, kv[..., heads, :])


def test_joined_pieces_quantised_per_rank_equal_the_whole_quantised_at_once():
    """fp8 scales are per head: ranks that quantise their own heads produce, joined, the very
    bytes a single GPU stores for the whole block."""
    whole = OffloadLayout(KV)
    split = HeadSplit(whole, ranks(4, 2))
    _, kv = random_blocks(KV, 3, seed=1)
    pieces = []
    for heads in split.ranks:
        part = torch.zeros((3, split.part.bytes_per_block), dtype=torch.uint8)
        x = kv[..., heads, :].contiguous()
        kernels.quantize_fp8(x, split.part.payload(part), split.part.scales(part))
        pieces.append(part)
    at_once = torch.zeros((3, whole.bytes_per_block), dtype=torch.uint8)
    kernels.quantize_fp8(kv, whole.payload(at_once), whole.scales(at_once))
    assert torch.equal(split.join(pieces), at_once)


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="as many KV heads"):
        HeadSplit(KV, [slice(0, 1), slice(1, 4)])
    with pytest.raises(ValueError, match="do not cover"):
        HeadSplit(KV, [slice(0, 2), slice(0, 2)])
    assert with_heads(OffloadLayout(KV), 2).kv.num_kv_heads == 2
