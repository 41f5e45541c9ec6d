"""An engine's own KV tensors as L1 (TieredKVCache(kv_caches=..., kv_layout=...), tiers/gpu.py):
blocks move between them and L2/L3 bit for bit in every layout, the layer-by-layer save lands the
same bytes as a whole-block copy, and a bad buffer is a ConfigError that names the shape it needs."""

import pytest
import torch

from prefix_kv import prefix_kv
from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.errors import ConfigError, UsageError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16, block_size=4)
L, _, BS, H, D = LAYOUT.block_shape
N = 12  # blocks in the engine's buffers


def engine_buffers(kind: str):
    """Buffers an engine of that kind allocates, and a function (layer, slot) -> [2, bs, H, D] that
    reads one block of one layer back the engine's way (K then V, tokens then heads)."""
    if kind == "tierkv":
        kv = torch.zeros(L, N, 2, BS, H, D, dtype=LAYOUT.dtype)
        return kv, lambda l, s: kv[l, s]
    if kind == "vllm":
        layers = {f"model.layers.{l}.self_attn": torch.zeros(2, N, BS, H, D, dtype=LAYOUT.dtype) for l in range(L)}
        return layers, lambda l, s: list(layers.values())[l][:, s]
    if kind == "flashinfer_nhd":
        layers = [torch.zeros(N, 2, BS, H, D, dtype=LAYOUT.dtype) for _ in range(L)]
        return layers, lambda l, s: layers[l][s]
    layers = [torch.zeros(N, 2, H, BS, D, dtype=LAYOUT.dtype) for _ in range(L)]  # flashinfer_hnd
    return layers, lambda l, s: layers[l][s].transpose(1, 2)


KINDS = ["tierkv", "vllm", "flashinfer_nhd", "flashinfer_hnd"]


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_move_in_and_out_of_an_engines_own_buffers(kind):
    buffers, block = engine_buffers(kind)
    cache = TieredKVCache(LAYOUT, CacheConfig(l2=16 * LAYOUT.bytes_per_block, write_policy="write_through"),
                          kv_caches=buffers, kv_layout=kind, model="registered")
    assert cache.l1.num_blocks == N
    tokens = list(range(17))
    kv = prefix_kv(LAYOUT, tokens)  # [L, 2, 17, H, D]
    assert cache.store(tokens, kv) == 16
    seq = cache.allocate(tokens)
    assert seq.num_cached_tokens == 16
    for b in range(4):  # the engine reads its own buffers: the stored tokens are there
        for layer in range(L):
            assert torch.equal(block(layer, seq.slots[b]), kv[layer, :, 4 * b : 4 * b + 4])
    cache.free(seq)
    cache.evict("l1")  # out of the engine's buffers (they stay in L2), then back into other slots
    seq = cache.allocate(tokens)
    seq.wait()
    assert cache.match(tokens).by_tier == {"l1": 16, "l2": 0, "l3": 0}
    for b in range(4):
        for layer in range(L):
            assert torch.equal(block(layer, seq.slots[b]), kv[layer, :, 4 * b : 4 * b + 4])
    n, back = cache.retrieve(tokens)
    assert n == 16 and torch.equal(back, kv[:, :, :16])
    cache.close()


def write_step(block, seq, tokens, start):
    """Play the engine: write the KV of tokens[start:] into its own buffers, the engine's way."""
    kv = prefix_kv(LAYOUT, tokens)
    for p in range(start, len(tokens)):
        for layer in range(L):
            block(layer, seq.slots[p // BS])[:, p % BS] = kv[layer, :, p]


@pytest.mark.parametrize("kind", ["vllm", "flashinfer_hnd"])
def test_a_layer_by_layer_save_lands_what_a_whole_copy_would(kind, tmp_path):
    buffers, block = engine_buffers(kind)
    url = f"file://{tmp_path}"
    cache = TieredKVCache(LAYOUT, CacheConfig(l2=16 * LAYOUT.bytes_per_block, l3=[url]), kv_caches=buffers,
                          kv_layout=kind, model="registered")
    tokens = list(range(14))
    seq = cache.admit(tokens)
    for layer in range(L):  # the forward: each layer waits for its loads, writes, and saves
        cache.wait_for_layer(layer, [seq])
        write_step(block, seq, tokens, 0)
        if layer < 2:  # the last layer is left to commit, as an engine that stops early would
            cache.save_layer(layer, [seq])
    with pytest.raises(UsageError, match="in order"):
        cache.save_layer(0, [seq])
    assert cache.commit(seq, tokens) == 3
    # the blocks are in L1 and L2 already (no second copy) and on their way to L3
    assert all(e.l2 >= 0 for e in seq.entries[:3])
    assert cache.stats()["tiers"]["l2"]["blocks_in"] == 3
    cache.free(seq)
    assert cache.flush(timeout=30)
    cache.close()
    with TieredKVCache(LAYOUT, CacheConfig(l1=8 * LAYOUT.bytes_per_block, l2=16 * LAYOUT.bytes_per_block,
                                           l3=[url]), device="cpu", model="registered") as fresh:
        n, kv = fresh.retrieve(tokens)
        assert n == 12 and torch.equal(kv, prefix_kv(LAYOUT, tokens)[:, :, :12])


def test_a_save_of_blocks_someone_else_entered_first_gives_its_l2_slots_back():
    buffers, block = engine_buffers("vllm")
    cache = TieredKVCache(LAYOUT, CacheConfig(l2=16 * LAYOUT.bytes_per_block), kv_caches=buffers,
                          kv_layout="vllm", model="registered")
    tokens = list(range(9))
    a, b = cache.allocate(tokens), cache.allocate(tokens)
    for seq in (a, b):
        write_step(block, seq, tokens, 0)
        for layer in range(L):
            cache.save_layer(layer, [seq])
    cache.commit(a, tokens)
    cache.commit(b, tokens)  # a entered these blocks: b's stay private, its saved copies unused
    for seq in (a, b):
        cache.free(seq)
    cache.evict("l1")
    cache.evict("l2")
    assert cache.stats()["tiers"]["l2"]["used_blocks"] == 0 and len(cache.l2.free) == 16


def test_bad_buffers_are_config_errors_that_name_the_expected_shape():
    good = [torch.zeros(2, N, BS, H, D, dtype=LAYOUT.dtype) for _ in range(L)]

    def register(buffers, kind="vllm", **kw):
        return TieredKVCache(LAYOUT, CacheConfig(**kw), kv_caches=buffers, kv_layout=kind, model="m")

    with pytest.raises(ConfigError, match="unknown"):
        register(good, "paged")
    with pytest.raises(ConfigError, match="3 tensor"):
        register(good[:2])
    with pytest.raises(ConfigError, match=r"needs \(2, 'N', 4, 2, 4\)"):
        register([torch.zeros(N, 2, BS, H, D, dtype=LAYOUT.dtype)] * L)
    with pytest.raises(ConfigError, match="float32"):
        register([t.float() for t in good])
    with pytest.raises(ConfigError, match="same count"):
        register(good[:2] + [torch.zeros(2, N + 1, BS, H, D, dtype=LAYOUT.dtype)])
    with pytest.raises(ConfigError, match="leave CacheConfig.l1 unset"):
        register(good, l1=LAYOUT.bytes_per_block)
    with pytest.raises(ConfigError, match=r"\(3, 'N', 2, 4, 2, 4\)"):
        register(torch.zeros(2, N, 2, BS, H, D, dtype=LAYOUT.dtype), "tierkv")


def test_a_prompt_larger_than_registered_buffers_is_a_clear_cache_full_error():
    from tierkv.errors import CacheFullError

    buffers, _ = engine_buffers("vllm")
    cache = TieredKVCache(LAYOUT, CacheConfig(l2=64 * LAYOUT.bytes_per_block), kv_caches=buffers,
                          kv_layout="vllm", model="registered")
    with pytest.raises(CacheFullError):
        cache.admit(list(range(N * BS + 5)))
    assert len(cache.l1.free) == N


def cuda_buffers(kind: str, layout: KVLayout, blocks: int):
    L_, _, bs, h, d = layout.block_shape
    shape = {"vllm": (2, blocks, bs, h, d), "flashinfer_nhd": (blocks, 2, bs, h, d),
             "flashinfer_hnd": (blocks, 2, h, bs, d)}
    if kind == "tierkv":
        return torch.zeros(L_, blocks, 2, bs, h, d, dtype=layout.dtype, device="cuda")
    return [torch.zeros(shape[kind], dtype=layout.dtype, device="cuda") for _ in range(L_)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
@pytest.mark.parametrize("offload", [None, "fp8_e4m3"])
@pytest.mark.parametrize("kind", KINDS)
def test_registered_buffers_on_the_gpu_round_trip_through_pinned_l2(kind, offload):
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)
    cache = TieredKVCache(layout, CacheConfig(l2=64 * layout.bytes_per_block, kv_offload_dtype=offload),
                          kv_caches=cuda_buffers(kind, layout, 32), kv_layout=kind, model="gpu-registered")
    assert cache.l2.pinned
    tokens = list(range(16 * 10 + 3))
    seq = cache.admit(tokens)
    want = torch.randn(10, *layout.block_shape, device="cuda").to(layout.dtype)
    for layer in range(layout.num_layers):  # the forward writes, and each layer is saved as it is written
        cache.wait_for_layer(layer, [seq])
        cache.l1.write(seq.slots[:10], want)
        cache.save_layer(layer, [seq])
    cache.commit(seq, tokens)
    cache.free(seq)
    cache.evict("l1")
    cache.l1.write(list(range(32)), torch.zeros(32, *layout.block_shape, device="cuda", dtype=layout.dtype))
    seq = cache.admit(tokens)
    assert seq.num_cached_tokens == 160
    for layer in range(layout.num_layers):
        cache.wait_for_layer(layer, [seq])
    got = cache.l1.read(seq.slots[:10])
    if offload is None:
        assert torch.equal(got, want)
    else:  # fp8 rounding: at most 1/16 of a value, within its head's scale
        assert (got.float() - want.float()).abs().max() <= want.float().abs().max() / 8
    n, kv = cache.retrieve(tokens)
    assert n == 160
    cache.close()


def test_fp8_l2_under_registered_buffers_rounds_like_tierkvs_own_pool():
    """With kv_offload_dtype, blocks leave an engine's buffers as fp8 and come back as they would from
    tierkv's own pool: the same bytes in L2, the same values back."""
    config = dict(l2=16 * LAYOUT.bytes_per_block, kv_offload_dtype="fp8_e4m3")
    tokens = list(range(17))
    backs = []
    for kind in ("vllm", "tierkv"):
        buffers, _ = engine_buffers(kind)
        cache = TieredKVCache(LAYOUT, CacheConfig(**config), kv_caches=buffers, kv_layout=kind, model="fp8")
        cache.store(tokens, prefix_kv(LAYOUT, tokens))
        cache.evict("l1")
        seq = cache.admit(tokens)
        backs.append(cache.l1.read(seq.slots[:4]))
    assert torch.equal(backs[0], backs[1])
    assert (backs[0].float() - prefix_kv(LAYOUT, tokens)[:, :, :16].float().reshape(L, 2, 4, BS, H, D)
            .permute(2, 0, 1, 3, 4, 5)).abs().max() > 0  # it did go through fp8


@pytest.mark.parametrize("layers", [1, 3, 4, 28, 30, 32, 33])
def test_a_load_by_layer_groups_waits_for_the_group_that_holds_the_layer(layers):
    """Transfer.group_of maps every layer to the one launch of a load that copies it (30 layers in
    4 groups: 0-6, 7-14, 15-21, 22-29), so wait_for_layer never waits for too little."""
    from tierkv.transfer import LAYER_GROUPS, Transfer, layer_groups

    starts = layer_groups(layers)
    assert len(starts) == min(layers, LAYER_GROUPS) and starts[0] == 0 and starts == sorted(set(starts))
    load = Transfer(None, [object()] * len(starts), starts)
    ends = starts[1:] + [layers]
    for layer in range(layers):
        g = load.group_of(layer)
        assert starts[g] <= layer < ends[g]


def forward(block, seqs, tokens, starts, ends, save=True):
    """Play one engine step: layer by layer, write the KV of tokens[b][starts[b]:ends[b]] of each
    sequence into its buffers, and hand the layer to save_layer as soon as it is written."""
    kvs = [prefix_kv(LAYOUT, t) for t in tokens]
    for layer in range(L):
        for seq, kv, start, end in zip(seqs, kvs, starts, ends):
            for p in range(start, end):
                block(layer, seq.slots[p // BS])[:, p % BS] = kv[layer, :, p]
        if save:
            seqs and seqs[0].owner.save_layer(layer, seqs)


def l2_hit(cache, block, prompt) -> torch.Tensor:
    """Bring the cached blocks of `prompt` back from L2 into the engine's buffers (which are wiped
    first), as the admission of a longer prompt would, and read them there, the engine's way:
    [L, 2, tokens of its full blocks, H, D]."""
    cache.evict("l1")
    for t in cache.l1.layers:
        t.fill_(-2)
    full = len(prompt) // BS
    seq = cache.admit(prompt + [0])
    assert seq.num_cached_tokens == full * BS
    seq.wait()
    got = torch.stack([torch.cat([block(layer, s) for s in seq.slots[:full]], dim=1) for layer in range(L)])
    cache.free(seq)
    return got


@pytest.mark.parametrize("save_next", [True, False])
def test_a_step_that_fills_no_block_ends_its_save_cleanly(save_next):
    """Issue 37 item 13: a chunk that fills no block, saved layer by layer and committed (0 blocks),
    must leave nothing pending: the next step saves again (it raised 'takes the layers in order'),
    or, without save_layer, commits what it wrote (stale copies of the first chunk landed in L2)."""
    buffers, block = engine_buffers("vllm")
    for t in buffers.values():
        t.fill_(-1)  # what the buffers held before: any copy taken too early shows it
    cache = TieredKVCache(LAYOUT, CacheConfig(l2=16 * LAYOUT.bytes_per_block, write_policy="write_through"),
                          kv_caches=buffers, kv_layout="vllm", model="registered")
    prompt = list(range(20))
    seq = cache.admit(prompt)  # room for all 20 tokens: save_layer copies blocks 0-4 of the first chunk
    forward(block, [seq], [prompt], [0], [3])
    assert cache.commit(seq, prompt[:3]) == 0
    forward(block, [seq], [prompt], [3], [20], save=save_next)
    assert cache.commit(seq, prompt) == 5
    cache.free(seq)
    assert torch.equal(l2_hit(cache, block, prompt), prefix_kv(LAYOUT, prompt))
    assert cache.stats()["tiers"]["l2"]["used_blocks"] == 5  # no slot of the dropped save is left behind
    cache.close()


@pytest.mark.parametrize("seed", range(4))
def test_layer_by_layer_saves_of_chunks_not_aligned_to_blocks_land_what_was_computed(seed):
    """A chunked prefill in chunks of any size, batches of sequences that share prefixes, steps
    with and without save_layer: every block that reaches L2 holds exactly the KV computed for it
    (prefix_kv is the no-cache reference), as an L2 hit shows in the engine's own buffers."""
    import random

    rng = random.Random(seed)
    blocks = 48
    buffers = [torch.full((2, blocks, BS, H, D), -1, dtype=LAYOUT.dtype) for _ in range(L)]

    def block(layer, slot):
        return buffers[layer][:, slot]

    cache = TieredKVCache(LAYOUT, CacheConfig(l2=256 * LAYOUT.bytes_per_block, write_policy="write_through"),
                          kv_caches=buffers, kv_layout="vllm", model="chunks")
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    for _ in range(12):  # batches
        prompts = [rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
                   for _ in range(rng.randrange(1, 4))]
        seqs = [cache.admit(p) for p in prompts]
        done = [s.num_cached_tokens for s in seqs]
        while any(d < len(p) for d, p in zip(done, prompts)):
            step = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            ends = [min(len(prompts[i]), done[i] + rng.randrange(1, 7)) for i in step]
            forward(block, [seqs[i] for i in step], [prompts[i] for i in step], [done[i] for i in step], ends,
                    save=rng.random() < 0.8)
            for i, end in zip(step, ends):
                done[i] = end
                cache.commit(seqs[i], prompts[i][:end])
        for s in seqs:
            cache.free(s)
        if rng.random() < 0.5:
            for p in (p for p in prompts if len(p) >= BS):
                want = prefix_kv(LAYOUT, p)[:, :, : len(p) // BS * BS]
                assert torch.equal(l2_hit(cache, block, p), want)
    cache.evict("l1")
    for p in {tuple(p) for p in stems}:
        assert torch.equal(cache.retrieve(p, limit=len(p))[1], prefix_kv(LAYOUT, list(p))[:, :, : len(p) // BS * BS])
    cache.close()


def test_a_forward_saved_but_not_committed_is_refused_at_the_next_save():
    buffers, block = engine_buffers("vllm")
    cache = TieredKVCache(LAYOUT, CacheConfig(l2=16 * LAYOUT.bytes_per_block), kv_caches=buffers,
                          kv_layout="vllm", model="registered")
    prompt = list(range(20))
    seq = cache.admit(prompt)
    forward(block, [seq], [prompt], [0], [6])
    with pytest.raises(UsageError, match=r"saved but not committed: call commit\(seq, tokens\) after each forward"):
        cache.save_layer(0, [seq])  # the engine skipped commit
    assert cache.commit(seq, prompt[:6]) == 1
    forward(block, [seq], [prompt], [6], [20])  # and goes on cleanly
    assert cache.commit(seq, prompt) == 4
    cache.free(seq)
    assert torch.equal(l2_hit(cache, block, prompt), prefix_kv(LAYOUT, prompt))
    cache.close()


def test_a_second_cache_over_buffers_in_use_is_refused_until_the_first_is_closed():
    """Two caches over one engine's buffers would both hand out block 0 (issue 37 item 14)."""
    buffers, _ = engine_buffers("vllm")

    def register(kv, kind="vllm"):
        return TieredKVCache(LAYOUT, CacheConfig(), kv_caches=kv, kv_layout=kind, model="registered")

    first = register(buffers)
    refused = "shares memory with the L1 of another TieredKVCache that is still open"
    with pytest.raises(ConfigError, match=refused):
        register(buffers)
    with pytest.raises(ConfigError, match=refused):  # some blocks of them are as much in use
        register([t[:, 5:9] for t in buffers.values()])
    other = register(engine_buffers("vllm")[0])  # buffers of its own: fine
    assert other.allocate(list(range(5))).slots == first.allocate(list(range(5))).slots == [0, 1]
    first.close()
    second = register(buffers)  # the first is closed: the buffers are free to use
    del second  # dropped without close(): its claim goes with it
    register(buffers).close()
    own = TieredKVCache(LAYOUT, CacheConfig(l1=8 * LAYOUT.bytes_per_block), device="cpu", model="own")
    with pytest.raises(ConfigError, match=refused):  # tierkv's own pool is in use as much
        register(own.l1.kv, "tierkv")
    with pytest.raises(ConfigError, match="device="):  # a cache that fails to start claims nothing
        TieredKVCache(LAYOUT, CacheConfig(), device="cuda", kv_caches=buffers, kv_layout="vllm")
    register(buffers).close()


def test_buffers_whose_shape_cannot_tell_tokens_from_heads_share_l3_only_under_the_same_layout(tmp_path):
    """Issue 37 item 14: with block_size == kv_heads, FlashInfer NHD buffers declared HND pass every
    shape check, and what tierkv reads out of them is each block transposed. Their L3 objects are
    named by the declared layout, so a reader that sees its buffers another way misses them (it
    read the transposed KV), while one declared the same way reads back exactly what it wrote."""
    square = KVLayout(num_layers=3, num_kv_heads=4, head_dim=2, dtype=torch.float32, block_size=4)
    url = f"file://{tmp_path}"
    tokens = list(range(9))
    kv = prefix_kv(square, tokens)  # [L, 2, 9, H, D]

    def nhd_engine():
        layers = [torch.zeros(8, 2, 4, 4, 2) for _ in range(3)]  # [N, 2, block_size, kv_heads, D]: NHD
        cache = TieredKVCache(square, CacheConfig(l2=16 * square.bytes_per_block, l3=[url]), kv_caches=layers,
                              kv_layout="flashinfer_hnd", model="square")  # declared HND: a mistake
        return layers, cache

    layers, writer = nhd_engine()
    seq = writer.admit(tokens)
    for p in range(9):  # the engine writes its way: block, K/V, token, head
        for layer in range(3):
            layers[layer][seq.slots[p // 4], :, p % 4] = kv[layer, :, p]
    assert writer.commit(seq, tokens) == 2
    writer.free(seq)
    assert writer.flush(timeout=30)
    writer.close()
    with TieredKVCache(square, CacheConfig(l1=8 * square.bytes_per_block, l2=16 * square.bytes_per_block,
                                           l3=[url]), device="cpu", model="square") as own:
        assert own.match(tokens).tokens == 0  # tierkv's own pool would get the blocks transposed
    nhd = [torch.zeros(8, 2, 4, 4, 2) for _ in range(3)]
    with TieredKVCache(square, CacheConfig(l2=16 * square.bytes_per_block, l3=[url]), kv_caches=nhd,
                       kv_layout="flashinfer_nhd", model="square") as declared_right:
        assert declared_right.match(tokens).tokens == 0  # and so would buffers declared NHD
    layers, again = nhd_engine()  # the same engine after a restart: its own bytes, read back its way
    seq = again.admit(tokens)
    assert seq.cached_by_tier == {"l1": 0, "l2": 0, "l3": 8}
    seq.wait()
    got = torch.stack([torch.cat([layers[layer][s] for s in seq.slots[:2]], dim=1) for layer in range(3)])
    assert torch.equal(got, kv[:, :, :8])
    again.close()
