"""The engine end to end (scheduler, runner, sampler, cache) against Hugging Face transformers.

Greedy generation through `tierkv.LLM` equals transformers `generate` token for token; the
tokens do not change with prefix caching on or off, with chunked prefill, or with an L1 so
small that requests are preempted and resumed from L2; seeds reproduce; bad input is refused
before any work with a message that says what to change.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from models import bundled_cache_dir, save_tiny_checkpoint, truncate_at_eos

from tierkv import LLM, SamplingParams, transfer
from tierkv.engine.scheduler import ScheduledStep
from tierkv.engine.stats import EngineStats
from tierkv.errors import ConfigError

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def shared_prefix_prompts(vocab: int, n: int = 6) -> list[list[int]]:
    base = random_prompts(vocab, [50], seed=1)[0]
    return [base + tail for tail in random_prompts(vocab, [3 + 5 * i for i in range(n)], seed=2)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    path = save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), hf


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-engine"), seed=3))


def block_bytes(llm: LLM) -> int:
    return llm.cache.layout.bytes_per_block


@torch.inference_mode()
def test_llm_greedy_equals_transformers(tiny):
    path, hf = tiny
    # a 64-token step budget splits the longer prompts over several steps (chunked prefill)
    llm = LLM(path, device="cpu", max_num_batched_tokens=64)
    prompts = random_prompts(512, (5, 23, 40, 90))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 16)
        assert out.finish_reason == "length"


def test_tokens_do_not_depend_on_caching_chunking_or_preemption(tiny_llama):
    prompts = shared_prefix_prompts(512)
    ref = [o.token_ids for o in LLM(tiny_llama, device="cpu", enable_prefix_caching=False)
           .generate(prompts, GREEDY, use_tqdm=False)]

    cached = LLM(tiny_llama, device="cpu")
    assert [o.token_ids for o in cached.generate(prompts, GREEDY, use_tqdm=False)] == ref
    again = cached.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == ref
    assert all(o.cached_tokens >= 48 for o in again)  # the 50-token shared prefix, in whole blocks

    chunked = LLM(tiny_llama, device="cpu", max_num_batched_tokens=16)
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)] == ref



def test_preempted_requests_resume_from_l2(tiny_llama):
    # Two 40-token prompts growing to 80 tokens (5 blocks each) in an L1 of 7 blocks: the later
    # one is preempted, its blocks are evicted to L2 while the other finishes, and it resumes
    # by loading them back instead of recomputing them.
    prompts = random_prompts(512, (40, 40), seed=5)
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = [o.token_ids for o in LLM(tiny_llama, device="cpu", enable_prefix_caching=False)
           .generate(prompts, params, use_tqdm=False)]
    probe = LLM(tiny_llama, device="cpu", l1=1 << 20)
    small = LLM(tiny_llama, device="cpu", l1=7 * block_bytes(probe), l2=64 * block_bytes(probe),
                write_policy="write_back")
    assert [o.token_ids for o in small.generate(prompts, params, use_tqdm=False)] == ref
    assert small.engine.scheduler.num_preemptions > 0
    assert small.cache.stats()["tiers"]["l2"]["blocks_out"] > 0  # resumed from what L2 kept


def test_seeds_reproduce_and_differ(tiny_llama):
    llm = LLM(tiny_llama, device="cpu")
    prompts = random_prompts(512, (7, 30))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=12)
    first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # the same seeds in another batch make-up give the same tokens
    assert [o.token_ids for o in llm.generate(prompts[::-1], params, use_tqdm=False)] == first[::-1]
    other = SamplingParams(temperature=1.0, top_p=0.95, seed=8, max_tokens=12)
    assert [o.token_ids for o in llm.generate(prompts, other, use_tqdm=False)] != first


def test_bad_input_is_refused_before_any_work(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, device="cpu", max_model_len=64)
    with pytest.raises(ConfigError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ConfigError, match="at most 63"):
        llm.generate([[1] * 64], use_tqdm=False)
    with pytest.raises(ConfigError, match="max_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=0), use_tqdm=False)
    with pytest.raises(ConfigError, match="did you mean 'temperature'"):
        SamplingParams(temprature=0.5)
    with pytest.raises(ConfigError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing was queued by the failed calls
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="supported model types: llama, mistral, qwen2, qwen3"):
        LLM(str(bad), device="cpu")


def test_abort_frees_everything(tiny_llama):
    llm = LLM(tiny_llama, device="cpu")
    engine = llm.engine
    reqs = [engine.add_request(p, SamplingParams(max_tokens=50)) for p in random_prompts(512, (40, 40, 40))]
    engine.step()
    for r in reqs:
        engine.abort(r.request_id)
    assert not engine.has_unfinished()
    assert all(e.ref == 0 for e in llm.cache.index.entries.values())
    assert len(llm.cache.l1.free) + sum(e.l1 >= 0 for e in llm.cache.index.entries.values()) == llm.cache.l1.num_blocks


@pytest.fixture(scope="module")
def smollm():
    llm = LLM(device="cpu", cache_dir=str(bundled_cache_dir()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.lm.model_dir, dtype=torch.float32).eval()
    return llm, hf


@torch.inference_mode()
def test_bundled_model_through_llm(smollm):
    llm, hf = smollm
    tok = llm.tokenizer
    doc = "The quick brown fox jumps over the lazy dog. " * 6
    prompts = [doc + "What does the fox jump over?", doc + "What colour is the fox?"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([tok.encode(prompt)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert out.token_ids == truncate_at_eos(ref[0, ids.shape[1]:].tolist(), tok.eos_token_ids[0])
        assert out.text == tok.decode(out.token_ids)
    again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert again.cached_tokens >= 48 and again.token_ids == outs[0].token_ids
    assert "Paris" in llm.generate("The capital of France is", use_tqdm=False)[0].text
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}], use_tqdm=False)[0]
    assert "Paris" in reply.text


def test_stop_strings_cut_the_text(smollm):
    llm, _ = smollm
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=30, stop=[" 6"]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and " 6" not in out.text and "5" in out.text


def streamed(llm: LLM, prompt: str, params: SamplingParams) -> list:
    """The engine's outputs of one request as a streaming caller (the server) gets them."""
    engine = llm.engine
    req = engine.add_request(llm.tokenizer.encode(prompt), params)
    outs: list = []
    while engine.has_unfinished():
        engine.step(emit=outs.extend)
    return [o for o in outs if o.request_id == req.request_id]


# SmolLM2 continues "1, 2, 3, 4, 5, 6," greedily with " 7, 8, 9, 10, ...", one token each for
# " ", "7", ",": the stop string ", 9" begins two tokens before the one that completes it.
COUNT = "1, 2, 3, 4, 5, 6,"


def test_a_stop_string_begun_in_earlier_tokens_is_cut_whole(smollm):
    llm, _ = smollm
    plain = llm.generate(COUNT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert plain.text.startswith(" 7, 8, 9, 10")  # what makes this test mean something
    params = SamplingParams(temperature=0, max_tokens=20, stop=[", 9"])
    out = llm.generate(COUNT, params, use_tqdm=False)[0]
    assert (out.text, out.finish_reason) == (" 7, 8", "stop")  # vLLM's answer
    kept = llm.generate(COUNT, SamplingParams(temperature=0, max_tokens=20, stop=[", 9"],
                                              include_stop_str_in_output=True), use_tqdm=False)[0]
    assert (kept.text, kept.finish_reason) == (" 7, 8, 9", "stop")
    # streamed: the text sent never runs past what the answer keeps
    outs = streamed(llm, COUNT, params)
    assert "".join(o.new_text for o in outs) == outs[-1].text == " 7, 8"
    sent = ""
    for o in outs:
        sent += o.new_text
        assert o.text == sent and " 7, 8".startswith(sent)


def test_streaming_holds_back_what_a_stop_string_could_still_take(smollm):
    # As vLLM does: until the request finishes, the last (longest stop string - 1) characters stay
    # back, and they leave with the last output when no stop string matched.
    llm, _ = smollm
    tok = llm.tokenizer
    outs = streamed(llm, COUNT, SamplingParams(temperature=0, max_tokens=8, stop=["never", "xyz"]))
    full = tok.decode(outs[-1].token_ids)
    assert outs[-1].finish_reason == "length" and outs[-1].text == full == " 7, 8, 9"
    assert "".join(o.new_text for o in outs) == full
    for o in outs[:-1]:
        assert o.text == tok.decode(o.token_ids)[:-4]  # "never" has 5 characters: 4 held back
    # with include_stop_str_in_output nothing is held back (the stop string stays in the text anyway)
    outs = streamed(llm, COUNT, SamplingParams(temperature=0, max_tokens=8, stop=["never"],
                                               include_stop_str_in_output=True))
    assert all(o.text == tok.decode(o.token_ids) for o in outs)


def test_the_stopping_token_text_is_left_out_unless_asked_for(smollm):
    llm, _ = smollm
    # "1, 2, 3," goes on " 4," and "," is token 28: it ends the output, and its text is not in it (vLLM)
    stop = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[28])
    out = llm.generate("1, 2, 3,", stop, use_tqdm=False)[0]
    assert (out.text, out.token_ids, out.finish_reason) == (" 4", [216, 36, 28], "stop")
    outs = streamed(llm, "1, 2, 3,", stop)
    assert "".join(o.new_text for o in outs) == " 4" and outs[-1].new_token_ids == [28]
    kept = llm.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[28],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0]
    assert (kept.text, kept.token_ids) == (" 4,", [216, 36, 28])
    # the end-of-sequence token is a stopping token too: its text shows only when asked for
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    special = dict(temperature=0, max_tokens=40, skip_special_tokens=False)
    out = llm.chat(chat, SamplingParams(**special), use_tqdm=False)[0]
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids and out.finish_reason == "stop"
    assert out.text == "The capital of France is Paris."
    kept = llm.chat(chat, SamplingParams(**special, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == "The capital of France is Paris.<|im_end|>"


def test_a_request_that_outgrows_all_of_l1_ends_with_length(tiny_llama):
    probe = LLM(tiny_llama, device="cpu", l1=1 << 20)
    llm = LLM(tiny_llama, device="cpu", l1=3 * block_bytes(probe))  # 48 tokens of KV in all
    short, long = random_prompts(512, (5, 30), seed=9)
    outs = llm.generate([short, long], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    # KV is kept for every token but the last one sampled: 5 + 39 tokens fit, 30 + 39 do not
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 40
    assert outs[1].finish_reason == "length" and 30 + len(outs[1].token_ids) - 1 <= 48 < 30 + 39
    assert not llm.engine.has_unfinished()


def test_engine_time_counts_its_steps_batch_and_host_phases(tiny_llama):
    """Two prompts admitted together: one step computes both prompts (mixed), then each decode
    step runs both (every request one token), until their 6th tokens; no step launches nothing."""
    llm = LLM(tiny_llama, device="cpu", l1=1 << 20)
    t = time.perf_counter()
    llm.generate(random_prompts(512, (9, 14), seed=4), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    wall = time.perf_counter() - t
    e = llm.engine.engine_stats()
    assert e["steps"] == {"mixed": 1, "decode": 5}
    assert e["step_requests"] == 2 * 6
    decode = e["step_batch"]["decode"]  # every decode step ran both: five steps of a batch of 2
    assert decode["counts"][decode["bounds"].index(2)] == 5 and sum(decode["counts"]) == 5
    assert e["idle_steps"] == 0 and e["idle_seconds"] == 0.0
    host = e["host_seconds"]
    assert set(host) == {"schedule", "launch", "wait", "postprocess"}
    assert all(host[p] > 0 for p in ("schedule", "launch", "postprocess"))
    assert host["wait"] == 0.0  # on a CPU a launched step is done when run returns: nothing to wait for
    assert host["launch"] > host["schedule"]  # on a CPU launching computes the model
    assert sum(host.values()) <= wall


def test_steps_that_launch_nothing_count_as_idle(tiny_llama, monkeypatch):
    """A scheduler with nothing to run for its first three calls (as while loads land): three
    idle steps, whose seconds are part of the engine thread's, and the same steps after them."""
    llm = LLM(tiny_llama, device="cpu", l1=1 << 20)
    schedule, calls = llm.engine.scheduler.schedule, []

    def held():
        calls.append(1)
        if len(calls) <= 3:
            time.sleep(0.01)
            return ScheduledStep([], [])
        return schedule()

    monkeypatch.setattr(llm.engine.scheduler, "schedule", held)
    llm.generate(random_prompts(512, (9,), seed=5), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    e = llm.engine.engine_stats()
    assert e["idle_steps"] == 3 and e["steps"] == {"mixed": 1, "decode": 2}
    assert 0.03 <= e["idle_seconds"] <= sum(e["host_seconds"].values())


_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="needs a CUDA GPU (run through the device tool)")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_ON_GPU),
                                    pytest.param("cuda-dma", marks=_ON_GPU)])
def test_several_l2_hits_are_admitted_in_one_step_beside_a_decode(tiny_llama, device, monkeypatch):
    # Three prompts cached, then pushed out of L1 into L2; while a fourth request decodes, all
    # three come back extended: the next step admits them together, each starting after its L2
    # part (loaded, not recomputed), and the tokens equal a run without caching. On a GPU the
    # loads are asynchronous: a hit computes once its blocks landed (beside the decode, or when
    # nothing else runs and its load is short) or at once, layer by layer (a long load with nothing
    # else to run); the tokens must not change.
    dma_on = device == "cuda-dma"
    if device == "cuda":  # every move by the GPU's own copies
        monkeypatch.setattr(transfer, "DMA_MOVES", False)
    if dma_on:  # every move by staged DMA, through a staging buffer of one block
        device = "cuda"
        monkeypatch.setattr(transfer, "DMA_MOVES", True)
        monkeypatch.setattr(transfer, "MIN_DMA_BYTES", 0)
        monkeypatch.setattr(transfer, "MIN_DMA_ROW", 0)
        monkeypatch.setattr(transfer, "STAGING_BYTES", 1)  # rounds up to one block: a chunk per block
    prompts = random_prompts(512, (48, 48, 48, 20), seed=7)
    later = [p + [7, 8, 9] for p in prompts[:3]]
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = LLM(tiny_llama, device=device, enable_prefix_caching=False).generate(later, params, use_tqdm=False)
    probe = LLM(tiny_llama, device=device, l1=1 << 20)
    llm = LLM(tiny_llama, device=device, l1=64 * block_bytes(probe), l2=64 * block_bytes(probe),
              write_policy="write_back", max_num_batched_tokens=256)
    assert llm.cache.tiers.mover.dma == dma_on
    llm.generate(prompts[:3], params, use_tqdm=False)
    llm.cache.evict("l1")
    engine, steps = llm.engine, []
    # load what L2 holds however cheap recomputing it is (a tiny model on a GPU would recompute)
    engine.scheduler.recompute_seconds_per_token = None
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    runner = engine.add_request(prompts[3], SamplingParams(temperature=0, max_tokens=30))
    while runner.num_computed < len(prompts[3]):
        engine.step()  # the fourth request is decoding now
    hits = [engine.add_request(p, params) for p in later]
    engine.step()
    step = steps[-1]
    assert [h.cached_tokens for h in hits] == [48] * 3  # three full blocks each, from L2
    if device == "cpu":  # loads are done on return
        assert runner in step.requests and all(h in step.requests for h in hits)
        assert all(step.num_new[step.requests.index(h)] == len(later[0]) - 48 for h in hits)
    while engine.has_unfinished():
        engine.step()
    assert [h.output_ids for h in hits] == [o.token_ids for o in ref]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_ON_GPU)])
def test_a_long_l2_hit_beside_a_decode_comes_in_slices_and_gives_the_same_tokens(tiny_llama, device, monkeypatch):
    # While a request decodes, a prompt whose L2 part is more than LOAD_SLICE_BLOCKS (here 1)
    # blocks is warmed into L1 a block a step, and admitted with the last one: its 3 cached
    # blocks are loaded once each, none recomputed, and the tokens equal a run without caching.
    from tierkv.engine import scheduler as scheduling

    monkeypatch.setattr(scheduling, "LOAD_SLICE_BLOCKS", 1)
    prompt = random_prompts(512, (48, 20), seed=11)
    later = prompt[0] + [7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = LLM(tiny_llama, device=device, enable_prefix_caching=False).generate([later], params, use_tqdm=False)
    probe = LLM(tiny_llama, device=device, l1=1 << 20)
    llm = LLM(tiny_llama, device=device, l1=64 * block_bytes(probe), l2=64 * block_bytes(probe),
              write_policy="write_back", max_num_batched_tokens=256)
    llm.generate([prompt[0]], params, use_tqdm=False)
    llm.cache.evict("l1")
    engine = llm.engine
    engine.scheduler.recompute_seconds_per_token = None  # load what L2 holds (a tiny model recomputes fast)
    runner = engine.add_request(prompt[1], SamplingParams(temperature=0, max_tokens=30))
    while runner.num_computed < len(prompt[1]):
        engine.step()
    hit = engine.add_request(later, params)
    waited = 0
    while hit.seq is None:
        engine.step()
        waited += 1
    assert waited == 3  # two steps warm a block each; the third admits it, loading the last
    assert hit.cached_tokens == 48 and hit.cached_by_tier == {"l1": 0, "l2": 48, "l3": 0}
    assert llm.cache.stats()["warmed_blocks"] == 2
    while engine.has_unfinished():
        engine.step()
    assert hit.output_ids == ref[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_the_recompute_cost_counts_the_gpu_time_of_a_step_not_each_requests_wait(tiny_llama):
    # Load-or-recompute weighs a slow tier's read against what recomputing a token costs the GPU.
    # Eight prompts computed in one step: the estimate times the tokens computed can never exceed
    # the wall time they took. Timing each request from admission to its first token (as the engine
    # did before) charged every request the whole step, eight times the truth here, and under load
    # made a disk that reads slower than the GPU recomputes look worth reading.
    llm = LLM(tiny_llama, device="cuda", enable_prefix_caching=False, max_num_batched_tokens=4096, max_num_seqs=8)
    prompts = random_prompts(512, [500] * 8, seed=3)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts, one, use_tqdm=False)  # compile and warm up
    scheduler = llm.engine.scheduler
    scheduler.recompute_seconds_per_token = None
    t = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    wall = time.perf_counter() - t
    assert scheduler.recompute_seconds_per_token is not None  # the step measured it
    assert 0 < scheduler.recompute_seconds_per_token * 8 * 500 <= wall


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_the_gpu_seconds_of_the_steps_are_counted(tiny_llama):
    """Every step is timed on the GPU (CUDA events): decode and mixed steps each took some, and
    their sum, the steps running one after another on one stream, is no more than the wall time."""
    llm = LLM(tiny_llama, device="cuda", l1="64MiB", l2=0, max_num_seqs=4)
    prompts = random_prompts(512, [40, 60, 80, 100], seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compile and capture
    before = llm.engine.engine_stats()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    after = llm.engine.engine_stats()
    steps = sum(after["steps"].values()) - sum(before["steps"].values())
    assert steps >= 8
    gpu = {k: after["gpu_seconds"][k] - before["gpu_seconds"][k] for k in ("decode", "mixed")}
    assert all(v > 0 for v in gpu.values()) and sum(gpu.values()) <= wall, (gpu, wall)
    assert after["load_wait_steps"] == 0 and after["load_wait_gpu_seconds"] == 0  # no L2: nothing ever loads
    # generate takes every step's tokens back, blocking until the GPU has them: the engine
    # thread's `wait`, apart from its work, and all of it within the wall time
    host = {k: after["host_seconds"][k] - before["host_seconds"][k] for k in after["host_seconds"]}
    assert host["wait"] > 0 and all(v >= 0 for v in host.values()) and sum(host.values()) <= wall, (host, wall)
    llm.close()


def test_a_steps_wait_for_the_gpu_is_a_phase_of_its_own():
    """The seconds the engine thread blocked on a launched step are `wait`, not postprocess: time
    the host had to spare, where postprocess is host work (tokens back and handed over)."""
    stats = EngineStats(1024)
    stats.stepped(ScheduledStep([object()], [1]), 1.0, 0.1, 0.2, 0.6, 0.5)
    stats.stepped(None, 0.3, 0.05, 0.0, 0.25, 0.2)  # launched nothing: idle but for taking one back
    assert stats.host_s == pytest.approx({"schedule": 0.15, "launch": 0.2, "wait": 0.7, "postprocess": 0.25})
    assert stats.idle_steps == 1 and stats.idle_s == pytest.approx(0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_serving_cold_prompts_l1_and_l2_hits_compiles_no_kernel_after_start(tiny_llama):
    # The engine compiles every kernel variant its steps may pick before it serves: one met later
    # (Triton specialises on an int being 1 or a multiple of 16, a dtype, a constexpr) compiles
    # mid-step and stalls every request in it for 0.1-1 s. Cold prompts of odd and round lengths,
    # batched, then L1 hits, then L2 hits of several lengths loaded beside decodes, greedy and
    # sampled: the engine's CompileWatch must count no compile.
    probe = LLM(tiny_llama, device="cuda", l1=1 << 20)
    llm = LLM(tiny_llama, device="cuda", l1=256 * block_bytes(probe), l2=1024 * block_bytes(probe),
              max_num_batched_tokens=512, max_num_seqs=8)
    prompts = random_prompts(512, (1, 15, 16, 17, 100, 200, 300, 450), seed=11)  # max 512 positions
    greedy = SamplingParams(temperature=0, max_tokens=20)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=20, seed=1)
    llm.generate(prompts, greedy, use_tqdm=False)
    llm.generate([p + [5, 6, 7] for p in prompts], sampled, use_tqdm=False)  # L1 hits
    llm.cache.evict("l1")
    llm.engine.scheduler.recompute_seconds_per_token = None  # load what L2 holds (a tiny model would recompute)
    llm.generate([p + [5, 6, 7, 8] for p in prompts[4:]], greedy, use_tqdm=False)  # L2 hits, batched
    llm.cache.evict("l1")
    engine = llm.engine
    runner = engine.add_request(prompts[6] + [9], SamplingParams(temperature=0, max_tokens=40))
    while runner.num_computed < len(prompts[6]) + 1:
        engine.step()  # a decode is running now
    for p in prompts[4:6] + prompts[7:]:  # L2 hits admitted beside it
        engine.add_request(p + [5, 6, 7, 8, 9], greedy)
    while engine.has_unfinished():
        engine.step()
    compiles = engine.engine_stats()["kernel_compiles"]
    assert engine.compiles.armed
    assert compiles["compiles"] == 0, f"kernels compiled after start-up: {compiles['recent']}"
