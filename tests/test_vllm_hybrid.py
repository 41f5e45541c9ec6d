"""TierKVConnector with vLLM's hybrid KV-cache manager (issue 39): a tiny random-weight Gemma 3
text checkpoint (five sliding-window layers to one full-attention layer, window 64 tokens, blocks
of 32) under the real vLLM CPU build. vLLM keeps one KV-cache group per layer kind and position
(here six, one layer each), each with its own block ids; a sliding group's blocks that left the
window are vLLM's null block. tierkv keeps one cache per group: a hit loads the full group's
whole prefix and each sliding group's last window only, and answers as the cold run did.
"""

from __future__ import annotations

import pytest

from models import save_tiny_checkpoint
from test_vllm_connector import drive, vllm_python  # noqa: F401  (the venv fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BLOCK, WINDOW = 32, 64


def test_a_hybrid_model_runs_with_the_hybrid_manager_and_a_hit_loads_each_group_what_it_reads(vllm_python, tmp_path):
    model = str(save_tiny_checkpoint("gemma3", tmp_path / "gemma3", hidden_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, intermediate_size=256, vocab_size=1024,
                                     max_position_embeddings=2048, sliding_window=WINDOW, std=0.1))
    # (weights of std 0.1: at 0.3 this Gemma answers one token whatever the prompt; at 0.1 changing
    # the prompt's first 200 tokens changes its answer, so a wrong load shows)
    prompt = [(i * 37) % 1000 + 3 for i in range(300)]
    gen = {"generate": [prompt], "sampling": {"detokenize": False}}
    steps = [{"kv_groups": True}, gen, {"stats": True}, {"reset": True}, gen, {"stats": True}]
    seen, _ = drive(vllm_python, {"model": model, "extra": {"l2": "64MiB"}, "llm": {"skip_tokenizer_init": True},
                                  "steps": steps}, tmp_path)
    kv, cold, before, warm, after = seen[0], seen[1][0], seen[2], seen[4][0], seen[5]
    # the connector keeps vLLM's hybrid manager on: a group per layer, five sliding and one full
    assert kv["hybrid_manager"] is True
    kinds = [(g["kind"], g["window"]) for g in kv["groups"]]
    assert sorted(kinds) == sorted([("SlidingWindowSpec", WINDOW)] * 5 + [("FullAttentionSpec", None)])

    hit = (len(prompt) - 1) // BLOCK * BLOCK  # whole blocks, never the last token: 288
    assert cold["num_cached_tokens"] == 0 and warm["num_cached_tokens"] == hit
    assert warm["tokens"] == cold["tokens"] and warm["logprobs"] == cold["logprobs"]
    assert after["by_tier"]["l2"] - before["by_tier"]["l2"] == hit

    # what each group's cache loaded from L2 for the hit: the full group all 9 blocks; a sliding
    # group the blocks of the last window only (its first query, at 288, reads keys 225..288)
    window_blocks = hit // BLOCK - (hit - WINDOW + 1) // BLOCK  # 2
    loaded = [a["blocks_out"] - b["blocks_out"] for a, b in zip(after["groups"], before["groups"])]
    expected = [hit // BLOCK if kind == "FullAttentionSpec" else window_blocks for kind, _ in kinds]
    assert loaded == expected
    per_block = [a["bytes_out"] - b["bytes_out"] for a, b in zip(after["groups"], before["groups"])]
    assert per_block[0] // loaded[0] == per_block[-1] // loaded[-1]  # each group's blocks: one layer
