"""The 2026 families through the whole engine and tierkv-serve, against transformers (CPU, fp32).

Qwen3-MoE, gpt-oss (sinks, alternating sliding and full layers), Gemma 3 (five local layers to
one global) and DeepSeek-V3 (MLA: one latent per token in the pool) each, on a tiny random-weight
checkpoint of the real architecture: greedy tokens equal transformers' `generate` with chunked
prefill, async scheduling and prefix caching on; again after the prompt's blocks went to L2 and
after a restart that finds them in the disk tier only; with an L1 a third of the sequence, which
streams the older blocks from L2; and through tierkv-serve driven by the openai client, hitting
L2 and, after a restart, the disk tier. The per-model comparisons (logits, chunk edges, TP) are
in test_model_<family>.py; this file is about the cache and the engine around them.
"""

from __future__ import annotations

import pytest
import torch
from models import save_tiny_checkpoint, save_word_tokenizer
from server_helpers import metric, serving, settled

from tierkv import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

FAMILIES = ["qwen3_moe", "gpt_oss", "gemma3", "deepseek_v3"]
BLOCK = 4
NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)  # transformers' run ignores it too


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = save_word_tokenizer(save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=11),
                               512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (70, 33)]  # past every window (8)
    with torch.inference_mode():
        want = [hf_greedy(hf, p, NEW) for p in prompts]
    return request.param, str(path), prompts, want


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def block_bytes(path: str) -> int:
    probe = LLM(path, device="cpu", block_size=BLOCK, l1=1 << 20)
    probe.close()
    return probe.cache.layout.bytes_per_block


def test_engine_serves_the_family_from_every_tier(family, tmp_path):
    kind, path, prompts, want = family
    url = f"file://{tmp_path}?size=64MiB"
    # 16-token steps: the 70-token prompt is prefilled in chunks beside the other's decode
    opts = dict(device="cpu", block_size=BLOCK, max_num_batched_tokens=16, l2=1 << 24, l3=[url])
    llm = LLM(path, **opts)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want, kind

    llm.cache.evict("l1")  # the blocks are in L2 (written through) and on disk
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(again) == want
    assert again[0].cached_tokens >= 64 and llm.cache.stats()["tiers"]["l2"]["hit_tokens"] >= 64
    assert llm.cache.flush(timeout=30)
    llm.close()

    restarted = LLM(path, **opts)  # only the disk has the prefix now
    outs = restarted.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == want
    assert restarted.cache.stats()["tiers"]["l3"]["hit_tokens"] >= 64
    restarted.close()


def test_a_context_three_times_l1_streams_and_gives_the_same_tokens(family):
    kind, path, prompts, want = family
    bb = block_bytes(path)
    # 8 blocks = 32 tokens of L1 for an 80-token sequence: its older blocks live in L2 and stream
    llm = LLM(path, device="cpu", block_size=BLOCK, l1=8 * bb, l2=64 * bb, max_num_batched_tokens=32)
    out = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == want[0], kind
    assert llm.cache.streamer.bytes_read > 0
    llm.close()


def test_tierkv_serve_answers_from_l2_and_after_a_restart_from_disk(family, tmp_path):
    openai = pytest.importorskip("openai")  # (the GPU box runs this file's GPU case without it)
    kind, path, prompts, want = family
    bb = block_bytes(path)
    # L1 of 21 blocks: a second 70-token request pushes the first one's blocks down to L2
    args = ["--model", path, "--served-model-name", kind, "--device", "cpu", "--block-size", str(BLOCK),
            "--l1", str(21 * bb), "--l2", str(64 * bb), "--l3", f"file://{tmp_path}?size=64MiB",
            "--max-model-len", "256"]
    other = [(t + 1) % 512 for t in prompts[0]]

    def served(srv, prompt: list[int]) -> tuple[list[int], int]:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.completions.create(model=kind, prompt=prompt, max_tokens=NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
        ids = [int(word.removeprefix("w")) for word in r.choices[0].text.split()]  # the word tokenizer's
        return ids, r.usage.prompt_tokens_details.cached_tokens

    def hits(srv, tier: str) -> float:
        return metric(settled(srv), "tierkv_prefix_cache_hit_tokens_total", f'tier="{tier}"')

    with serving(args, tmp_path / "first.log") as srv:
        assert served(srv, prompts[0]) == (want[0], 0)
        served(srv, other)
        got, cached = served(srv, prompts[0])
        assert got == want[0] and cached >= 64
        assert hits(srv, "l2") >= 48
    with serving(args, tmp_path / "second.log") as srv:  # a restart: the disk tier has the prefix
        got, cached = served(srv, prompts[0])
        assert got == want[0] and cached >= 64
        assert hits(srv, "l3") >= 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_on_the_gpu_an_l2_hit_gives_the_tokens_of_a_cold_run(family):
    """bf16 with CUDA graphs (the prompts' step a mixed step's), async scheduling and the Triton
    kernels (fused MoE, sinks, MLA decode):
    the prompt served again from L2 (its window layers' old blocks not loaded) decodes the same
    tokens as the cold run that computed it (agreement with transformers in bf16 is each family's
    test_model_<family>.py's)."""
    kind, path, prompts, _ = family
    llm = LLM(path, device="cuda", dtype="bfloat16", block_size=BLOCK, l2=1 << 26, write_policy="write_back")
    cold = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    graphs = llm.engine.runner.graphs
    assert graphs.mixed_disabled_reason is None and graphs.mixed_replays > 0, kind  # the prompts' step
    llm.cache.evict("l1")
    llm.engine.scheduler.recompute_seconds_per_token = 1.0  # a tiny model recomputes faster than it loads
    hit = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(hit) == cold, kind
    assert hit[0].cached_tokens >= 64 and llm.cache.stats()["tiers"]["l2"]["hit_tokens"] >= 64
    llm.close()
