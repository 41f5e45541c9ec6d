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


def test_a_request_whose_token_on_its_way_is_its_last_gives_its_room_to_a_waiting_one_at_once():
    """With async scheduling the engine learns that a request ended only when it takes the last
    token back, after launching the next step; the scheduler knows a step earlier, by max_tokens."""
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=10 * LAYOUT.bytes_per_block, l2=0), device="cpu", model="sched")
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    last = Request(list(range(100, 119)), SamplingParams(temperature=0, max_tokens=2))  # 19 + 1 tokens: 5 blocks
    other = Request(list(range(300, 320)), SamplingParams(temperature=0, max_tokens=8))  # 5 blocks
    sched.add(last)
    step = sched.schedule()
    sched.computed(last, step.num_new[0])
    last.pending += 1  # launched: its first token is on its way
    last.output_ids.append(7)  # taken back
    last.pending -= 1
    step = sched.schedule()  # it decodes; its second token, its last, is on its way
    assert step.requests == [last]
    sched.computed(last, 1)
    last.pending += 1
    sched.add(other)  # L1 (10 blocks) holds it only once `last` has let go of its 5

    step = sched.schedule()
    assert step.requests == [other] and last.seq is None and last not in sched.running
    # its full blocks were committed before they went back: its 19 + 1 tokens with KV, 5 blocks
    match = cache.plan(last.all_ids + [0], None, budget=256, prefix_caching=True,
                       recompute_seconds_per_token=None, deadline_s=1.0).match
    assert match.tokens == 20
    last.output_ids.append(8)  # the engine takes the last token back and finishes it
    last.pending -= 1
    sched.finish(last, "length")
    assert last.finished and sched.running == [other]
