"""L1 slots reused while copies at them are still in flight, on a CUDA GPU (tierkv/tiering.py:
`take_l1`, `_evict_l1`; tierkv/admission.py: `warm`).

On a CPU every copy ends before it returns (tests/test_evicted_slots.py and test_warm.py stand in
for one in flight). Here the copy stream is held busy (`torch.cuda._sleep`), so each copy below is
still queued when its slot is evicted and taken again: a compute-stream write into such a slot
must come after the copy, and a load into it after the save that reads it. A wrong order shows as
another prompt's KV in the slot.
"""

from __future__ import annotations

import pytest
import torch

from prefix_kv import prefix_kv, read_slots, write_into_slots
from tierkv import CacheConfig, KVLayout, TieredKVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float16, block_size=16)
BPB = LAYOUT.bytes_per_block
DOC = list(range(1000, 1000 + 32 * 16 + 1))  # 32 full blocks and one token


def hold_copy_stream(cache: TieredKVCache, seconds: float = 0.1) -> None:
    with torch.cuda.stream(cache.tiers.mover.stream):
        torch.cuda._sleep(int(seconds * 2e9))  # (cycles, ~2 GHz)


def test_a_sequence_writing_slots_whose_warm_loads_are_in_flight_keeps_its_own_kv():
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=48 * BPB, l2=128 * BPB), device="cuda", model="warm-gpu")
    cache.store(DOC, prefix_kv(LAYOUT, DOC).cuda())
    cache.evict("l1")
    own = list(range(5000, 5000 + 16 * 16))
    other = cache.allocate(own)
    write_into_slots(cache, other, own, 0)
    hold_copy_stream(cache)
    assert cache.warm(cache.match(DOC)) == 32  # all of L1's room; the loads wait behind the sleep
    longer = own + list(range(6000, 6000 + 16 * 16))
    cache.append(other, 16 * 16)  # takes back 16 of the warmed slots, their loads still queued
    write_into_slots(cache, other, longer, len(own))  # on the compute stream: after those loads
    torch.cuda.synchronize()
    assert torch.equal(read_slots(cache, other, len(longer)).cpu(), prefix_kv(LAYOUT, longer))
    cache.free(other)
    seq = cache.allocate(DOC)
    assert seq.num_cached_tokens == 32 * 16 and seq.cached_by_tier["l2"] == 32 * 16
    seq.wait()
    torch.cuda.synchronize()
    assert torch.equal(read_slots(cache, seq, 32 * 16).cpu(), prefix_kv(LAYOUT, DOC)[:, :, : 32 * 16])
    cache.free(seq)
    cache.close()


def test_a_load_into_a_slot_whose_save_is_in_flight_comes_after_the_save():
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=40 * BPB, l2=128 * BPB, write_policy="write_back"),
                          device="cuda", model="warm-gpu")
    cache.store(DOC, prefix_kv(LAYOUT, DOC).cuda())
    cache.evict("l1")  # DOC in L2 alone
    side = list(range(7000, 7000 + 40 * 16 + 1))  # 40 blocks: all of L1, in L1 alone (write-back)
    cache.store(side, prefix_kv(LAYOUT, side).cuda())
    assert cache.match(side).by_tier["l1"] == 40 * 16
    hold_copy_stream(cache)
    # DOC's loads take slots whose blocks are being saved to L2 as they leave: queued after the saves
    seq = cache.allocate(DOC)
    assert seq.cached_by_tier["l2"] == 32 * 16
    seq.wait()
    torch.cuda.synchronize()
    assert torch.equal(read_slots(cache, seq, 32 * 16).cpu(), prefix_kv(LAYOUT, DOC)[:, :, : 32 * 16])
    cache.free(seq)
    # what left L1 reached L2 whole, as it was before DOC's loads overwrote its slots
    n, kv = cache.retrieve(side)
    assert n >= 32 * 16
    assert torch.equal(kv.cpu(), prefix_kv(LAYOUT, side)[:, :, :n])
    cache.close()
