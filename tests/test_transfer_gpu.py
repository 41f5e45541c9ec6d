"""transfer.BlockMover on a CUDA GPU: a move owns the memory it reads until it has run.

A load is issued on the copy stream and the compute stream goes on at once (the scheduler runs
other requests beside a hit whose blocks are landing). Whatever the load's kernels read on the
device must not go back to the compute stream's allocator before they ran: a forward would take
that memory and overwrite the slot lists (tierkv-serve on the H200: an illegal address).
"""

from __future__ import annotations

import pytest
import torch

from tierkv import CacheConfig, TieredKVCache
from tierkv.index_ring import IndexRing
from tierkv.layout import KVLayout
from tierkv.tiers.gpu import DevicePool
from tierkv.tiers.host import HostPool
from tierkv.transfer import BlockMover

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]


def test_a_load_waiting_its_turn_keeps_its_slot_lists():
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64)
    l1, l2 = DevicePool(layout, 64, "cuda"), HostPool(layout, 64, pin=True)
    mover = BlockMover(l1, l2)
    l1.kv.zero_()
    l2.kv.copy_(torch.randn(l2.kv.shape).to(l2.kv.dtype))
    src, dst = list(range(5, 45)), list(range(20, 60))  # 40 blocks, L2 slots 5.. into L1 slots 20..
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the copy stream is busy, as behind a write-back
    load = mover.l2_to_l1(src, dst)
    # the compute stream goes on at once: a forward allocates and writes tensors of every size,
    # among them the size of the load's slot lists ([40] int64)
    scratch = [torch.zeros(len(src), dtype=torch.int64, device="cuda") for _ in range(32)]
    load.wait()
    torch.cuda.synchronize()
    assert torch.equal(l1.read(dst).cpu(), l2.kv[torch.tensor(src)])
    assert not l1.kv[:, :20].any()  # nothing landed elsewhere (slot lists of zeros would write slot 0)
    del scratch


def test_a_hit_waits_on_its_load_once_per_layer():
    # A 40-block prefix comes back from L2 in one load: the sequence holds that load once (not
    # once a block), so the forward's wait before each layer is one event wait, and the blocks
    # are the ones stored.
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64)
    cache = TieredKVCache(layout, CacheConfig(l1=64 * layout.bytes_per_block, l2=64 * layout.bytes_per_block),
                          device="cuda")
    prompt = list(range(1000, 1000 + 40 * 16 + 1))
    kv = torch.randn((4, 2, len(prompt), 2, 64), device="cuda").to(layout.dtype)  # [L, 2, T, H, D]
    assert cache.store(prompt, kv) == 40 * 16
    cache.evict("l1")
    with torch.cuda.stream(cache.tiers.mover.stream):
        torch.cuda._sleep(100_000_000)  # the copy stream is busy: the load is still in flight below
    hit = cache.admit(prompt)
    assert hit.num_cached_tokens == 40 * 16
    assert len(hit.pending) == 1
    for layer in range(4):
        cache.wait_for_layer(layer, [hit])
    torch.cuda.synchronize()
    got = cache.l1.read(hit.slots[:40])  # [40, L, 2, bs, H, D]
    want = kv[:, :, : 40 * 16].reshape(4, 2, 40, 16, 2, 64).permute(2, 0, 1, 3, 4, 5)
    assert torch.equal(got, want)
    cache.free(hit)
    cache.close()


def test_the_index_ring_never_overwrites_a_list_before_its_copy_ran():
    """A ring of 64 slots behind a copy stream that is busy for ~0.1 s: twelve lists of 12 wrap
    around it twice, so each write past the first five must wait for the copy that read its
    stretch; every list arrives as it was given. Issuing them pins no memory."""
    ring = IndexRing(torch.device("cuda"), capacity=64)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
    lists = [list(range(100 * i, 100 * i + 12)) for i in range(12)]
    handed_out = pinned_handouts()
    got = [ring.to_device(x, stream) for x in lists]
    assert pinned_handouts() == handed_out
    torch.cuda.synchronize()
    assert [g.tolist() for g in got] == lists
    assert len(ring.pending) <= 64 // 12 + 1


def pinned_handouts() -> int:
    """Pinned blocks torch's caching host allocator has page-locked so far (cudaHostAlloc calls: with
    the copy stream busy, pin_memory() per list would make one for each list)."""
    return torch.cuda.memory.host_memory_stats()["num_host_alloc"]
