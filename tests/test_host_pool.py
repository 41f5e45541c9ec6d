"""L2 HostPool pinning: a refusal shrinks the pool to what pins, with a warning; nothing pinnable is pageable.

CPU tests replace the registration step (`host._register` / `host._unregister`) with fakes that
refuse above a size; the GPU tests pin real memory.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.errors import CacheFullError
from tierkv.tiers import HostPool, host
from tierkv.tiers.pool import gib

# 256 KiB a block, so that the sizes in the warnings read differently at two decimals of GiB
LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
BPB = LAYOUT.bytes_per_block


class FakeDriver:
    """Pins at most `limit` bytes at a time; records what was asked and what was unpinned."""

    def __init__(self, monkeypatch, limit: int | None) -> None:
        self.limit, self.tried, self.unpinned = limit, [], []
        monkeypatch.setattr(host, "_register", self.register)
        monkeypatch.setattr(host, "_unregister", lambda kv: self.unpinned.append(kv.data_ptr()))

    def register(self, kv: torch.Tensor) -> bool:
        self.tried.append(kv.shape[0])
        return self.limit is None or kv.nbytes <= self.limit


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == host.__name__ and r.levelno == logging.WARNING]


def test_refusal_shrinks_to_the_largest_halving_that_pins(monkeypatch, caplog):
    driver = FakeDriver(monkeypatch, limit=120 * BPB)
    pool = HostPool(LAYOUT, 400, pin=True)
    assert driver.tried == [400, 200, 100]
    assert pool.pinned and pool.num_blocks == 100 and pool.kv.shape[0] == 100
    assert len(pool.free) == pool.free.capacity == 100 and pool.nbytes == 100 * BPB
    [msg] = warnings_of(caplog)
    assert gib(400 * BPB) in msg and "400 blocks" in msg
    assert gib(100 * BPB) in msg and "100 blocks" in msg
    assert gib(400 * BPB) != gib(100 * BPB)
    assert "ulimit -l" in msg and "CacheConfig.l2" in msg


def test_every_block_of_the_shrunk_pool_is_writable_and_readable(monkeypatch):
    FakeDriver(monkeypatch, limit=120 * BPB)
    pool = HostPool(LAYOUT, 400, pin=True)
    slots = pool.free.take(pool.num_blocks)
    assert slots == list(range(100))
    with pytest.raises(CacheFullError):
        pool.free.take(1)
    for s in slots:
        pool.kv[s].fill_(s)
    assert torch.equal(pool.kv.float().flatten(1).amin(1), torch.arange(100, dtype=torch.float32))
    assert torch.equal(pool.kv.float().flatten(1).amax(1), torch.arange(100, dtype=torch.float32))


def test_whole_pool_pins_without_a_warning(monkeypatch, caplog):
    driver = FakeDriver(monkeypatch, limit=None)
    pool = HostPool(LAYOUT, 10, pin=True)
    assert driver.tried == [10] and pool.pinned and pool.num_blocks == 10 and len(pool.free) == 10
    assert warnings_of(caplog) == []


def test_nothing_pinnable_is_pageable_at_full_size_with_one_warning(monkeypatch, caplog):
    driver = FakeDriver(monkeypatch, limit=0)
    pool = HostPool(LAYOUT, 10, pin=True)
    assert driver.tried == [10, 5, 2, 1]
    assert not pool.pinned and pool.num_blocks == 10 and len(pool.free) == 10 and pool.kv.shape[0] == 10
    [msg] = warnings_of(caplog)
    assert gib(10 * BPB) in msg and "pageable" in msg and "ulimit -l" in msg
    pool.close()
    assert driver.unpinned == []  # never pinned, never unpinned


def test_a_cuda_runtime_error_is_pageable_with_one_warning(monkeypatch, caplog):
    driver = FakeDriver(monkeypatch, limit=None)

    def broken(kv):
        raise RuntimeError("no CUDA runtime")

    monkeypatch.setattr(host, "_register", broken)
    pool = HostPool(LAYOUT, 4, pin=True)
    assert not pool.pinned and pool.num_blocks == 4
    [msg] = warnings_of(caplog)
    assert "no CUDA runtime" in msg and "pageable" in msg
    assert driver.unpinned == []


def test_limit_leaves_the_first_slots_and_still_unpins_the_whole_pool(monkeypatch):
    """Tensor-parallel ranks all use as many L2 slots as the rank that pinned the fewest."""
    driver = FakeDriver(monkeypatch, limit=None)
    pool = HostPool(LAYOUT, 100, pin=True)
    base = pool.kv.data_ptr()
    pool.limit(60)
    assert pool.num_blocks == 60 and len(pool.free) == 60 and pool.kv.shape[0] == 60
    assert pool.rows.shape == (60, BPB) and pool.rows.data_ptr() == base
    assert pool.free.take(60) == list(range(60))
    with pytest.raises(RuntimeError, match="before any slot is taken"):
        pool.limit(10)
    pool.close()
    assert driver.unpinned == [base]


def test_no_cuda_means_pageable_and_silent(monkeypatch, caplog):
    driver = FakeDriver(monkeypatch, limit=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pool = HostPool(LAYOUT, 4)
    assert not pool.pinned and pool.num_blocks == 4 and driver.tried == []
    assert warnings_of(caplog) == []
    assert HostPool(LAYOUT, 0, pin=True).num_blocks == 0 and driver.tried == []


def test_unpinned_once_by_close_or_by_collection(monkeypatch):
    driver = FakeDriver(monkeypatch, limit=None)
    pool = HostPool(LAYOUT, 4, pin=True)
    ptr = pool.kv.data_ptr()
    pool.close()
    pool.close()
    assert driver.unpinned == [ptr]
    assert pool.num_blocks == 0 and len(pool.free) == 0 and pool.nbytes == 0 and not pool.pinned
    del pool
    gc.collect()
    assert driver.unpinned == [ptr]

    pool = HostPool(LAYOUT, 4, pin=True)
    other = pool.kv.data_ptr()
    del pool
    gc.collect()
    assert driver.unpinned == [ptr, other]


def test_cache_runs_on_a_shrunk_l2(monkeypatch, caplog):
    small = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)
    FakeDriver(monkeypatch, limit=5 * small.bytes_per_block)
    with monkeypatch.context() as m:  # pin as if a GPU were there, for the construction only
        m.setattr(torch.cuda, "is_available", lambda: True)
        cache = TieredKVCache(small, CacheConfig(l1=2 * small.bytes_per_block, l2=12 * small.bytes_per_block,
                                                 write_policy="write_through"), device="cpu")
    assert cache.l2.pinned and cache.l2.num_blocks == 3  # 12 -> 6 -> 3
    assert len(warnings_of(caplog)) == 1
    tiers = cache.stats()["tiers"]["l2"]
    assert tiers["capacity_blocks"] == 3 and tiers["capacity_bytes"] == 3 * small.bytes_per_block


# ---------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")


@pytest.mark.gpu
@needs_cuda
def test_gpu_pool_is_pinned_and_copies():
    # How fast pinning is (HostPool against torch's pinned allocator) is measured in
    # benchmarks/bench_transfer.py; this checks a large pool is pinned, whole, and copies right.
    size_gib = 12
    blocks = size_gib * 2**30 // BPB
    pool = HostPool(LAYOUT, blocks)
    assert pool.pinned and pool.kv.is_pinned() and pool.num_blocks == blocks
    last = pool.kv[blocks - 8 :]
    last.copy_(torch.randn(last.shape).to(last.dtype))
    on_gpu = last.to("cuda", non_blocking=True)
    back = torch.empty_like(last)
    back.copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, last)
    pool.close()
    assert not last.is_pinned()


@pytest.mark.gpu
@needs_cuda
def test_gpu_refused_registration_leaves_no_cuda_error_behind():
    kv = torch.empty((4, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
    assert host._register(kv)
    assert not host._register(kv)  # already registered: the driver refuses
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # torch's launch check sees no error
    host._unregister(kv)
