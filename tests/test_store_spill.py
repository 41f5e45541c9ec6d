"""store() of a sequence larger than L1 spills to L2 and L3 instead of keeping only what L1 holds.

The whole sequence is stored, and retrieved bit for bit, whenever the lower tiers have room, with
every write policy; L3 takes what L2 cannot hold (store waits for L2's victims to be written);
without room anywhere, store() keeps a prefix, says how long it is, and never drops an earlier
block of the same sequence to make room for a later one.
"""

import pytest
import torch

from prefix_kv import prefix_kv
from tierkv import CacheConfig, KVLayout, TieredKVCache

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)
BPB = LAYOUT.bytes_per_block


def make(l1: int, l2: int = 0, **kw) -> TieredKVCache:
    return TieredKVCache(LAYOUT, CacheConfig(l1=l1 * BPB, l2=l2 * BPB, **kw), device="cpu", model="spill-test")


def round_trip(cache: TieredKVCache, tokens: list[int]) -> tuple[int, int]:
    """(tokens store() reports, tokens retrieve() returns), the retrieved KV checked bit for bit."""
    kv = prefix_kv(LAYOUT, tokens)
    stored = cache.store(tokens, kv)
    n, got = cache.retrieve(tokens, limit=len(tokens))
    assert torch.equal(got, kv[:, :, :n])
    return stored, n


@pytest.mark.parametrize("policy", ["write_through", "write_back", "selective"])
def test_a_sequence_8x_larger_than_l1_is_kept_whole_by_l2(policy):
    cache = make(l1=2, l2=32, write_policy=policy)
    tokens = list(range(16 * 4))  # 16 blocks
    assert round_trip(cache, tokens) == (64, 64)
    assert cache.stats()["tiers"]["l2"]["used_blocks"] >= 14  # what L1 could not hold is in L2


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_sequence_larger_than_l1_and_l2_goes_on_to_l3(tmp_path, policy):
    url = f"file://{tmp_path}?size=1MiB"
    cache = make(l1=2, l2=4, l3=[url], write_policy=policy)
    tokens = list(range(1000, 1000 + 20 * 4))  # 20 blocks: L1 and L2 hold 6
    assert round_trip(cache, tokens) == (80, 80)
    assert cache.flush(timeout=30)
    fresh = make(l1=2, l2=4, l3=[url])  # another process sees the whole sequence in L3
    m = fresh.match(tokens, limit=80)
    assert m.tokens == 80 and m.by_tier["l3"] == 80


def test_without_room_the_kept_prefix_is_reported_and_earlier_blocks_stay():
    cache = make(l1=2, l2=3)
    other = list(range(900, 900 + 4 * 4))
    assert round_trip(cache, other) == (16, 16)  # 4 blocks: L1 2, L2 2
    tokens = list(range(500, 500 + 10 * 4))
    stored, n = round_trip(cache, tokens)
    # L1 and L2 hold 5 blocks in all: the other sequence makes room, this one keeps its head
    assert stored == n == 5 * 4


def test_storing_again_adds_nothing():
    cache = make(l1=2, l2=32)
    tokens = list(range(7, 7 + 12 * 4))
    assert round_trip(cache, tokens) == (48, 48)
    stored = cache.stats()["stored_blocks"]
    used = cache.stats()["tiers"]["l2"]["used_blocks"]
    assert round_trip(cache, tokens) == (48, 48)
    assert cache.stats()["stored_blocks"] == stored and cache.stats()["tiers"]["l2"]["used_blocks"] == used
