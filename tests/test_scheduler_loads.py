"""The scheduler and L2 -> L1 loads still in flight: requests whose blocks are on their way never
hold up a step of others, and when nothing else can run, only the request whose blocks land first
(loads queue on one copy stream, in admission order) starts, layer by layer as they land, so the
GPU computes while the rest load and requests admitted together stop finishing together. It starts
early only if its load is long (`scheduler.LAYER_BY_LAYER_MIN_S`); a short one is waited for whole,
while the arrivals that fit are admitted and their loads queued, until the first load lands.

On a CPU every load is done when issued; a load in flight is an `InFlight` the test completes by
hand (the state a CUDA event reports while the copy stream still runs), put in the sequence's
`pending` loads as `TieredKVCache.allocate` puts a real one."""

import torch

from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.engine.request import Request
from tierkv.engine.sampler import SamplingParams
from tierkv.engine import scheduler
from tierkv.engine.scheduler import Scheduler

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=4)


class InFlight:
    """A load on its way into L1 until `land()` (Transfer's done/wait/wait_layer)."""

    def __init__(self) -> None:
        self.landed = False

    def land(self) -> None:
        self.landed = True

    def done(self) -> bool:
        return self.landed

    def wait(self) -> None:
        pass

    def wait_layer(self, layer: int, stream=None) -> None:
        pass


def running_and_decoding(n: int) -> tuple[Scheduler, list[Request]]:
    """A scheduler whose n requests computed their prompts (the engine's calls after a step) and
    each had its token come back: every one of them would decode next."""
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=64 * LAYOUT.bytes_per_block, l2=0), device="cpu", model="sched")
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    reqs = [Request(list(range(100 * i, 100 * i + 10)), SamplingParams(temperature=0, max_tokens=8))
            for i in range(n)]
    for r in reqs:
        sched.add(r)
    step = sched.schedule()
    assert step.requests == reqs and step.num_new == [10] * n
    for r in reqs:
        sched.computed(r, 10)
        r.output_ids.append(7)
    return sched, reqs


def test_only_the_first_to_land_starts_when_every_runner_is_loading(monkeypatch):
    sched, (a, b, c) = running_and_decoding(3)
    monkeypatch.setattr(scheduler, "LAYER_BY_LAYER_MIN_S", 0.0)  # every load counts as long
    loads = {}
    for r in (a, b, c):
        loads[r.request_id] = InFlight()
        r.seq.pending = [loads[r.request_id]]
    step = sched.schedule()
    assert step.requests == [a] and step.num_new == [1]  # not b and c: their loads come after a's
    assert sched.loading == [a, b, c]  # what a profile's step label names as loading
    sched.computed(a, 1)
    a.output_ids.append(7)
    loads[a.request_id].land()
    assert sched.schedule().requests == [a]  # b is still on its way: a decodes meanwhile
    sched.computed(a, 1)
    a.output_ids.append(7)
    loads[b.request_id].land()
    step = sched.schedule()
    assert step.requests == [a, b] and step.num_new == [1, 1]  # b joins once its blocks landed
    assert sched.loading == [c]


def test_a_landed_runner_computes_while_the_others_load():
    sched, (a, b, c) = running_and_decoding(3)
    for r in (a, c):
        r.seq.pending = [InFlight()]
    step = sched.schedule()
    assert step.requests == [b]  # nobody waits for a load while b can run


def test_a_short_load_is_waited_for_whole_when_nothing_else_can_run(monkeypatch):
    sched, (a, b) = running_and_decoding(2)
    assert sched.cache.load_seconds(a.seq) < scheduler.LAYER_BY_LAYER_MIN_S  # nothing came from L2: short
    loads = {r.request_id: InFlight() for r in (a, b)}
    for r in (a, b):
        r.seq.pending = [loads[r.request_id]]
    step = sched.schedule()
    assert step.requests == [] and sched.loading == [a, b]  # no eager step waits layer by layer
    loads[a.request_id].land()
    step = sched.schedule()
    assert step.requests == [a] and sched.loading == [b]  # landed: a step that may replay a graph

    monkeypatch.setattr(scheduler, "LAYER_BY_LAYER_MIN_S", 0.0)  # the same loads, counted long
    loads = {r.request_id: InFlight() for r in (a, b)}
    for r in (a, b):
        r.seq.pending = [loads[r.request_id]]
    assert sched.schedule().requests == [a]  # the first to land starts early


def loads_stay_in_flight(monkeypatch, cache: TieredKVCache) -> dict[str, InFlight]:
    """Make every allocation's loads land only when the test says (as on a GPU, where they are on
    the copy stream when allocate returns): admission order -> its load."""
    loads = {}
    allocate = cache.allocate

    def allocate_loading(*args, **kw):
        seq = allocate(*args, **kw)
        seq.pending = [InFlight()]
        loads[len(loads)] = seq.pending[0]
        return seq

    monkeypatch.setattr(cache, "allocate", allocate_loading)
    return loads


def test_with_nothing_running_every_arrival_that_fits_is_admitted_at_once(monkeypatch):
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=64 * LAYOUT.bytes_per_block, l2=0), device="cpu", model="sched")
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    loads = loads_stay_in_flight(monkeypatch, cache)
    reqs = [Request(list(range(100 * i, 100 * i + 10)), SamplingParams(temperature=0, max_tokens=8))
            for i in range(3)]
    for r in reqs:
        sched.add(r)
    step = sched.schedule()
    # no step runs, so no step waits for this call: all three are admitted, their loads queued
    assert step.requests == [] and sched.running == reqs and sched.loading == reqs and not sched.waiting
    loads[0].land()
    step = sched.schedule()
    assert step.requests == [reqs[0]] and step.num_new == [10]

    late = Request(list(range(900, 910)), SamplingParams(temperature=0, max_tokens=8))
    sched.add(late)
    sched.computed(reqs[0], 10)
    reqs[0].output_ids.append(7)
    step = sched.schedule()
    # beside a running step one admission a call, as before: it waits for its loads
    assert step.requests == [reqs[0]] and late in sched.running and late in sched.loading


def test_admitting_at_once_stops_when_the_first_load_lands(monkeypatch):
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=64 * LAYOUT.bytes_per_block, l2=0), device="cpu", model="sched")
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    loads = loads_stay_in_flight(monkeypatch, cache)
    allocate = cache.allocate

    def allocate_and_land_the_first(*args, **kw):  # the first load lands while the second is issued
        seq = allocate(*args, **kw)
        if len(loads) == 2:
            loads[0].land()
        return seq

    monkeypatch.setattr(cache, "allocate", allocate_and_land_the_first)
    reqs = [Request(list(range(100 * i, 100 * i + 10)), SamplingParams(temperature=0, max_tokens=8))
            for i in range(3)]
    for r in reqs:
        sched.add(r)
    assert sched.schedule().requests == []
    assert sched.running == reqs[:2] and sched.waiting == [reqs[2]]  # the landed one runs next call
    step = sched.schedule()
    assert step.requests == [reqs[0]] and reqs[2] in sched.running  # and one admission beside it


def test_a_long_load_still_starts_layer_by_layer_when_nothing_else_runs(monkeypatch):
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=64 * LAYOUT.bytes_per_block, l2=0), device="cpu", model="sched")
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    loads_stay_in_flight(monkeypatch, cache)
    monkeypatch.setattr(cache, "load_seconds", lambda seq: 0.25)  # a 100K-token Llama-8B history
    reqs = [Request(list(range(100 * i, 100 * i + 10)), SamplingParams(temperature=0, max_tokens=8))
            for i in range(2)]
    for r in reqs:
        sched.add(r)
    step = sched.schedule()
    assert step.requests == [reqs[0]] and step.num_new == [10]  # computes as its layers land
    assert reqs[1] in sched.running and sched.loading == [reqs[1]]
