"""A hit moves only what attention will read: sliding-window layers need the last window's blocks.

A model with one full-attention layer in six and sliding windows in the others (Gemma 3's
proportion; a tiny Qwen3 with `max_window_layers=1` here) serves a long prefix from L2. The old
blocks come back with their full-attention layer only, the last window's blocks whole: at most
1/6 + 5/6 * W / prefix of the bytes a full load moves (plus the block the window starts in), and
the tokens equal a run without caching. Mistral (every layer slides) loads only the window.
"""

from __future__ import annotations

import pytest
import torch
from models import save_tiny_checkpoint

from tierkv import LLM, SamplingParams
from tierkv.layout import KVLayout, LayerGroup

transformers = pytest.importorskip("transformers")

BLOCK = 4
WINDOW = 16
PROMPT = 240  # 60 blocks, the window 4 of them
PARAMS = SamplingParams(temperature=0, max_tokens=12)


def test_layout_groups_layers_by_window():
    layout = KVLayout(6, 2, 8, block_size=4, windows=(16, 16, None, 16, 16, 16))
    assert layout.groups == (LayerGroup((2,), None), LayerGroup((0, 1, 3, 4, 5), 16))
    assert layout.full_layers == (2,)
    # a query at 100 reads keys > 84: block 21 (84..87) holds key 85
    assert layout.window_start(100) == 21
    assert KVLayout(6, 2, 8).window_start(100) == 0  # no window: every block is read
    # windows change what a hit loads, not a block's bytes or name
    assert layout.fingerprint == KVLayout(6, 2, 8, block_size=4).fingerprint
    assert KVLayout(6, 2, 8, windows=(None,) * 6) == KVLayout(6, 2, 8)
    with pytest.raises(Exception, match="windows must give each of the 6 layers"):
        KVLayout(6, 2, 8, windows=(16, None))
    with pytest.raises(Exception, match="num_kv_heads must be 1"):
        KVLayout(6, 2, 8, latent=True)
    assert KVLayout(6, 1, 288, latent=True).fingerprint.endswith("-mla")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """1 full-attention layer and 5 sliding ones, as Gemma 3 has (layer 0 full)."""
    return str(save_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("hybrid"), seed=4, num_hidden_layers=6,
                                    use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                    layer_types=["full_attention"] + ["sliding_attention"] * 5))


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    return str(save_tiny_checkpoint("mistral", tmp_path_factory.mktemp("sliding"), seed=5, sliding_window=WINDOW))


def l2_hit(path: str, prompt: list[int], continuation: list[int], device: str) -> tuple[list[int], int, LLM]:
    """Tokens of prompt + continuation served after the prompt's blocks went to L2, and the bytes
    L2 gave up for it."""
    llm = LLM(path, device=device, dtype="float32", block_size=BLOCK, l2=1 << 24, write_policy="write_back")
    other = [(t + 1) % 512 for t in prompt]
    for p in (prompt, other):  # the other prompt's KV lands in the L1 slots the prompt had: a block
        # loaded without a layer it needs would read that, not its own KV left over
        llm.generate([p], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        llm.cache.evict("l1")  # write-back: every block goes down to L2
    # a tiny model recomputes 240 tokens on a GPU faster than anything loads: say recomputing is dear,
    # so that load-or-recompute loads (the engine sets this from measured prefills; on CPU it always loads)
    llm.engine.scheduler.recompute_seconds_per_token = 1.0
    before = llm.cache.stats()["tiers"]["l2"]["bytes_out"]
    out = llm.generate([prompt + continuation], PARAMS, use_tqdm=False)[0]
    assert out.cached_tokens >= PROMPT - BLOCK
    return out.token_ids, llm.cache.stats()["tiers"]["l2"]["bytes_out"] - before, llm


# on the GPU the loads are the copy kernels' (and staged DMA's) rather than the reference's
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["hybrid", "sliding"])
def test_window_hit_moves_only_what_attention_reads(kind, device, request):
    path = request.getfixturevalue(kind)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 512, (PROMPT,), generator=g).tolist()
    continuation = torch.randint(0, 512, (9,), generator=g).tolist()
    ref = LLM(path, device=device, dtype="float32", block_size=BLOCK, enable_prefix_caching=False)
    expected = ref.generate([prompt + continuation], PARAMS, use_tqdm=False)[0].token_ids

    tokens, moved, llm = l2_hit(path, prompt, continuation, device)
    assert tokens == expected

    layout = llm.cache.layout
    full_share = len(layout.full_layers) / layout.num_layers
    hit = PROMPT // BLOCK * layout.bytes_per_block  # what loading every hit block whole moves
    # the bound of the issue, plus the block the window's first key sits in
    bound = (full_share + (1 - full_share) * (WINDOW + BLOCK) / PROMPT) * hit
    assert 0 < moved <= bound, (moved, bound, hit)
    assert full_share == (1 / 6 if kind == "hybrid" else 0)
