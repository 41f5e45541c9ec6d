"""A prompt waiting for L1 room loads its L2 blocks into the room there is (tierkv/admission.py:
`warm`; the scheduler calls it for the first waiting request that does not fit).

With L1 holding five of the bench_rounds histories and a sixth waiting, each new request loaded
its whole history only once another one ended, and the batch ran one short meanwhile (~20 ms
of an 8K Llama-8B history on an H100). Warmed, it loads only the rest then. The blocks stay
cached: a running sequence's room evicts them again at no cost (L2 keeps its copies), and their
first use counts as L2 hits.
"""

import torch

from prefix_kv import prefix_kv, read_slots, write_into_slots
from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.engine import scheduler as scheduling
from tierkv.engine.request import Request
from tierkv.engine.sampler import SamplingParams
from tierkv.engine.scheduler import Scheduler

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)
BPB = LAYOUT.bytes_per_block
DOC = list(range(1000, 1033))  # 8 full blocks and one token


def cache_with_doc_in_l2(l1_blocks: int = 12) -> TieredKVCache:
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=l1_blocks * BPB, l2=64 * BPB), device="cpu", model="warm")
    cache.store(DOC, prefix_kv(LAYOUT, DOC))
    cache.evict("l1")  # every block of DOC is in L2 alone
    return cache


def running(cache: TieredKVCache, first: int, blocks: int):
    """A running sequence of `blocks` full blocks of its own tokens, holding that much of L1."""
    tokens = list(range(first, first + blocks * LAYOUT.block_size))
    seq = cache.allocate(tokens)
    write_into_slots(cache, seq, tokens, 0)
    return seq


def in_l1(cache: TieredKVCache, tokens: list[int]) -> list[bool]:
    return [e.l1 >= 0 for e in cache.match(tokens).blocks]


def test_warm_loads_the_leading_l2_blocks_into_the_room_left_and_holds_none():
    cache = cache_with_doc_in_l2()
    other = running(cache, 5000, 7)  # 7 of 12 blocks held: room for 5
    m = cache.match(DOC)
    assert m.by_tier == {"l1": 0, "l2": 32, "l3": 0} and cache.l1_room() == 5
    assert cache.warm(m, keep=1) == 4  # one slot of the room left to others
    assert in_l1(cache, DOC) == [True] * 4 + [False] * 4
    blocks = cache.match(DOC).blocks
    assert all(e.ref == 0 and e.l2 >= 0 for e in blocks)  # cached, not held; L2 keeps every copy
    assert cache.l1_room() == 5  # they are room for whoever needs it
    assert cache.stats()["warmed_blocks"] == 4 and cache.stats()["warmed_unused"] == 0
    # warming again evicts none of its own blocks for the others
    assert cache.warm(cache.match(DOC), keep=1) == 0
    assert in_l1(cache, DOC) == [True] * 4 + [False] * 4
    cache.free(other)
    moved = cache.stats()["tiers"]["l2"]["bytes_out"]
    seq = cache.allocate(DOC)
    assert seq.num_cached_tokens == 32 and seq.cached_by_tier == {"l1": 0, "l2": 32, "l3": 0}
    assert cache.stats()["tiers"]["l2"]["bytes_out"] - moved == 4 * BPB  # the rest only
    seq.wait()
    assert torch.equal(read_slots(cache, seq, 32), prefix_kv(LAYOUT, DOC)[:, :, :32])
    cache.free(seq)
    again = cache.allocate(DOC)  # warmed once: the next use is an L1 hit
    assert again.cached_by_tier == {"l1": 32, "l2": 0, "l3": 0}
    cache.free(again)
    cache.evict("l1")  # taken once: none of them counts as unused when it leaves
    assert cache.stats()["warmed_unused"] == 0
    cache.close()


def test_warmed_blocks_give_way_to_a_running_sequence_at_no_cost():
    cache = cache_with_doc_in_l2()
    other = running(cache, 5000, 7)
    assert cache.warm(cache.match(DOC)) == 5
    drops = cache.stats()["tiers"]["l1"]["drops"]
    cache.append(other, 4 * LAYOUT.block_size)  # its next four blocks take four of them back
    assert sum(in_l1(cache, DOC)) == 1
    assert cache.stats()["tiers"]["l1"]["drops"] == drops  # nothing lost: L2 holds them
    assert cache.stats()["warmed_blocks"] == 5 and cache.stats()["warmed_unused"] == 4  # four loads for nothing
    assert cache.match(DOC).by_tier["l2"] == 28  # every block still cached
    cache.free(other)
    seq = cache.allocate(DOC)
    seq.wait()
    assert seq.cached_by_tier["l2"] == 32
    assert torch.equal(read_slots(cache, seq, 32), prefix_kv(LAYOUT, DOC)[:, :, :32])
    cache.free(seq)
    cache.close()


def test_warm_keeps_the_prompts_own_l1_hits_and_its_l2_blocks():
    cache = cache_with_doc_in_l2()
    head = cache.allocate(DOC[:9])  # brings DOC's first two blocks back into L1
    cache.free(head)
    other = running(cache, 5000, 7)
    assert in_l1(cache, DOC)[:2] == [True, True] and cache.l1_room() == 5
    # room for 5, of which its own two L1 blocks are not to be evicted: 3 loads
    assert cache.warm(cache.match(DOC)) == 3
    assert in_l1(cache, DOC) == [True] * 5 + [False] * 3
    assert all(e.l2 >= 0 for e in cache.match(DOC).blocks)
    cache.free(other)
    cache.close()


def test_after_a_warm_the_prompts_blocks_give_way_tail_first():
    # as after free(): a prompt whose tail blocks are evicted keeps a shorter hit, one whose head
    # goes keeps none in L1
    cache = cache_with_doc_in_l2()
    head = cache.allocate(DOC[:13])  # DOC's first three blocks back in L1
    cache.free(head)
    other = running(cache, 5000, 7)  # 2 free slots left
    assert cache.warm(cache.match(DOC), limit=2) == 2  # its blocks 3 and 4, its L1 hits kept
    assert in_l1(cache, DOC) == [True] * 5 + [False] * 3
    cache.append(other, 4 * LAYOUT.block_size)  # four of the five go again
    assert in_l1(cache, DOC) == [True] + [False] * 7
    cache.free(other)
    cache.close()


def test_nothing_to_warm_where_l1_has_no_room_or_every_block_is_there():
    cache = cache_with_doc_in_l2()
    other = running(cache, 5000, 12)  # all of L1
    assert cache.warm(cache.match(DOC)) == 0 and not any(in_l1(cache, DOC))
    cache.free(other)
    seq = cache.allocate(DOC)
    cache.free(seq)
    assert cache.warm(cache.match(DOC)) == 0  # already in L1
    cache.close()


def two_running_and_doc_waiting():
    """A scheduler over L1 of 20 blocks: two 7-block prompts queued first, then DOC (its 8 cached
    blocks in L2 alone)."""
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=20 * BPB, l2=64 * BPB), device="cpu", model="warm")
    cache.store(DOC, prefix_kv(LAYOUT, DOC))
    cache.evict("l1")
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a, b = (Request(list(range(first, first + 28)), params) for first in (5000, 6000))
    waiting = Request(DOC, params)
    for r in (a, b, waiting):
        sched.add(r)
    return cache, sched, a, b, waiting


def doc_waiting_beside_a_runner(monkeypatch, slice_blocks: int):
    """A scheduler over L1 of 40 blocks, loads in slices of `slice_blocks`: one prompt runs, and
    DOC (its 8 cached blocks in L2 alone) has just arrived."""
    monkeypatch.setattr(scheduling, "LOAD_SLICE_BLOCKS", slice_blocks)
    cache = cache_with_doc_in_l2(40)
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runner, doc = Request(list(range(5000, 5028)), params), Request(DOC, params)
    sched.add(runner)
    assert sched.schedule().requests == [runner]
    sched.add(doc)
    return cache, sched, runner, doc


def test_the_scheduler_warms_the_waiting_request_that_does_not_fit():
    """Two histories run, a third waits: L1 (20 blocks) has room for 6 of its 9 blocks. Its 8
    cached blocks load into that room while the two decode, one slot left to each of them; once
    one ends, it is admitted with all 8 cached, 2 of them loaded then."""
    cache, sched, a, b, waiting = two_running_and_doc_waiting()
    step = sched.schedule()
    assert step.requests == [a, b]  # 7 blocks each, with their answers' next block: 14 of 20
    assert waiting in sched.waiting and cache.l1_room() == 6
    assert in_l1(cache, DOC) == [True] * 4 + [False] * 4  # 6 of room, less one for each runner
    moved = cache.stats()["tiers"]["l2"]["bytes_out"]
    sched.finish(a, "stop")
    step = sched.schedule()
    assert waiting in step.requests and waiting.seq.num_cached_tokens == 32
    assert waiting.cached_by_tier == {"l1": 0, "l2": 32, "l3": 0}
    assert cache.stats()["tiers"]["l2"]["bytes_out"] - moved == 4 * BPB
    cache.close()


def test_room_made_for_warm_blocks_never_costs_the_prompt_its_other_l2_blocks():
    # L2 is nearly full of DOC: evicting L1 blocks that L2 lacks, to make the room, writes them down
    # and so evicts L2 blocks; DOC's last ones, left for allocate to load, must not be among them
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=12 * BPB, l2=10 * BPB, write_policy="write_back"), device="cpu",
                          model="warm")
    cache.store(DOC, prefix_kv(LAYOUT, DOC))
    cache.evict("l1")
    other = running(cache, 5000, 7)
    side = list(range(7000, 7017))  # 4 blocks cached in L1 alone, the first to go for room
    cache.store(side, prefix_kv(LAYOUT, side))
    assert cache.match(side).by_tier["l1"] == 16 and cache.l1_room() == 5
    assert cache.warm(cache.match(DOC), keep=1) == 4
    assert cache.match(DOC).by_tier == {"l1": 16, "l2": 16, "l3": 0}  # every block still cached
    cache.free(other)
    seq = cache.allocate(DOC)
    seq.wait()
    assert seq.num_cached_tokens == 32
    assert torch.equal(read_slots(cache, seq, 32), prefix_kv(LAYOUT, DOC)[:, :, :32])
    cache.free(seq)
    cache.close()


def test_while_others_run_one_request_whose_blocks_load_is_admitted_a_step(monkeypatch):
    """Admitting costs the host a lookup, slots and the launch of its loads, and the step launches
    only after the scheduler returns: with a batch running, one request whose blocks still load
    (it cannot join the step anyway) is admitted per step, the next one a step later. On a CPU a
    load lands at once, so loads are held in flight here."""
    cache = TieredKVCache(LAYOUT, CacheConfig(l1=40 * BPB, l2=64 * BPB), device="cpu", model="warm")
    docs = [DOC, list(range(2000, 2033))]
    for doc in docs:
        cache.store(doc, prefix_kv(LAYOUT, doc))
    cache.evict("l1")
    monkeypatch.setattr(scheduling, "_loading", lambda req: req.seq.cached_by_tier["l2"] > 0)
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runner = Request(list(range(5000, 5028)), params)
    first, second = (Request(doc, params) for doc in docs)
    sched.add(runner)
    assert sched.schedule().requests == [runner]
    sched.add(first)
    sched.add(second)
    step = sched.schedule()
    assert step.requests == [runner] and first in sched.running and second in sched.waiting
    step = sched.schedule()
    assert step.requests == [runner] and second in sched.running and not sched.waiting
    assert first.seq.cached_by_tier["l2"] == second.seq.cached_by_tier["l2"] == 32
    cache.close()


def test_warm_leaves_l1s_spare_slots_free_and_a_running_sequences_next_block_evicts_none_of_it():
    # 128 slots keep 2 spare (Tiering.spare): warming into them, the running sequence's next
    # block would evict two of the blocks just warmed to free them again
    cache = cache_with_doc_in_l2(128)
    assert cache.tiers.spare == 2
    other = running(cache, 5000, 120)
    assert cache.l1_room() == 8
    assert cache.warm(cache.match(DOC), keep=1) == 8 - 2 - 1
    cache.append(other, LAYOUT.block_size)  # the block `keep` left room for
    assert in_l1(cache, DOC) == [True] * 5 + [False] * 3
    assert cache.stats()["warmed_unused"] == 0 and len(cache.l1.free) == 2
    cache.close()


def test_while_others_run_a_long_load_is_warmed_a_slice_a_step_before_its_admission(monkeypatch):
    """Admitting loads every L2 block of the prompt at once, and the step launches only after
    that: the host's work per block loaded (an 8K-token Llama-8B history: ~500 blocks, ~15 ms
    with its lookup) kept the GPU idle after each decode step of a turnover. So while others
    compute, a prompt with more than LOAD_SLICE_BLOCKS of them to load is warmed that many a
    step, and admitted once the rest is one slice; each block is loaded once. With nothing else
    running it is admitted at once (the GPU has nothing to do meanwhile)."""
    cache, sched, runner, doc = doc_waiting_beside_a_runner(monkeypatch, 3)
    moved = cache.stats()["tiers"]["l2"]["bytes_out"]
    for warmed in (3, 6):  # DOC's 8 cached blocks, all in L2
        assert sched.schedule().requests == [runner] and doc in sched.waiting
        assert in_l1(cache, DOC) == [True] * warmed + [False] * (8 - warmed)
    sched.schedule()  # 2 left: admitted, loading them
    assert doc in sched.running and doc.seq.num_cached_tokens == 32
    assert doc.cached_by_tier == {"l1": 0, "l2": 32, "l3": 0}  # warmed blocks count as L2 hits
    assert cache.stats()["tiers"]["l2"]["bytes_out"] - moved == 8 * BPB  # each block loaded once
    doc.seq.wait()
    assert torch.equal(read_slots(cache, doc.seq, 32), prefix_kv(LAYOUT, DOC)[:, :, :32])
    cache.close()

    alone = cache_with_doc_in_l2(40)
    sched = Scheduler(alone, max_num_seqs=8, max_num_batched_tokens=256)
    doc = Request(DOC, doc.params)
    sched.add(doc)
    sched.schedule()
    assert doc in sched.running and doc.seq.num_cached_tokens == 32
    alone.close()


def test_a_slice_evicted_again_before_the_next_one_admits_the_request_at_once(monkeypatch):
    """Room the runners need may evict warmed blocks (they are cached, not held): where a slice
    brought the request no nearer, it is admitted and loads the rest, never warmed forever."""
    cache, sched, runner, doc = doc_waiting_beside_a_runner(monkeypatch, 3)
    sched.schedule()
    assert doc in sched.waiting and in_l1(cache, DOC) == [True] * 3 + [False] * 5
    cache.evict("l1")  # as if others' room took the slice back: all 8 blocks are in L2 again
    sched.schedule()
    assert doc in sched.running and doc.seq.num_cached_tokens == 32
    doc.seq.wait()
    assert torch.equal(read_slots(cache, doc.seq, 32), prefix_kv(LAYOUT, DOC)[:, :, :32])
    cache.close()


def test_a_request_that_does_not_fit_is_warmed_a_slice_a_step_while_the_room_lasts(monkeypatch):
    """As the scheduler test above, in slices of 2: the room for 4 of its blocks fills over two
    steps, and once it is full the request is not looked up again until the room grows."""
    monkeypatch.setattr(scheduling, "LOAD_SLICE_BLOCKS", 2)
    cache, sched, a, b, waiting = two_running_and_doc_waiting()
    plans = []
    plan = cache.plan
    monkeypatch.setattr(cache, "plan", lambda *args, **kw: plans.append(args[0]) or plan(*args, **kw))
    for warmed, looked_up in ((2, 1), (4, 2), (4, 3), (4, 3)):
        assert sched.schedule().requests == [a, b] and waiting in sched.waiting
        assert in_l1(cache, DOC) == [True] * warmed + [False] * (8 - warmed)
        assert plans.count(DOC) == looked_up  # the third finds no room left, the fourth no lookup
    sched.finish(a, "stop")  # it fits now; b still runs, so the rest comes in slices too
    sched.schedule()
    assert in_l1(cache, DOC) == [True] * 6 + [False] * 2 and waiting in sched.waiting
    step = sched.schedule()  # the last slice loads as it is admitted
    assert waiting in step.requests and waiting.seq.num_cached_tokens == 32
    waiting.seq.wait()
    assert torch.equal(read_slots(cache, waiting.seq, 32), prefix_kv(LAYOUT, DOC)[:, :, :32])
    cache.close()
