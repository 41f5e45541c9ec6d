"""A cache per group of layers under tierkv's engine (tierkv/groups.py).

A model of full-attention and sliding-window layers (gpt-oss, Gemma 3; a tiny Qwen3 with
`layer_types` here) keeps each group's KV in a cache of its own. The window group's sequences
let go of the blocks their window has left, so L1 holds the window of those layers rather than
the whole context, and the room goes to the full group: a prompt that one cache of the same L1
bytes could not hold runs, with tokens equal to transformers'. L2 and L3 objects are per group,
named apart even where two groups have the same shape. An L3 tail (read while the start is
recomputed) is read by every group, the window group only its last window, and taken by all
groups at the same block or by none.
"""

from __future__ import annotations

import threading

import pytest
import torch
from models import HYBRID_WINDOW, save_tiny_checkpoint

from tierkv import LLM, SamplingParams
from tierkv.groups import GroupedPrefetch, KVGroups, group_l1_blocks
from tierkv.layout import KVLayout

transformers = pytest.importorskip("transformers")

BLOCK = 4
WINDOW = HYBRID_WINDOW


@pytest.fixture(scope="module")
def alternating(tmp_path_factory):
    """Full and sliding layers in turn, as gpt-oss has: two groups of the same shape."""
    return str(save_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("alternating"), seed=6, num_hidden_layers=4,
                                    use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                                    layer_types=["full_attention", "sliding_attention"] * 2))


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, each from a forward over the whole sequence (no KV cache:
    transformers 5.24's `generate` with its sliding-window cache gives other tokens than its own
    forward for some prompts of 300 tokens on these models; the forward is the reference)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def held(seq, group: int) -> int:
    """L1 blocks a running sequence holds in a group's cache."""
    return sum(slot >= 0 for slot in seq.parts[group].slots)


def test_l1_is_split_so_that_the_window_group_holds_running_windows_and_the_full_group_the_rest():
    layout = KVLayout(6, 2, 8, block_size=4, windows=(None, 16, 16, 16, 16, 16))
    one = 1000 * layout.bytes_per_block  # the bytes of 1000 blocks of every layer
    full, window = group_l1_blocks(layout, one, max_num_seqs=4, max_num_batched_tokens=64)
    # 4 windows of 16 tokens (5 blocks each, with the one a window starts inside) and two steps of 64
    assert window == 4 * 5 + 2 * 16
    per_layer = layout.bytes_per_block // 6
    assert full * per_layer + window * 5 * per_layer <= one < (full + 1) * per_layer + window * 5 * per_layer
    assert full > 5 * 1000  # the full layer gets more than five times what one cache would give it
    # a window group never gets more than one cache would give it, nor less than it works with
    assert group_l1_blocks(layout, one, max_num_seqs=10_000, max_num_batched_tokens=64)[1] == 1000
    assert group_l1_blocks(layout, 10 * layout.bytes_per_block, max_num_seqs=4, max_num_batched_tokens=64) is None
    assert group_l1_blocks(KVLayout(6, 2, 8), one, max_num_seqs=4, max_num_batched_tokens=64) is None  # one group
    assert group_l1_blocks(KVLayout(6, 2, 8, windows=(16,) * 6), one, max_num_seqs=4,
                           max_num_batched_tokens=64) is None


# on the GPU the decode steps replay CUDA graphs whose static buffers are per group
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_hybrid_models_window_layers_hold_only_their_window_while_it_decodes(hybrid, device):
    """A 240-token prompt decoding 40 tokens: the full layer's cache holds all ~70 blocks, the
    window layers' cache the window's blocks and the next one's; tokens equal transformers', and
    those of a second request served from the blocks the window let go of (still cached) and of
    n=2 choices forked after the prompt."""
    prompt = prompt_of(240, 11)
    expected = hf_greedy(hybrid, prompt, 40)
    llm = LLM(hybrid, device=device, dtype="float32", block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=4,
              l1="64MiB")
    engine = llm.engine
    assert isinstance(engine.cache, KVGroups) and [len(g.layers) for g in engine.cache.groups] == [1, 5]
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40))
    full, window = [], []
    while engine.has_unfinished():
        engine.step()
        if req.num_computed > len(prompt) and req.seq is not None:
            full.append(held(req.seq, 0))
            window.append(held(req.seq, 1))
    assert window and max(window) <= WINDOW // BLOCK + 2, window  # the window's blocks and the next token's
    assert min(full) >= len(prompt) // BLOCK  # the full layer reads every key
    assert req.output_ids == expected
    assert not engine.cache.live_sequences()
    assert (engine.runner.graphs.replays > 0) == (device == "cuda")
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert again.cached_tokens >= len(prompt) - BLOCK and again.token_ids == expected
    both = llm.generate([prompt[:-8]], SamplingParams(temperature=0, max_tokens=12, n=2), use_tqdm=False)[0]
    assert [c.token_ids for c in both.outputs] == [hf_greedy(hybrid, prompt[:-8], 12)] * 2
    assert not engine.cache.live_sequences()


def test_a_hybrid_model_runs_prompts_that_one_cache_of_the_same_l1_could_not_hold(hybrid):
    """L1 of 40 whole-model blocks (160 tokens), no L2: one cache would refuse a 200-token prompt.
    Split by group, the window layers take room for two running windows and two steps (26
    blocks), and the full layer the rest (110 blocks of its own): three 200-token prompts run
    two at a time, decoding 48 tokens each until the full layer runs out and one is preempted,
    and each one's tokens equal transformers'."""
    bb = LLM(hybrid, device="cpu", dtype="float32", block_size=BLOCK, l1="1MiB").cache.layout.bytes_per_block
    llm = LLM(hybrid, device="cpu", dtype="float32", block_size=BLOCK, l1=40 * bb, l2=0, max_num_seqs=2,
              max_num_batched_tokens=32)
    cache = llm.cache
    assert cache.layout.bytes_per_block == bb and isinstance(cache, KVGroups)
    assert [c.l1.num_blocks for c in cache.caches] == [110, 26] and llm.engine.max_model_len > 300
    prompts = [prompt_of(200, s) for s in (1, 2, 3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hybrid, p, 48) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0
    assert not cache.live_sequences()


def test_groups_of_the_same_shape_keep_their_l2_and_l3_blocks_apart(alternating, tmp_path):
    """Full and window layers in turn: both groups' blocks have the same shape, so only the group's
    name keeps them apart. A prompt written to a disk L3 is served after a restart from L3 (each
    group reads its own objects, the window group only its last window), with the tokens of a
    run without caching."""
    prompt = prompt_of(120, 21)
    expected = hf_greedy(alternating, prompt + [7], 8)
    l3 = [f"file://{tmp_path}/l3?size=64MiB"]
    first = LLM(alternating, device="cpu", dtype="float32", block_size=BLOCK, l2="1MiB", l3=l3)
    a, b = first.cache.caches
    assert a.layout.fingerprint == b.layout.fingerprint and a.namespace() != b.namespace()
    first.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert first.cache.flush(30)
    first.close()
    again = LLM(alternating, device="cpu", dtype="float32", block_size=BLOCK, l2="1MiB", l3=l3)
    out = again.generate([prompt + [7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert out.token_ids == expected and out.cached_by_tier["l3"] >= len(prompt) - BLOCK
    groups = again.cache.stats()["groups"]
    assert [g["group"] for g in groups] == ["g0", f"g1w{WINDOW}"]
    # the full layers read all 30 blocks from L3; the window layers only those their next query
    # reads (the window's 16 tokens and the block it starts inside), which is all a window hit needs
    read = [g["tiers"]["l3"]["blocks_out"] for g in groups]
    assert read[0] == len(prompt) // BLOCK and 0 < read[1] <= WINDOW // BLOCK + 1, read
    # the model's stats: the lookups once (every group answers the same ones), each group's own
    # work (blocks stored, moved, evicted; at the top and per tier) added up
    stats = again.cache.stats()
    assert stats["queries"] == groups[0]["queries"] > 0 and stats["hit_tokens"] == groups[0]["hit_tokens"]
    assert stats["tiers"]["l3"]["hit_tokens"] == groups[0]["tiers"]["l3"]["hit_tokens"] > 0
    for key in ("stored_blocks", "blocks", "slot_waits_on_saves"):
        assert stats[key] == sum(g[key] for g in groups)
    assert stats["stored_blocks"] > groups[0]["stored_blocks"] > 0
    for key in ("blocks_out", "bytes_in"):
        assert stats["tiers"]["l3"][key] == sum(g["tiers"]["l3"][key] for g in groups)
    assert stats["tiers"]["l2"]["capacity_blocks"] == sum(g["tiers"]["l2"]["capacity_blocks"] for g in groups)
    assert stats["tiers"]["l3"]["blocks_out"] == sum(read)
    again.close()


@pytest.mark.parametrize("window_read", ["lands", "stalls"])
def test_an_l3_tail_is_read_by_every_group_while_the_start_is_recomputed(alternating, tmp_path, window_read):
    """Load-or-recompute splits an L3 part: the start is recomputed while the end is read. The
    full group reads the whole end, the window group only its last window; both take what landed
    at the same block, and the tokens equal transformers'. Where the window group's read stalls,
    no group takes any of the tail (the full group's landed blocks included): it is recomputed."""
    prompt = prompt_of(121, 23)  # 30 full blocks, then the token whose logits are computed
    expected = hf_greedy(alternating, prompt, 8)
    l3 = [f"file://{tmp_path}/l3?size=64MiB"]
    first = LLM(alternating, device="cpu", dtype="float32", block_size=BLOCK, l2="1MiB", l3=l3)
    first.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert first.cache.flush(30)
    first.close()
    llm = LLM(alternating, device="cpu", dtype="float32", block_size=BLOCK, l2="1MiB", l3=l3)
    cache, engine = llm.cache, llm.engine
    for c in cache.caches:  # one read in each group: block 0, and the disk's speed measured
        assert c.prefetch(c.match(prompt), 30, blocks=(0, 1)).wait(30)
    lead = cache.caches[0]
    # recomputing a block costs half of reading one: the end is read while the start is computed
    engine.scheduler.recompute_seconds_per_token = lead.tiers.load_seconds("l3", 29) / 29 / 2 / BLOCK
    gate = threading.Event()
    if window_read == "stalls":  # the window group's disk stalls: its part of the tail comes late
        cache.caches[1].tiers.l3._reader.submit(gate.wait)
    try:
        req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
        engine.step()
        start = req.adopt_at
        assert isinstance(req.tail, GroupedPrefetch) and BLOCK < start < 30 * BLOCK - 2 * WINDOW
        assert req.num_computed == start  # it stopped where the tail starts
        assert req.tail.parts[0].wait(30)
        if window_read == "lands":  # (under load the window group's read may land a step later)
            assert all(part.wait(30) for part in req.tail.parts)
        while engine.has_unfinished():
            engine.step()
    finally:
        gate.set()
    assert req.output_ids == expected
    read = [g["tiers"]["l3"]["blocks_out"] for g in cache.stats()["groups"]]
    if window_read == "lands":
        assert req.cached_tokens == BLOCK + (30 * BLOCK - start)  # block 0, and the whole tail
        # the full group read block 0 and the tail; the window group block 0 and the tail's last
        # window (the query at 120 reads keys from 105 on: blocks 26 to 29)
        assert read == [1 + 30 - start // BLOCK, 1 + 4], read
    else:  # the full group's tail landed and was not taken: every group recomputed it
        assert req.cached_tokens == BLOCK and read == [1 + 30 - start // BLOCK, 1], read
    assert not cache.live_sequences()
    llm.close()


def test_the_usage_gauge_weighs_each_groups_blocks_by_their_bytes(hybrid):
    """`tierkv_kv_cache_usage` (vLLM's kv_cache_usage_perc) is the fraction of L1 requests hold.
    With a cache per group, blocks differ in size (the window group's hold five layers, the full
    group's one): the gauge weighs them by bytes, not by count."""
    from tierkv.server.metrics import l1_held_fraction

    llm = LLM(hybrid, device="cpu", dtype="float32", block_size=BLOCK, l1="1MiB", l2=0, max_num_seqs=2,
              max_num_batched_tokens=32)
    cache = llm.cache
    plan = cache.plan(prompt_of(40, 5), budget=32)
    seq = cache.allocate(None, match=plan.match, reserve=plan.reserve)
    stats = cache.stats()
    held = [len(p.slots) * c.layout.bytes_per_block for c, p in zip(cache.caches, seq.parts)]
    assert held[0] != held[1] and stats["tiers"]["l1"]["used_blocks"] == sum(len(p.slots) for p in seq.parts)
    assert l1_held_fraction(stats) == pytest.approx(sum(held) / stats["tiers"]["l1"]["capacity_bytes"])
    cache.free(seq)
    assert l1_held_fraction(cache.stats()) == 0


def test_an_l2_too_small_for_every_group_says_how_large_it_must_be(hybrid):
    """L2 is shared among the groups by their layers: half a whole-model block leaves the full
    layer's group less than one of its blocks. The error names the whole l2 the user set and the
    least that works (one whole-model block), not a group's share."""
    from tierkv.errors import ConfigError

    bb = LLM(hybrid, device="cpu", dtype="float32", block_size=BLOCK, l1="1MiB").cache.layout.bytes_per_block
    with pytest.raises(ConfigError, match=f"l2 = {bb // 2} bytes .* raise l2 to at least {bb} bytes"):
        LLM(hybrid, device="cpu", dtype="float32", block_size=BLOCK, l1="1MiB", l2=bb // 2)
    assert [c.l2.num_blocks for c in LLM(hybrid, device="cpu", dtype="float32", block_size=BLOCK, l1="1MiB",
                                         l2=bb).cache.caches] == [1, 1]
