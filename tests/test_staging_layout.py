"""The staged path's layout (transfer.BlockMover), on the CPU: a chunk's DMAs (`_dma_copies`, run
here with ctypes.memmove over host memory) and its gather or scatter (copy_planes through
`_staging_table`, the reference kernel here) move exactly the blocks' slices of a group of layers,
for whole blocks and groups alike, in both halves of the staging buffer, whose regions never
overlap whatever the slices a move mixes. On a GPU the same addresses go to cudaMemcpyBatchAsync
and the same tables to the Triton kernel (tests/test_dma.py runs those moves there)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tierkv import kernels, transfer
from tierkv.layout import KVLayout
from tierkv.tiers.gpu import DevicePool
from tierkv.tiers.host import HostPool

LAYOUT = KVLayout(num_layers=6, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
# whole blocks, the loads' groups of layers, a lone layer, and uneven parts a move may mix
PARTS = [None, range(0, 2), range(2, 4), range(4, 6), range(1, 2), range(0, 5), range(3, 6)]


@pytest.fixture
def mover(monkeypatch):
    """A mover whose staging buffer holds 5 blocks: halves of 2 whole blocks, 6 one-layer slices."""
    monkeypatch.setattr(transfer, "STAGING_BYTES", 5 * LAYOUT.bytes_per_block)
    l1, l2 = DevicePool(LAYOUT, 40, "cpu"), HostPool(LAYOUT, 48, pin=False)
    g = torch.Generator().manual_seed(0)
    l1.kv.copy_(torch.randn(l1.kv.shape, generator=g).to(l1.kv.dtype))
    l2.kv.copy_(torch.randn(l2.kv.shape, generator=g).to(l2.kv.dtype))
    mover = transfer.BlockMover(l1, l2, warm_up=False)
    assert mover.staging.shape[0] == 5
    return mover


def scattered(n: int, of: int, seed: int) -> list[int]:
    """n distinct slots below `of` in shuffled order, with a run of neighbours at the front."""
    order = torch.randperm(of, generator=torch.Generator().manual_seed(seed)).tolist()
    head = sorted(order[:3])
    return [*range(head[0], head[0] + 3), *[s for s in order if not head[0] <= s < head[0] + 3]][:n]


def dma(mover, l2_slots, part, to_l2, half) -> int:
    """Run a chunk's DMAs as host memcpys, each first checked to lie within the staging buffer on
    one side and L2 on the other; how many copies it took."""
    dsts, srcs, sizes = mover._dma_copies(l2_slots, part, to_l2, half)
    staging, l2 = (within(mover.staging), within(mover.l2.kv))
    for dst, src, size in zip(dsts, srcs, sizes):
        assert (l2 if to_l2 else staging)(dst, size) and (staging if to_l2 else l2)(src, size)
        ctypes.memmove(dst, src, size)
    return len(sizes)


def within(tensor: torch.Tensor):
    """Whether [address, address + size) lies inside `tensor`'s bytes."""
    lo = tensor.data_ptr()
    hi = lo + tensor.numel() * tensor.element_size()
    return lambda address, size: lo <= address and address + size <= hi


def layers_of(part) -> range:
    return range(LAYOUT.num_layers) if part is None else part


@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("part", PARTS, ids=str)
def test_a_chunk_loads_exactly_its_blocks_slices_into_l1(mover, part, half):
    n = mover._chunk_blocks(part)  # as many blocks as a half holds
    l2_slots, l1_slots = scattered(n, 48, seed=1), scattered(n, 40, seed=2)
    before = mover.l1.kv.clone()
    copies = dma(mover, l2_slots, part, to_l2=False, half=half)
    kernels.copy_planes(mover._staging_table(part, half), mover._rows[:n], mover.l1.planes, torch.tensor(l1_slots),
                        transfer._planes(part))
    want = before.clone()  # L1 is [layers, N, 2, bs, h, d]; L2 [N, layers, 2, bs, h, d]
    for layer in layers_of(part):
        want[layer, l1_slots] = mover.l2.kv[l2_slots, layer]
    assert torch.equal(mover.l1.kv, want)
    # whole blocks: one DMA a run of neighbouring L2 slots; slices: one a block
    num_runs = 1 + sum(b != a + 1 for a, b in zip(l2_slots, l2_slots[1:]))
    assert copies == (num_runs if part is None else n)
    assert part is not None or num_runs < n  # the case has a run


@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("part", PARTS, ids=str)
def test_a_chunk_saves_exactly_its_blocks_slices_into_l2(mover, part, half):
    n = mover._chunk_blocks(part)
    l1_slots, l2_slots = scattered(n, 40, seed=3), scattered(n, 48, seed=4)
    before = mover.l2.kv.clone()
    kernels.copy_planes(mover.l1.planes, torch.tensor(l1_slots), mover._staging_table(part, half), mover._rows[:n],
                        transfer._planes(part))
    dma(mover, l2_slots, part, to_l2=True, half=half)
    want = before.clone()
    for layer in layers_of(part):
        want[l2_slots, layer] = mover.l1.kv[layer, l1_slots]
    assert torch.equal(mover.l2.kv, want)


def test_the_halves_regions_never_overlap_whatever_the_parts(mover):
    row, total = LAYOUT.bytes_per_block, mover.staging.numel() * mover.staging.element_size()
    assert mover._half_bytes == 2 * row  # 5 blocks: two halves of two, one block unused
    base = mover.staging.data_ptr()
    for part in PARTS:
        width = mover._span(part)[1]
        assert mover._chunk_blocks(part) == 2 * row // width  # a group of a third of the layers: 3x the blocks
        for half in (0, 1):
            table = mover._staging_table(part, half)
            first, last = (table.planes[2 * layers_of(part).start].data_ptr(),
                           table.planes[2 * layers_of(part)[-1] + 1][-1].data_ptr() + table.block_bytes)
            # the half's slices lie from its start to within its own bytes, and inside the buffer
            assert first == base + half * mover._half_bytes
            assert last <= base + (half + 1) * mover._half_bytes <= base + total
            dsts, _, _ = mover._dma_copies(list(range(mover._chunk_blocks(part))), part, False, half)
            assert min(dsts) == first and max(dsts) + width <= base + (half + 1) * mover._half_bytes
