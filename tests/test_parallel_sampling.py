"""Parallel sampling (n > 1) on shared KV: the prompt is computed once and stored once, and each
choice is exactly what n=1 gives with that choice's seed (seed + i).

On the CPU: a tiny random-weight Llama (with and without prefix caching, chunked prefill, no
async scheduling, an L1 so small that choices are preempted, a prompt streamed from L2), the
bundled SmolLM2 (seeded choices, greedy choices against transformers), and tierkv-serve through
the `openai` client (n=3, streaming and not; usage counts the prompt once).
"""

from __future__ import annotations

import pytest
import torch
from models import bundled_cache_dir, save_tiny_checkpoint, truncate_at_eos

from tierkv import LLM, SamplingParams
from tierkv.engine.sampler import choice_seed

transformers = pytest.importorskip("transformers")

N = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-n"), seed=4))


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def sampled(seed: int, max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=50, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw)


def l1_bytes(path: str, blocks: int) -> int:
    """An L1 size of `blocks` blocks of the tiny model."""
    llm = LLM(path, device="cpu", l1=1 << 20)
    size = blocks * llm.cache.layout.bytes_per_block
    llm.close()
    return size


def check_choices_equal_n1(llm: LLM, ids: list[int], params: SamplingParams) -> list[list[int]]:
    """n choices of `ids`, each equal to an n=1 request seeded with that choice's seed."""
    out = llm.generate([ids], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(params.n))
    assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
    singles = llm.generate([ids] * params.n, [
        SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=choice_seed(params.seed, i),
                       max_tokens=params.max_tokens, ignore_eos=params.ignore_eos) for i in range(params.n)
    ], use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    assert all(c.finish_reason == "length" for c in out.outputs)
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("length", [37, 32], ids=["partial-block", "whole-blocks"])
@pytest.mark.parametrize("options", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),  # the prompt in chunks, beside decodes
    dict(async_scheduling=False),
], ids=["plain", "no-prefix-caching", "chunked", "sync"])
def test_each_choice_equals_n1_with_its_seed(tiny, options, length):
    llm = LLM(tiny, device="cpu", **options)
    choices = check_choices_equal_n1(llm, prompt(length), sampled(7, n=N))
    assert len({tuple(c) for c in choices}) == N  # distinct seeds, distinct choices
    # the same seed gives the same choices again
    again = llm.generate([prompt(length)], sampled(7, n=N), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == choices
    llm.close()


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_the_prompt_is_computed_once_and_stored_once(tiny, prefix_caching):
    ids, params = prompt(37, seed=1), sampled(3, n=N)
    llm = LLM(tiny, device="cpu", enable_prefix_caching=prefix_caching)
    engine, cache = llm.engine, llm.cache
    bs = cache.block_size
    full = len(ids) // bs  # 2 full blocks and a partial one at block size 16
    assert full >= 2 and len(ids) % bs
    engine.add_request(ids, params)
    engine.step()  # the prefill, and the fork of the other choices
    assert engine.num_computed_tokens == len(ids)
    running = engine.scheduler.running
    assert [r.index for r in running] == list(range(N)) and all(r.pending == 1 for r in running)
    # the full blocks once; the partial block once per choice (each writes its own tokens there)
    assert cache.l1.num_blocks - len(cache.l1.free) == full + N
    assert all(r.seq.slots[:full] == running[0].seq.slots[:full] for r in running)
    assert len({r.seq.slots[full] for r in running}) == N
    while engine.has_unfinished():
        engine.step()
    # the prompt once, then each choice's outputs but the last (whose KV is never needed)
    assert engine.num_computed_tokens == len(ids) + N * (params.max_tokens - 1)
    assert all(e.ref == 0 for e in cache.index.entries.values())
    assert not cache._shared
    cached = sum(e.l1 >= 0 for e in cache.index.entries.values())
    assert len(cache.l1.free) + cached == cache.l1.num_blocks  # every block came back
    llm.close()


def test_preempted_choices_give_the_same_tokens(tiny):
    ids, params = prompt(37, seed=2), sampled(5, n=N, max_tokens=24)
    reference = LLM(tiny, device="cpu").generate([ids], params, use_tqdm=False)[0]
    # L1 for the prompt and a few blocks: the choices outgrow it and preempt each other to L2
    llm = LLM(tiny, device="cpu", l1=l1_bytes(tiny, 8), l2="4MiB")
    out = llm.generate([ids], params, use_tqdm=False)[0]
    assert llm.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference.outputs]
    llm.close()
    llm = LLM(tiny, device="cpu", l1=l1_bytes(tiny, 8), enable_prefix_caching=False)  # recomputed instead
    out = llm.generate([ids], params, use_tqdm=False)[0]
    assert llm.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference.outputs]
    llm.close()


def test_a_prompt_streamed_from_l2_forks_through_the_cache(tiny):
    # a prompt larger than L1: it streams from L2, and the other choices reach its blocks
    # through prefix caching instead of a fork
    ids = prompt(150, seed=3)
    params = SamplingParams(temperature=1.0, top_k=50, seed=9, max_tokens=6, ignore_eos=True, n=3)
    llm = LLM(tiny, device="cpu", l1=l1_bytes(tiny, 8), l2="8MiB")
    assert llm.cache.must_stream(len(ids))
    check_choices_equal_n1(llm, ids, params)
    llm.close()


@pytest.fixture(scope="module")
def smollm():
    llm = LLM(device="cpu", cache_dir=str(bundled_cache_dir()))
    yield llm
    llm.close()


@torch.inference_mode()
def test_smollm_choices(smollm):
    llm, tok = smollm, smollm.tokenizer
    text = "Once upon a time, in a small village by the sea, there lived"
    check_choices_equal_n1(llm, tok.encode(text), SamplingParams(temperature=0.8, seed=11, max_tokens=10,
                                                                 ignore_eos=True, n=3))
    # greedy: every choice is transformers' greedy continuation
    greedy = llm.generate(text, SamplingParams(temperature=0, max_tokens=8, n=2), use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.lm.model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(text)])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    expected = truncate_at_eos(ref[0, ids.shape[1]:].tolist(), tok.eos_token_ids[0])
    assert [c.token_ids for c in greedy.outputs] == [expected, expected]
    assert greedy.outputs[0].text == greedy.outputs[1].text == tok.decode(expected)
