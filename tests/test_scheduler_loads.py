"""The scheduler and L2 -> L1 loads still in flight: requests whose blocks are on their way never
hold up a step of others, and when nothing else can run, only the request whose blocks land first
(loads queue on one copy stream, in admission order) starts, layer by layer as they land, so the
GPU computes while the rest load and requests admitted together stop finishing together.

On a CPU every load is done when issued; a load in flight is an `InFlight` the test completes by
hand (the state a CUDA event reports while the copy stream still runs), put in the sequence's
`pending` loads as `TieredKVCache.allocate` puts a real one."""

import torch

from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.engine.request import Request
from tierkv.engine.sampler import SamplingParams
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


def test_only_the_first_to_land_starts_when_every_runner_is_loading():
    sched, (a, b, c) = running_and_decoding(3)
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
