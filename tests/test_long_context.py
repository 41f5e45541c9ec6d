"""Sequences larger than L1: offloaded blocks in L2, attention streamed layer by layer.

Cache level: after `offload`, the staging buffer that `stream` fills holds exactly the KV the
sequence had in L1, on every layer, and `free` gives back every L1 and L2 slot. Engine level:
a context four times the L1 budget (prefill and decode both streamed) gives the same greedy
tokens as a run with everything in L1, with prefix caching on and off, next to an ordinary
request. GPU: streamed decode attention over a 128K-token sequence equals the reference.
"""

from __future__ import annotations

import pytest
import torch
from models import save_tiny_checkpoint
from prefix_kv import prefix_kv, write_into_slots

from tierkv import LLM, CacheConfig, KVLayout, SamplingParams, TieredKVCache
from tierkv.errors import ConfigError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)


def small_cache(l1_blocks: int, l2_blocks: int, device: str = "cpu", layout: KVLayout = LAYOUT) -> TieredKVCache:
    bb = layout.bytes_per_block
    return TieredKVCache(layout, CacheConfig(l1=l1_blocks * bb, l2=l2_blocks * bb), device=device)


@pytest.mark.parametrize("shared", [True, False])
def test_offloaded_blocks_stream_back_exactly(shared):
    cache = small_cache(l1_blocks=12, l2_blocks=16)
    tokens = list(range(100, 140))  # 10 blocks
    seq = cache.allocate(tokens)
    write_into_slots(cache, seq, tokens, 0)
    if shared:
        cache.commit(seq, tokens)  # indexed blocks take the shared path, the rest stay private
    assert cache.offload(seq, 6) == 6
    assert seq.offloaded == 6 and seq.slots[:6] == [-1] * 6 and seq.resident == 4
    want = prefix_kv(LAYOUT, tokens)  # [L, 2, 40, H, D]
    step = cache.stream([seq])
    table = step.plan.block_tables[0]
    for layer in range(LAYOUT.num_layers):
        staged = step.layer_kv(layer, cache.l1.kv[layer])  # [rows, 2, bs, H, D]
        got = staged[table.long()].transpose(0, 1).reshape(2, 40, 2, 8)
        assert torch.equal(got, want[layer])
        step.release(layer)
    # everything goes back: L1 free, L2 holds released (shared blocks stay cached, unpinned)
    cache.free(seq)
    assert len(cache.l1.free) + cache.index.evictable("l1") == 12
    assert len(cache.l2.free) + cache.index.evictable("l2") == 16


def test_offload_stops_where_l2_is_full_and_keeps_a_prefix():
    cache = small_cache(l1_blocks=12, l2_blocks=3)
    tokens = list(range(40))
    seq = cache.allocate(tokens)
    write_into_slots(cache, seq, tokens, 0)
    assert cache.offload(seq, 8) == 3  # private blocks, three L2 slots
    assert seq.offloaded == 3 and all(s >= 0 for s in seq.slots[3:])
    assert cache.offload(seq, 1) == 0
    cache.free(seq)
    assert len(cache.l2.free) == 3 and len(cache.l1.free) == 12


def test_a_cached_prefix_in_l2_is_streamed_not_loaded():
    cache = small_cache(l1_blocks=6, l2_blocks=32)
    tokens = list(range(7, 87))  # 20 blocks: more than all of L1
    # A first sequence computes 16 blocks 4 at a time, offloading as it goes, as the engine does.
    first = cache.allocate(tokens[:64], match=cache.match(tokens[:64], limit=0), stream=True, reserve=16)
    for start in range(0, 64, 16):
        if start:
            cache.offload(first, first.resident)
            cache.append(first, 16)
        write_into_slots(cache, first, tokens[: start + 16], start)
        cache.commit(first, tokens[: start + 16])
    cache.free(first)
    m = cache.match(tokens)
    assert m.tokens == 64 and m.by_tier["l2"] >= 40
    used_l1 = len(cache.l1.free)
    seq = cache.allocate(tokens, match=m, stream=True, reserve=64 + 8)
    # the cached blocks stay in L2 (none is loaded into L1): only the 2 fresh blocks take L1 room
    assert seq.offloaded == 16 and seq.num_cached_tokens == 64 and len(seq.slots) == 18
    assert seq.resident == 2 and len(cache.l1.free) >= used_l1 - 2
    step = cache.stream([seq])
    staged = step.layer_kv(1, cache.l1.kv[1])
    rows = step.plan.block_tables[0, :16].long()
    assert torch.equal(staged[rows].transpose(0, 1).reshape(2, 64, 2, 8), prefix_kv(LAYOUT, tokens[:64])[1])
    cache.free(seq)


# ---------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-long"), seed=3))


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("caching", [True, False])
def test_context_four_times_l1_gives_the_same_tokens(tiny_llama, caching):
    long, short = prompts(0, 440, 20)
    params = SamplingParams(temperature=0, max_tokens=40)
    ref_out = [o.token_ids for o in LLM(tiny_llama, device="cpu").generate([long, short], params, use_tqdm=False)]
    probe = LLM(tiny_llama, device="cpu", l1=1 << 20)
    bb = probe.cache.layout.bytes_per_block
    # L1: 8 blocks = 128 tokens; the long request needs 30 blocks (480 tokens), ~4x L1
    llm = LLM(tiny_llama, device="cpu", l1=8 * bb, l2=64 * bb, enable_prefix_caching=caching,
              max_num_batched_tokens=256)
    outs = llm.generate([long, short], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref_out
    assert all(o.finish_reason == "length" for o in outs)
    streamed = llm.cache.streamer.bytes_read
    assert streamed > 0
    if caching:  # the second time, the prefix comes from L2 and is streamed, not recomputed
        again = llm.generate([long], params, use_tqdm=False)[0]
        assert again.token_ids == ref_out[0] and again.cached_tokens >= 400
    assert not llm.engine.has_unfinished()
    assert len(llm.cache.l1.free) + llm.cache.index.evictable("l1") == 8


def test_decode_that_outgrows_l1_streams_instead_of_stopping(tiny_llama):
    (prompt,) = prompts(1, 30)
    params = SamplingParams(temperature=0, max_tokens=100)
    want = LLM(tiny_llama, device="cpu").generate(prompt, params, use_tqdm=False)[0].token_ids
    bb = LLM(tiny_llama, device="cpu", l1=1 << 20).cache.layout.bytes_per_block
    llm = LLM(tiny_llama, device="cpu", l1=3 * bb, l2=16 * bb)  # 48 tokens of L1 for 130
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.token_ids == want and len(want) == 100
    assert llm.cache.streamer.bytes_read > 0


def restarted_on_disk(tiny_llama, tmp_path, seed: int):
    """A 300-token prompt (18 full blocks, then the token whose logits are computed), its greedy
    tokens computed with no cache, and an engine restarted on a disk L3 that alone holds its prefix."""
    (prompt,) = prompts(seed, 300)
    params = SamplingParams(temperature=0, max_tokens=8)
    want = LLM(tiny_llama, device="cpu").generate(prompt, params, use_tqdm=False)[0].token_ids
    bb = LLM(tiny_llama, device="cpu", l1=1 << 20).cache.layout.bytes_per_block
    url = f"file://{tmp_path}?size=64MiB"
    first = LLM(tiny_llama, device="cpu", l2=64 * bb, l3=[url])
    first.generate(prompt, params, use_tqdm=False)
    assert first.cache.flush(timeout=30)
    first.close()
    return prompt, params, want, LLM(tiny_llama, device="cpu", l2=64 * bb, l3=[url])


def test_an_l3_tail_is_read_while_the_head_is_recomputed(tiny_llama, tmp_path):
    prompt, params, want, llm = restarted_on_disk(tiny_llama, tmp_path, 3)
    cache, engine = llm.cache, llm.engine
    assert cache.prefetch(cache.match(prompt), 30, blocks=(0, 1)).wait(30)  # one read: the disk's speed
    # recomputing a block costs half of reading one: read the end while the start is computed
    engine.scheduler.recompute_seconds_per_token = cache.tiers.load_seconds("l3", 17) / 17 / 2 / 16
    req = engine.add_request(prompt, params)
    engine.step()  # admitted: the tail is on its way, the start is being computed
    start = req.adopt_at
    assert req.tail is not None and 16 < start < 288
    assert req.num_computed == start  # it stopped where the tail starts
    assert req.tail.wait(30)
    while engine.has_unfinished():
        engine.step()
    assert req.output_ids == want  # the same tokens as computing everything
    # served from the cache: block 0 (read above) and the whole tail [start, 288); computed: the rest
    assert req.cached_tokens == 16 + (288 - start)
    assert cache.stats()["tiers"]["l3"]["blocks_out"] == 1 + (288 - start) // 16


def test_a_late_l3_tail_is_abandoned_and_recomputed_never_waited_for_longer(tiny_llama, tmp_path):
    import threading

    prompt, params, want, llm = restarted_on_disk(tiny_llama, tmp_path, 4)
    cache, engine = llm.cache, llm.engine
    l3 = cache.tiers.l3
    l3.stores[0]._stats.sample_bandwidth(cache.layout.bytes_per_block, 0.01, write=False)  # measured: 10 ms a block
    engine.scheduler.recompute_seconds_per_token = 0.005 / 16  # recomputing one: 5 ms
    gate = threading.Event()
    l3._reader.submit(gate.wait)  # the disk stalls after the estimate: the tail's read comes late
    try:
        req = engine.add_request(prompt, params)
        engine.step()  # admitted: the start is computed while the tail is (to be) read
        start = req.adopt_at
        assert req.tail is not None and 0 < start < 288
        tail = req.tail
        while engine.has_unfinished():
            engine.step()
        # it would have waited at the tail for no longer than recomputing the tail takes; but no
        # piece of the read had started when it got there, and the whole tail takes longer to
        # read (10 ms a block) than to recompute (5 ms): it gave up at once, and recomputed it
        assert tail.give_up_at - tail.reached_at == pytest.approx((288 - start) * 0.005 / 16)
        assert tail.abandoned_at == tail.reached_at
        assert not tail.done() and req.output_ids == want and req.cached_tokens == 0
    finally:
        gate.set()
    assert tail.wait(30)  # the abandoned read started nothing once the disk came back
    reads = cache.stats()["l3_reads"]
    assert reads["abandoned"] == 1 and reads["recent"][-1]["abandoned"]
    assert reads["recent"][-1]["blocks"] == (288 - start) // 16 and reads["recent"][-1]["estimate_s"] > 0
    assert cache.stats()["tiers"]["l3"]["blocks_out"] == 0 and cache.stats()["tiers"]["l3"]["errors"] == 0


def test_a_prompt_larger_than_l1_and_l2_is_refused(tiny_llama):
    bb = LLM(tiny_llama, device="cpu", l1=1 << 20).cache.layout.bytes_per_block
    llm = LLM(tiny_llama, device="cpu", l1=4 * bb, l2=4 * bb)
    with pytest.raises(ConfigError, match="raise l1 or l2"):
        llm.generate(prompts(2, 200)[0], use_tqdm=False)
    no_l2 = LLM(tiny_llama, device="cpu", l1=4 * bb)
    with pytest.raises(ConfigError, match="raise l1 or l2"):
        no_l2.generate(prompts(2, 100)[0], use_tqdm=False)


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_streamed_decode_at_128k_tokens_equals_the_reference():
    from tierkv import kernels

    n, bs = 128 * 1024, 16
    layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=bs)
    cache = small_cache(l1_blocks=2048, l2_blocks=n // bs, device="cuda", layout=layout)
    tokens = torch.randint(0, 50000, (n,)).tolist()
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(2, 2, n, 8, 128, generator=g, device="cuda").to(torch.bfloat16)  # [L, 2, n, H, D]
    # Fill the sequence 1024 blocks at a time, offloading what L1 cannot keep, as the engine does.
    seq = cache.allocate(tokens, match=cache.match(tokens, limit=0), stream=True, reserve=1024 * bs)
    for start in range(0, n, 1024 * bs):
        if start:
            cache.offload(seq, seq.resident)
            cache.append(seq, 1024 * bs)
        blocks = torch.tensor(seq.slots[start // bs : start // bs + 1024], device="cuda")
        chunk = kv[:, :, start : start + 1024 * bs].reshape(2, 2, 1024, bs, 8, 128).transpose(1, 2)
        cache.l1.kv[:, blocks] = chunk
    assert seq.offloaded == n // bs - 1024
    q = torch.randn(1, 32, 128, generator=g, device="cuda").to(torch.bfloat16)
    step = cache.stream([seq])
    seq_lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    for layer in range(2):
        staged = step.layer_kv(layer, cache.l1.kv[layer])
        got = kernels.paged_decode(q, staged, step.plan.block_tables, seq_lens, 128**-0.5)
        step.release(layer)
        k, v = kv[layer, 0].float(), kv[layer, 1].float()  # [n, 8, 128]
        qf = q[0].float().view(8, 4, 128)
        att = torch.einsum("hgd,nhd->hgn", qf, k) * 128**-0.5
        want = torch.einsum("hgn,nhd->hgd", att.softmax(-1), v).reshape(1, 32, 128)
        torch.cuda.synchronize()
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < 1e-2, f"layer {layer}: relative error {rel:.2e}"
    cache.free(seq)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_a_long_prompt_in_chunks_takes_the_dense_path_as_accurately_as_the_triton_kernel(tmp_path, monkeypatch):
    # 5000 tokens in 2048-token chunks: chunks at contexts 0 and 2048 are long and aligned (cuDNN,
    # kernels/dense.py); the last 904 tokens take the Triton kernel. The first token's log-probs
    # must be as close to the fp32 model's as with the Triton kernel alone (bf16 either way), and
    # as close as transformers' own bf16 run, within rounding.
    import transformers
    from models import randomize_, tiny_config

    from tierkv.kernels import dense

    config = tiny_config("llama")
    config.max_position_embeddings = 8192
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, 0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    prompt = torch.randint(0, 512, (5000,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20)

    def first_token_logprobs() -> dict[int, float]:
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", l1="256MiB", l2=0, max_num_batched_tokens=2048,
                  enforce_eager=True)
        top = dict(llm.generate([prompt], params, use_tqdm=False)[0].logprobs[0]["top"])
        del llm
        torch.cuda.empty_cache()
        return top

    calls = []
    real = dense.prefill_one
    monkeypatch.setattr(dense, "prefill_one", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    with_dense = first_token_logprobs()
    assert sorted(set(calls)) == [0, 2048], f"dense path contexts {sorted(set(calls))}"
    monkeypatch.setattr(dense, "MIN_NEW_TOKENS", 1 << 30)  # every chunk on the Triton kernel
    calls.clear()
    triton_only = first_token_logprobs()
    assert not calls
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        exact = model.cuda()(ids).logits[0, -1].float().log_softmax(-1).cpu()           # [vocab]
        hf_bf16 = model.to(torch.bfloat16)(ids).logits[0, -1].float().log_softmax(-1).cpu()

    def err(top: dict[int, float]) -> float:
        return max(abs(lp - exact[t].item()) for t, lp in top.items())

    hf_top = dict(zip(*[x.tolist() for x in hf_bf16.topk(20)[::-1]]))
    e_dense, e_triton, e_hf = err(with_dense), err(triton_only), err(hf_top)
    print(f"max |logprob - fp32| over the top 20: dense {e_dense:.4f}, triton {e_triton:.4f}, transformers bf16 {e_hf:.4f}")
    assert e_dense <= 2 * max(e_triton, e_hf) + 0.05
