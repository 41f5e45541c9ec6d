"""Async scheduling: step N+1 is scheduled and launched before step N's tokens reach the host.

The tokens (and logprobs, finish reasons) are the same with overlap on and off, through chunked
prefill, prefix hits, preemption to L2, stop tokens, seeded sampling and penalties; a step really
is left in flight between calls; no token is computed past max_tokens; aborting a request whose
token is on its way leaves nothing held.
"""

from __future__ import annotations

import pytest
import torch
from models import save_tiny_checkpoint

from tierkv import LLM, SamplingParams

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-overlap"), seed=4))


def prompts(lengths, seed: int = 0, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 512, (shared,), generator=g).tolist()
    return [head + torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def run(path: str, ps, params, **options):
    llm = LLM(path, device="cpu", **options)
    outs = llm.generate(ps, params, use_tqdm=False)
    engine = llm.engine
    llm.close()
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs], engine


def mixed_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=14, logprobs=3),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=21),
        SamplingParams(temperature=0, max_tokens=17, logprobs=0),
    ]


@pytest.mark.parametrize("options", [
    dict(),                                     # prompts in one step each
    dict(max_num_batched_tokens=24),            # chunked prefill beside decodes
    dict(l1_blocks=8, l2="4MiB"),               # an L1 so small that requests are preempted to L2
], ids=["plain", "chunked", "preempted"])
def test_overlap_gives_the_same_tokens(tiny_llama, options):
    if "l1_blocks" in options:
        options = dict(options)
        options["l1"] = options.pop("l1_blocks") * LLM(tiny_llama, device="cpu").cache.layout.bytes_per_block
    ps = prompts((5, 40, 23, 61, 8, 33), seed=1, shared=20)
    # a stop token the second request is known to produce, so it stops early
    (greedy, _, _), = run(tiny_llama, [ps[1]], SamplingParams(temperature=0, max_tokens=30), async_scheduling=False)[0]
    params = mixed_params(stop_token=greedy[6])
    off, engine_off = run(tiny_llama, ps, params, async_scheduling=False, **options)
    on, engine_on = run(tiny_llama, ps, params, **options)
    assert [o[:2] for o in on] == [o[:2] for o in off]  # tokens and finish reasons
    # Logprobs agree to fp32 rounding: a preemption may come one step later with overlap (a
    # request that stopped still holds its blocks while its next step is in flight), and the
    # recomputed prompt then runs in another batch shape, which CPU GEMMs round differently.
    for (_, _, lp_on), (_, _, lp_off) in zip(on, off):
        assert (lp_on is None) == (lp_off is None)
        for a, b in zip(lp_on or [], lp_off or []):
            assert a["token_id"] == b["token_id"] and [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
    assert off[1][1] == "stop" and len(off[1][0]) <= 7
    if "l1" in options:
        assert engine_on.scheduler.num_preemptions > 0


def test_a_step_stays_in_flight_between_calls(tiny_llama):
    ps = prompts((12, 30), seed=2)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sync = LLM(tiny_llama, device="cpu", async_scheduling=False).engine
    for p in ps:
        sync.add_request(p, params)
    assert len(sync.step()) == 2 and sync.in_flight is None  # the prefill's tokens come back at once

    engine = LLM(tiny_llama, device="cpu").engine
    reqs = [engine.add_request(p, params) for p in ps]
    assert engine.step() == []  # the prefill was launched; its tokens are taken back next call
    assert engine.in_flight is not None and [r.pending for r in reqs] == [1, 1]
    outs = engine.step()  # launches the first decode (reading the pending tokens on the device) ...
    assert [o.new_token_ids for o in outs] == [[r.output_ids[0]] for r in reqs]  # ... then takes these
    assert [r.pending for r in reqs] == [1, 1] and all(r.num_computed == len(p) + 1 for r, p in zip(reqs, ps))
    while engine.has_unfinished():
        engine.step()
    assert [len(r.output_ids) for r in reqs] == [5, 5]


def test_no_token_is_computed_past_max_tokens(tiny_llama):
    ps = prompts((7, 19, 44), seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 6, 11)]
    llm = LLM(tiny_llama, device="cpu", enable_prefix_caching=False)
    computed = []
    real_run = llm.engine.runner.run

    def counting_run(step, previous=None):
        computed.append(sum(step.num_new))
        return real_run(step, previous)

    llm.engine.runner.run = counting_run
    outs = llm.generate(ps, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [1, 6, 11]
    # every prompt token and every output token but the last: the last one's KV is never needed
    assert sum(computed) == sum(len(p) + p_.max_tokens - 1 for p, p_ in zip(ps, params))


def test_each_step_sends_its_inputs_in_one_upload_pending_rows_included(tiny_llama, monkeypatch):
    """A step's arrays go to the device in one kernels.upload call (on a GPU one kernel, which no
    DMA on the copy engines can hold up), the rows of tokens still on their way included."""
    from tierkv import kernels

    llm = LLM(tiny_llama, device="cpu")
    names = {id(h.table): h.names for h in llm.engine.runner.inputs._hosts}
    real, calls = kernels.upload, []

    def upload(table, counts):
        calls.append(dict(zip(names[id(table)], counts)))
        return real(table, counts)

    monkeypatch.setattr(kernels, "upload", upload)
    ps = prompts((12, 30, 7), seed=3)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    steps = sum(sum(h.counts) for h in llm.engine.stats.batch.values())
    llm.close()
    assert all(len(o.token_ids) == 6 for o in outs)
    assert len(calls) == steps > 0
    # the prompts' steps send their tokens; decode steps read the pending token on the device
    assert sum(c["input_ids"] for c in calls) == sum(map(len, ps)) + 3 * 5
    assert any(c["pending_at"] > 0 for c in calls) and all(c["pending_at"] == c["pending_from"] for c in calls)


def test_penalties_run_each_step_to_completion(tiny_llama):
    ps = prompts((9, 25), seed=4)
    params = SamplingParams(temperature=0.8, seed=11, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=12)
    off, _ = run(tiny_llama, ps, params, async_scheduling=False)
    on, _ = run(tiny_llama, ps, params)
    assert on == off
    engine = LLM(tiny_llama, device="cpu").engine
    seen = []
    real_run = engine.runner.run

    def recording_run(step, previous=None):
        seen.append((previous is None, [r.pending for r in step.requests]))
        return real_run(step, previous)

    engine.runner.run = recording_run
    engine.add_request(ps[0], params)
    while engine.has_unfinished():
        engine.step()
    # every step was prepared with the last one's tokens already on the host
    assert len(seen) == 12 and all(fresh and pending == [0] for fresh, pending in seen)


def test_abort_with_a_token_on_its_way_frees_everything(tiny_llama):
    llm = LLM(tiny_llama, device="cpu")
    engine = llm.engine
    ps = prompts((40, 40, 40), seed=6)
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=50)) for p in ps]
    engine.step()
    engine.step()
    assert all(r.pending == 1 for r in reqs)
    for r in reqs:
        engine.abort(r.request_id)
    assert not engine.has_unfinished()
    # the engine still works, and what it computes does not see the aborted requests' last writes
    fresh = prompts((17,), seed=7)
    want = LLM(tiny_llama, device="cpu", async_scheduling=False).generate(fresh, SamplingParams(temperature=0, max_tokens=8),
                                                                         use_tqdm=False)
    got = llm.generate(fresh, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert got[0].token_ids == want[0].token_ids
    assert all(e.ref == 0 for e in llm.cache.index.entries.values())
    assert len(llm.cache.l1.free) + sum(e.l1 >= 0 for e in llm.cache.index.entries.values()) == llm.cache.l1.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=24)], ids=["plain", "chunked"])
def test_overlap_gives_the_same_tokens_on_a_gpu(tiny_llama, options):
    """fp32 on CUDA with decode graphs: the pending tokens are gathered into the graph's inputs."""
    ps = prompts((5, 40, 23, 61, 8, 33), seed=8, shared=20)
    params = [SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(5)]
    params.append(SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=2, max_tokens=19, logprobs=2))

    def tokens(**extra):
        llm = LLM(tiny_llama, device="cuda", dtype="float32", l1="64MiB", l2=0, max_num_seqs=8, **options, **extra)
        outs = llm.generate(ps, params, use_tqdm=False)
        replays = llm.engine.runner.graphs.replays
        llm.close()
        return [(o.token_ids, o.finish_reason) for o in outs], replays

    (on, replays), (off, _) = tokens(), tokens(async_scheduling=False)
    assert on == off
    assert replays > 0
