"""StagingBuffer (tierkv/staging.py), on the CPU: a chunk's DMAs (`copies`, run here with
ctypes.memmove over host memory, each checked to stay inside both buffers) and its gather or
scatter (copy_planes through `table`, the reference kernel here) move exactly the blocks' parts
of a group of layers, for whole blocks and groups alike, in both halves, whose bytes never
overlap whatever the parts a move mixes. On a GPU the same addresses go to cudaMemcpyBatchAsync
and the same tables to the Triton kernel (tests/test_dma.py runs those moves there)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tierkv import kernels
from tierkv.layout import KVLayout
from tierkv.staging import StagingBuffer
from tierkv.tiers.gpu import DevicePool
from tierkv.tiers.host import HostPool
from tierkv.transfer import _planes

LAYOUT = KVLayout(num_layers=6, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
# whole blocks, the loads' groups of layers, a lone layer, and uneven parts a move may mix
PARTS = [None, range(0, 2), range(2, 4), range(4, 6), range(1, 2), range(0, 5), range(3, 6)]


@pytest.fixture
def pools():
    """L1 (40 blocks) and L2 (48) on the CPU, filled with random values."""
    l1, l2 = DevicePool(LAYOUT, 40, "cpu"), HostPool(LAYOUT, 48, pin=False)
    g = torch.Generator().manual_seed(0)
    l1.kv.copy_(torch.randn(l1.kv.shape, generator=g).to(l1.kv.dtype))
    l2.kv.copy_(torch.randn(l2.kv.shape, generator=g).to(l2.kv.dtype))
    return l1, l2


@pytest.fixture
def staging():
    """5 blocks: two halves of two whole blocks (one block unused), or of six one-layer parts."""
    return StagingBuffer(LAYOUT, LAYOUT, 5, torch.device("cpu"))


def scattered(n: int, of: int, seed: int) -> list[int]:
    """n distinct slots below `of` in shuffled order, a run of three neighbours first."""
    order = torch.randperm(of, generator=torch.Generator().manual_seed(seed)).tolist()
    first = min(order[:3])
    return [*range(first, first + 3), *[s for s in order if not first <= s < first + 3]][:n]


def within(tensor: torch.Tensor):
    """Whether [address, address + size) lies inside `tensor`'s bytes."""
    lo = tensor.data_ptr()
    hi = lo + tensor.numel() * tensor.element_size()
    return lambda address, size: lo <= address and address + size <= hi


def dma(staging: StagingBuffer, l2: HostPool, l2_slots, part, to_l2: bool, half: int) -> int:
    """Run a chunk's DMAs as host memcpys, each first checked to lie within the staging buffer on
    one side and L2 on the other; how many copies it took."""
    dsts, srcs, sizes = staging.copies(l2.kv, l2_slots, part, to_l2, half)
    in_staging, in_l2 = within(staging.tensor), within(l2.kv)
    for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):  # (int64 arrays: ctypes takes ints)
        assert (in_l2 if to_l2 else in_staging)(dst, size) and (in_staging if to_l2 else in_l2)(src, size)
        ctypes.memmove(dst, src, size)
    return len(sizes)


def layers_of(part) -> range:
    return range(LAYOUT.num_layers) if part is None else part


@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("part", PARTS, ids=str)
def test_a_chunk_loads_exactly_its_blocks_parts_into_l1(pools, staging, part, half):
    l1, l2 = pools
    n = staging.chunk_blocks(part)  # as many blocks as a half holds
    l2_slots, l1_slots = scattered(n, 48, seed=1), scattered(n, 40, seed=2)
    want = l1.kv.clone()  # L1 is [layers, N, 2, bs, h, d]; L2 [N, layers, 2, bs, h, d]
    for layer in layers_of(part):
        want[layer, l1_slots] = l2.kv[l2_slots, layer]
    copies = dma(staging, l2, l2_slots, part, to_l2=False, half=half)
    kernels.copy_planes(staging.table(part, half), torch.arange(n), l1.planes, torch.tensor(l1_slots), _planes(part))
    assert torch.equal(l1.kv, want)
    # whole blocks: one DMA a run of neighbouring L2 slots; parts: one a block
    num_runs = 1 + sum(b != a + 1 for a, b in zip(l2_slots, l2_slots[1:]))
    assert copies == (num_runs if part is None else n)
    assert part is not None or num_runs < n  # the case has a run


@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("part", PARTS, ids=str)
def test_a_chunk_saves_exactly_its_blocks_parts_into_l2(pools, staging, part, half):
    l1, l2 = pools
    n = staging.chunk_blocks(part)
    l1_slots, l2_slots = scattered(n, 40, seed=3), scattered(n, 48, seed=4)
    want = l2.kv.clone()
    for layer in layers_of(part):
        want[l2_slots, layer] = l1.kv[layer, l1_slots]
    kernels.copy_planes(l1.planes, torch.tensor(l1_slots), staging.table(part, half), torch.arange(n), _planes(part))
    dma(staging, l2, l2_slots, part, to_l2=True, half=half)
    assert torch.equal(l2.kv, want)


def test_whole_rows_of_a_half_are_the_rows_its_dmas_fill(pools, staging):
    """fp8's packed rows move whole: `rows` names the rows `copies` addresses in each half."""
    _, l2 = pools
    for half in (0, 1):
        staging.tensor.zero_()
        dma(staging, l2, [7, 30], None, to_l2=False, half=half)
        assert torch.equal(staging.rows(half, 2), l2.kv[[7, 30]])
        assert staging.tensor.count_nonzero() == staging.rows(half, 2).count_nonzero()  # nothing else written


def test_the_halves_bytes_never_overlap_whatever_the_parts(staging):
    row = LAYOUT.bytes_per_block
    total = staging.tensor.numel() * staging.tensor.element_size()
    assert staging.halves == 2 and staging.half_bytes == 2 * row
    base = staging.tensor.data_ptr()
    for part in PARTS:
        width = staging.span(part)[1]
        assert staging.chunk_blocks(part) == 2 * row // width  # a third of the layers: three times the blocks
        for half in (0, 1):
            table = staging.table(part, half)
            first = table.planes[2 * layers_of(part).start].data_ptr()
            last = table.planes[2 * layers_of(part)[-1] + 1][-1].data_ptr() + table.block_bytes
            assert first == base + half * staging.half_bytes  # a half's parts lie from its start
            assert last <= base + (half + 1) * staging.half_bytes <= base + total  # within its own bytes
            dsts, _, _ = staging.copies(torch.empty(64, row, dtype=torch.uint8),
                                        list(range(staging.chunk_blocks(part))), part, False, half)
            assert min(dsts) == first and max(dsts) + width <= base + (half + 1) * staging.half_bytes


def test_a_buffer_of_one_block_is_one_half():
    one = StagingBuffer(LAYOUT, LAYOUT, 1, torch.device("cpu"))
    assert one.halves == 1 and one.half_bytes == LAYOUT.bytes_per_block
    assert one.chunk_blocks(None) == 1 and one.chunk_blocks(range(0, 2)) == 3
    table = one.table(range(0, 2), 0)
    assert table.num_blocks == 3 and table.planes[0].data_ptr() == one.tensor.data_ptr()
