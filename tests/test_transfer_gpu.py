"""transfer.BlockMover on a CUDA GPU: a move owns the memory it reads until it has run.

A load is issued on the copy stream and the compute stream goes on at once (the scheduler runs
other requests beside a hit whose blocks are landing). Whatever the load's kernels read on the
device must not go back to the compute stream's allocator before they ran: a forward would take
that memory and overwrite the slot lists (tierkv-serve on the H200: an illegal address).
"""

from __future__ import annotations

import pytest
import torch

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
