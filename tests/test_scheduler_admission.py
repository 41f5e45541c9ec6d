"""The scheduler's admission of a request L1 cannot hold yet: it is looked up once, and again only
once L1's room has grown (a request finished or was preempted), not on every step while others
decode (a lookup hashes and walks the whole prompt: bench_rounds' 8K-token histories were looked
up ~7 times each per admission, half the engine's scheduling time)."""

import torch

from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.engine.request import Request
from tierkv.engine.sampler import SamplingParams
from tierkv.engine.scheduler import Scheduler

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=4)


def test_a_request_refused_for_room_is_looked_up_again_only_when_room_grows(monkeypatch):
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=12 * LAYOUT.bytes_per_block, l2=0), device="cpu", model="sched")
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=8)
    a, b = (Request(list(range(100 * i, 100 * i + 20)), params) for i in (1, 2))  # 5 blocks each
    big = Request(list(range(500, 520)), params)  # 5 blocks: fits only once a or b is gone
    for r in (a, b, big):
        sched.add(r)
    plans = []
    plan = cache.plan
    monkeypatch.setattr(cache, "plan", lambda *args, **kw: plans.append(args[0]) or plan(*args, **kw))

    step = sched.schedule()
    assert step.requests == [a, b] and plans.count(big.all_ids) == 1  # refused once
    for _ in range(3):  # a and b decode; L1's room only shrinks
        for r in step.requests:
            sched.computed(r, step.num_new[step.requests.index(r)])
            r.output_ids.append(7)
        step = sched.schedule()
        assert step.requests == [a, b]
    assert plans.count(big.all_ids) == 1 and big.refused_at_room is not None

    sched.finish(a, "stop")  # its blocks can be evicted: the room grows
    step = sched.schedule()
    assert big in step.requests and plans.count(big.all_ids) == 2


def test_a_preempted_request_is_looked_up_afresh():
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=12 * LAYOUT.bytes_per_block, l2=0), device="cpu", model="sched")
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    r = Request(list(range(20)), SamplingParams(temperature=0, max_tokens=8))
    sched.add(r)
    sched.schedule()
    r.refused_at_room = 99  # as if refused once before it got in
    sched.preempt(r)
    assert r.refused_at_room is None and r in sched.waiting
