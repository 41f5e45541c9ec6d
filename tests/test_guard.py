"""The cache's thread model (tierkv/guard.py): threads may share one TieredKVCache, and nothing
works after close().

Two threads hammer one cache with the whole public API while the interpreter switches threads
every microsecond (so that any call that is not atomic is interleaved with the other thread's).
Every byte handed back is checked against the KV a model would have produced for that prefix,
and every block is accounted for at the end.
"""

import sys
import threading

import pytest
import torch

from prefix_kv import prefix_kv, read_slots, write_into_slots
from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.errors import CacheClosedError, CacheFullError, TierKVError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=1, head_dim=4, dtype=torch.float32, block_size=2)
BPB = LAYOUT.bytes_per_block


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _worker(cache: TieredKVCache, seed: int, rounds: int, errors: list) -> None:
    """One engine's traffic: its own prompts (and a shared one), stored, retrieved, allocated,
    written, committed and freed, under L1 and L2 pressure from the other thread."""
    gen = torch.Generator().manual_seed(seed)
    try:
        for r in range(rounds):
            shared = [7, 7, 7, 7, 1, 2]  # both threads use this prefix: its blocks are shared
            own = [int(x) for x in torch.randint(0, 5, (int(torch.randint(3, 13, (1,), generator=gen)),),
                                                 generator=gen)]
            tokens = (shared if r % 3 == 0 else []) + [100 * seed + x for x in own]
            cache.store(tokens, prefix_kv(LAYOUT, tokens))
            n, kv = cache.retrieve(tokens, limit=len(tokens))
            assert torch.equal(kv, prefix_kv(LAYOUT, tokens)[:, :, :n]), "retrieve returned other KV"
            try:
                seq = cache.allocate(tokens)
            except CacheFullError:
                continue  # the other thread holds L1 right now
            try:
                got = read_slots(cache, seq, seq.num_cached_tokens)
                assert torch.equal(got, prefix_kv(LAYOUT, tokens)[:, :, : seq.num_cached_tokens]), \
                    "an allocated prefix holds other KV"
                write_into_slots(cache, seq, tokens, seq.num_cached_tokens)
                cache.commit(seq, tokens)
            finally:
                cache.free(seq)
    except BaseException as e:  # reported by the test thread
        errors.append(e)


def test_two_threads_share_one_cache_without_wrong_kv_or_leaks(fast_switching):
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=24 * BPB, l2=24 * BPB, write_policy="write_back"), device="cpu",
                          model="threads")
    errors: list = []
    threads = [threading.Thread(target=_worker, args=(cache, seed, 150, errors)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    # nothing is held any more: emptying the tiers gives every slot back
    cache.evict("l1")
    cache.evict("l2")
    tiers = cache.stats()["tiers"]
    assert tiers["l1"]["used_blocks"] == 0, "L1 blocks leaked"
    assert tiers["l2"]["used_blocks"] == 0, "L2 blocks leaked"
    assert len(cache.index) == 0
    cache.close()


def test_every_call_after_close_raises_and_close_twice_is_fine():
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=8 * BPB, l2=8 * BPB), device="cpu", model="closing")
    tokens = list(range(9))
    cache.store(tokens, prefix_kv(LAYOUT, tokens))
    m = cache.match(tokens)
    seq = cache.allocate(tokens, match=m)
    cache.close()
    calls = {
        "match": lambda: cache.match(tokens),
        "retrieve": lambda: cache.retrieve(tokens),
        "store": lambda: cache.store(tokens, prefix_kv(LAYOUT, tokens)),
        "allocate": lambda: cache.allocate(tokens),
        "admit": lambda: cache.admit(tokens),
        "plan": lambda: cache.plan(tokens, budget=64),
        "prefetch": lambda: cache.prefetch(m),
        "append": lambda: cache.append(seq, 1),
        "commit": lambda: cache.commit(seq, tokens),
        "free": lambda: cache.free(seq),
        "block_table": lambda: cache.block_table([seq]),
        "evict": lambda: cache.evict("l1"),
        "flush": lambda: cache.flush(),
        "stats": lambda: cache.stats(),
    }
    for name, call in calls.items():
        with pytest.raises(CacheClosedError, match="closed"):
            call()
    assert issubclass(CacheClosedError, TierKVError)
    cache.close()  # a second close is a no-op, so `with` after an explicit close() works
