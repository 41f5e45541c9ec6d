"""tierkv.integrations.transformers: greedy `generate` through TieredCache equals transformers' default cache.

Checked on a tiny random Llama and the bundled SmolLM2 (fp32, CPU): a second call whose prompt
shares a prefix feeds the model only the uncached tokens (counted by a hook on the embedding),
the TieredKVCache's stats report the hit, and hits served from L2 (after eviction) and from a
disk L3 read by a fresh cache (a restart) give the same tokens. Misuse gets tierkv errors.
"""

from __future__ import annotations

import pytest
import torch
from models import bundled_cache_dir, save_tiny_checkpoint

import tierkv
from tierkv.errors import ConfigError, ShapeError, TierKVError

transformers = pytest.importorskip("transformers")
integration = pytest.importorskip("tierkv.integrations.transformers")

NEW = 12
GREEDY = {"do_sample": False, "max_new_tokens": NEW}


def layout_of(hf, block_size: int) -> tierkv.KVLayout:
    c = hf.config
    return tierkv.KVLayout(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                           head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                           dtype=torch.float32, block_size=block_size)


def reference(hf, ids: torch.Tensor, **kw) -> torch.Tensor:
    """transformers' own default cache (DynamicCache)."""
    return hf.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY, **kw)


class FedTokens:
    """Counts the tokens the model's forward passes embed, i.e. the tokens it computes."""

    def __init__(self, hf) -> None:
        self.count = 0
        hf.get_input_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, args, out) -> None:
        self.count += args[0].numel()

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, FedTokens(hf)


def prompts(vocab: int, prefix: int, tails: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (prefix,), generator=g)
    return [torch.cat([shared, torch.randint(0, vocab, (n,), generator=g)])[None] for n in tails]


NO_EOS = {"eos_token_id": None, "pad_token_id": 0}


@torch.inference_mode()
def test_shared_prefix_is_computed_once_and_tokens_match(tiny):
    hf, fed = tiny
    kv = tierkv.TieredKVCache(layout_of(hf, 4), tierkv.CacheConfig(l1=64 * 2048), device="cpu", model="tiny")
    first, second, longer = prompts(512, 41, (5, 9, 30))
    for ids, expect_cached in ((first, 0), (second, 40), (longer, 40)):
        ref = reference(hf, ids, **NO_EOS)
        fed.take()
        out = integration.generate(hf, ids, kv, **GREEDY, **NO_EOS)
        assert torch.equal(out.sequences, ref)
        assert out.cached_tokens == expect_cached and out.by_tier["l1"] == expect_cached
        # the prompt's uncached part once, then one token per decode step
        assert fed.take() == out.computed_tokens == ids.shape[1] - expect_cached + NEW - 1
    # the same 46-token prompt again: its full blocks are cached up to the 45-token cap (the
    # last token must be computed for its logits), so 44 come from the cache and 2 are computed
    fed.take()
    again = integration.generate(hf, first, kv, **GREEDY, **NO_EOS)
    assert again.cached_tokens == 44 and fed.take() == 2 + NEW - 1
    assert torch.equal(again.sequences, reference(hf, first, **NO_EOS))
    stats = kv.stats()
    assert stats["hit_tokens"] == 40 + 40 + 44
    assert stats["tiers"]["l1"]["hit_tokens"] == 124


@torch.inference_mode()
def test_cache_object_with_plain_generate(tiny):
    """The documented transformers way: a pre-filled cache plus the whole prompt and its mask."""
    hf, fed = tiny
    kv = tierkv.TieredKVCache(layout_of(hf, 8), tierkv.CacheConfig(l1=64 * 4096), device="cpu", model="tiny")
    first, second = prompts(512, 33, (4, 6), seed=1)
    integration.generate(hf, first, kv, **GREEDY, **NO_EOS)
    cache = integration.TieredCache(kv, hf.config)
    assert cache.begin(second) == 32 and cache.get_seq_length() == 32
    fed.take()
    # past_key_values= on transformers <= 5.2x, cache= after; cache_kwarg names the one this version takes
    out = hf.generate(second, attention_mask=torch.ones_like(second), **{integration.cache_kwarg(hf): cache},
                      **GREEDY, **NO_EOS)
    assert fed.take() == second.shape[1] - 32 + NEW - 1
    assert cache.end(out) == (second.shape[1] + NEW - 1) // 8 * 8
    assert torch.equal(out, reference(hf, second, **NO_EOS))
    assert kv.l1.num_blocks - len(kv.l1.free) == kv.stats()["blocks"]  # nothing private left pinned


@torch.inference_mode()
def test_prefix_from_l2_after_eviction_and_from_disk_l3_after_restart(tiny, tmp_path):
    hf, fed = tiny
    layout = layout_of(hf, 4)
    url = f"file://{tmp_path}/l3?size=64MiB"
    # L1 fits one sequence (16 blocks), so other traffic pushes the prefix down to L2
    config = tierkv.CacheConfig(l1=16 * layout.bytes_per_block, l2=256 * layout.bytes_per_block, l3=[url])
    kv = tierkv.TieredKVCache(layout, config, device="cpu", model="tiny")
    first, second = prompts(512, 40, (3, 6), seed=2)
    integration.generate(hf, first, kv, **GREEDY, **NO_EOS)
    for other in prompts(512, 40, (1, 2), seed=3):
        integration.generate(hf, other, kv, **GREEDY, **NO_EOS)
    fed.take()
    out = integration.generate(hf, second, kv, **GREEDY, **NO_EOS)
    assert out.by_tier["l2"] > 0 and out.cached_tokens == 40
    assert fed.take() == second.shape[1] - 40 + NEW - 1
    assert torch.equal(out.sequences, reference(hf, second, **NO_EOS))
    assert kv.flush(timeout=30)
    kv.close()
    # a new process: empty L1/L2, the same disk L3
    fresh = tierkv.TieredKVCache(layout, tierkv.CacheConfig(l1=32 * layout.bytes_per_block,
                                                            l2=64 * layout.bytes_per_block, l3=[url]),
                                 device="cpu", model="tiny")
    third = torch.cat([second[:, :40], torch.tensor([[7, 8, 9, 10, 11]])], dim=1)
    fed.take()
    out = integration.generate(hf, third, fresh, **GREEDY, **NO_EOS)
    assert out.by_tier["l3"] == 40 and out.cached_tokens == 40 and fed.take() == 5 + NEW - 1
    assert torch.equal(out.sequences, reference(hf, third, **NO_EOS))
    assert fresh.stats()["tiers"]["l3"]["hit_tokens"] >= 40
    fresh.close()


@torch.inference_mode()
def test_salts_do_not_share(tiny):
    hf, _ = tiny
    kv = tierkv.TieredKVCache(layout_of(hf, 4), tierkv.CacheConfig(l1=64 * 2048), device="cpu", model="tiny")
    first, second = prompts(512, 24, (2, 3), seed=4)
    integration.generate(hf, first, kv, salt="alice", **GREEDY, **NO_EOS)
    assert integration.generate(hf, second, kv, salt="bob", **GREEDY, **NO_EOS).cached_tokens == 0
    assert integration.generate(hf, second, kv, salt="alice", **GREEDY, **NO_EOS).cached_tokens == 24


@torch.inference_mode()
def test_misuse_gets_tierkv_errors(tiny):
    hf, _ = tiny
    layout = layout_of(hf, 4)
    kv = tierkv.TieredKVCache(layout, tierkv.CacheConfig(l1=64 * 2048), device="cpu", model="tiny")
    ids = prompts(512, 10, (2,))[0]
    with pytest.raises(ShapeError, match="one prompt"):
        integration.generate(hf, torch.cat([ids, ids]), kv, **GREEDY)
    with pytest.raises(ConfigError, match="attention_mask"):
        integration.generate(hf, ids, kv, attention_mask=torch.ones_like(ids), **GREEDY)
    wrong = tierkv.KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=4)
    with pytest.raises(ConfigError, match="num_layers=3 \\(model: 2\\)"):
        integration.TieredCache(tierkv.TieredKVCache(wrong, tierkv.CacheConfig(l1=1 << 20), device="cpu"), hf.config)
    vllm_buffers = [torch.zeros(2, 8, 4, 2, 16) for _ in range(2)]  # an engine's own, in vLLM's layout
    registered = tierkv.TieredKVCache(layout, tierkv.CacheConfig(), kv_caches=vllm_buffers, kv_layout="vllm")
    with pytest.raises(ConfigError, match="'vllm' layout"):
        integration.TieredCache(registered, hf.config)
    half = tierkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_size=4)
    with pytest.raises(ShapeError, match="float16"):
        half_kv = tierkv.TieredKVCache(half, tierkv.CacheConfig(l1=1 << 20), device="cpu")
        integration.generate(hf, ids, half_kv, **GREEDY)
    cache = integration.TieredCache(kv, hf.config)
    with pytest.raises(TierKVError, match="begin"):
        hf.generate(ids, attention_mask=torch.ones_like(ids), **{integration.cache_kwarg(hf): cache}, **GREEDY)
    with pytest.raises(ConfigError, match="num_beams=2"):
        integration.generate(hf, ids, kv, num_beams=2, **GREEDY)
    with pytest.raises(ShapeError, match="num_beams > 1"):
        c = integration.TieredCache(kv)
        c.begin(ids)
        with c:
            hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, **{integration.cache_kwarg(hf): c},
                        **GREEDY)
    with pytest.raises(TierKVError, match="use a new TieredCache"):
        c = integration.TieredCache(kv)
        c.begin(ids)
        c.begin(ids)
    c.end()
    assert kv.l1.num_blocks - len(kv.l1.free) == kv.stats()["blocks"]  # the failed calls leaked no block


@pytest.fixture(scope="module")
def smollm():
    from tierkv.engine.loader import bundled_model_dir

    path = bundled_model_dir(bundled_cache_dir())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return hf, tok, FedTokens(hf)


@torch.inference_mode()
def test_bundled_smollm2_chat_with_a_shared_system_prompt(smollm):
    hf, tok, fed = smollm
    kv = tierkv.TieredKVCache(layout_of(hf, 16), tierkv.CacheConfig(l1="64MiB"), device="cpu", model="smollm2")
    system = ("You are a careful assistant for a hardware store. Answer in one short sentence, name the "
              "aisle when you can, and never invent products the store does not sell. ") * 2
    questions = ["Where do I find nails?", "Do you sell paint brushes?"]
    cached = []
    for q in questions:
        text = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids
        ref = reference(hf, ids)
        fed.take()
        out = integration.generate(hf, ids, kv, **GREEDY)
        assert torch.equal(out.sequences, ref), tok.decode(out.sequences[0, ids.shape[1]:])
        assert fed.take() == out.computed_tokens
        cached.append(out.cached_tokens)
    assert cached[0] == 0 and cached[1] >= 48  # the system prompt's full blocks
    assert kv.stats()["hit_tokens"] == cached[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
@pytest.mark.parametrize("pool_device", ["cuda", "cpu"])
@torch.inference_mode()
def test_gpu_model_with_pool_on_gpu_or_offloaded_to_host(pool_device, tmp_path):
    """On a GPU: the pool on the GPU, or in host memory with each layer copied up one layer ahead
    on a side stream (offload); fp32 so the tokens must equal transformers' own cache exactly."""
    path = save_tiny_checkpoint("llama", tmp_path / "tiny")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    kv = tierkv.TieredKVCache(layout_of(hf, 16), tierkv.CacheConfig(l1=64 * 8192), device=pool_device, model="tiny")
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 512, (130,), generator=g)
    for tail, expect_cached in ((7, 0), (11, 128)):
        ids = torch.cat([shared, torch.randint(0, 512, (tail,), generator=g)])[None].cuda()
        out = integration.generate(hf, ids, kv, do_sample=False, max_new_tokens=40, **NO_EOS)
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40, **NO_EOS)
        assert out.cached_tokens == expect_cached
        assert torch.equal(out.sequences, ref)
