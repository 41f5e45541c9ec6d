"""fp8 KV in L2 and L3 (`kv_offload_dtype="fp8_e4m3"`): bounded error, twice the blocks, never mixed up.

Kernels: quantise/dequantise round trips within fp8's rounding bound, per (block, layer, K/V,
head) scale. Cache: blocks stored through L2 and through a disk L3 come back within that bound;
an L2 of the same bytes holds ~2x the blocks; an fp8 reader never takes a bf16 object (nor the
reverse). Engine: a prompt served from fp8 L2 gives logits and greedy tokens close to the ones
of unquantised KV, on the tiny random-weight Llama and Qwen3, and on the 2026 families (Qwen3-MoE,
gpt-oss, Gemma 3, DeepSeek-V3's MLA latent) (bounds from measurement, below).
Bad values are refused with the accepted ones named.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import xxhash
from models import save_tiny_checkpoint

from tierkv import LLM, CacheConfig, KVLayout, SamplingParams, TieredKVCache, kernels
from tierkv.engine.config import EngineConfig
from tierkv.errors import ConfigError
from tierkv.layout import LayerGroup
from tierkv.kernels import ShapeError
from tierkv.layout import OffloadLayout
from tierkv.server.cli import load_options
from tierkv.tiers.codec import BlockId
from tierkv.tiers.open import open_store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from accuracy_kv_offload import first_tokens_from_l2  # noqa: E402  (the measurement the bounds come from)

FP8 = "fp8_e4m3"
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")])
DEVICES = ["cpu", CUDA]  # on CUDA the conversions run on the copy and streaming side streams
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16, block_size=16)


def blocks(n: int, layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    """[n, layers, 2, bs, h, d] with a different magnitude per head (so one scale per head matters)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *layout.block_shape), generator=g)
    mag = torch.logspace(-3, 2, n * layout.num_layers * 2 * layout.num_kv_heads)
    x *= mag[torch.randperm(mag.numel(), generator=g)].view(n, layout.num_layers, 2, 1, layout.num_kv_heads, 1)
    return x.to(layout.dtype)


def within_fp8_bound(x: torch.Tensor, y: torch.Tensor, scales: torch.Tensor) -> bool:
    """|x - y| <= |x| / 16 (3 mantissa bits: half a step is 2^-4 of the value) + scale / 1024 (the
    subnormal step is 2^-9 x scale) + bf16 rounding of the output (2^-8 of the value)."""
    s = scales[..., None, :, None]
    xf = x.float()
    return bool(((xf - y.float()).abs() <= xf.abs() * (1 / 16 + 1 / 256) + s / 1024 + 1e-30).all())


def cache_kv(tokens: int, layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    """[layers, 2, tokens, h, d] KV for store(), heads of different magnitudes."""
    n = tokens // layout.block_size
    b = blocks(n, layout, seed)  # [n, L, 2, bs, h, d] -> [L, 2, n * bs, h, d]
    return b.permute(1, 2, 0, 3, 4, 5).reshape(layout.kv_shape(tokens))


def check_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """got is want after an fp8 round trip: the error of each head is within 1/14 of its amax."""
    # [L, 2, T, h, d]: amax over tokens and head_dim of each (layer, K/V, head), per 16-token block
    L, _, T, H, D = want.shape
    w = want.float().view(L, 2, T // 16, 16, H, D)
    err = (got.float().view_as(w) - w).abs().amax(dim=(3, 5))
    assert (err <= w.abs().amax(dim=(3, 5)) / 14 + 1e-6).all()
    assert not torch.equal(got, want)  # it really went through fp8


# ------------------------------------------------------------------ kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantise_round_trip_is_within_the_fp8_bound(dtype):
    layout = KVLayout(2, 2, 32, dtype, 16)
    x = blocks(5, layout)
    x[1, 0, 1, :, 1] = 0  # an all-zero head: scale 1, values 0
    fmt = OffloadLayout(layout)
    rows = torch.zeros((5, fmt.bytes_per_block), dtype=torch.uint8)
    kernels.quantize_fp8(x, fmt.payload(rows), fmt.scales(rows))
    scales = fmt.scales(rows)
    # one scale per (block, layer, K/V, head): amax / 448
    assert torch.allclose(scales[0], x[0].float().abs().amax(dim=(2, 4)) / 448)
    assert scales[1, 0, 1, 1] == 1.0
    out = torch.empty_like(x)
    kernels.dequantize_fp8(fmt.payload(rows), scales, out)
    assert within_fp8_bound(x, out, scales)
    assert (out[1, 0, 1, :, 1] == 0).all()
    # each head's largest value maps to fp8's largest, exactly
    assert fmt.payload(rows).float().abs().amax() == 448
    rel = ((out.float() - x.float()).abs().amax(dim=(3, 5)) / x.float().abs().amax(dim=(3, 5)).clamp_min(1e-30))
    assert rel.max() < 1 / 14  # measured: max 0.036-0.038, mean 0.034 (half an fp8 step at the top of the range)


def test_quantise_in_pieces_equals_quantise_at_once(monkeypatch):
    # A staging buffer is converted a piece of blocks at a time (bounded fp32 temporaries): the
    # pieces give the same bytes as one pass, and a block without a leading dim works too.
    from tierkv.kernels import reference

    x = blocks(7)
    fmt = OffloadLayout(LAYOUT)
    whole, pieces = (torch.zeros((7, fmt.bytes_per_block), dtype=torch.uint8) for _ in range(2))
    kernels.quantize_fp8(x, fmt.payload(whole), fmt.scales(whole))
    monkeypatch.setattr(reference, "_PIECE_ELEMENTS", 3 * x[0].numel())
    kernels.quantize_fp8(x, fmt.payload(pieces), fmt.scales(pieces))
    assert torch.equal(whole, pieces)
    out = torch.empty_like(x)
    kernels.dequantize_fp8(fmt.payload(pieces), fmt.scales(pieces), out)
    one = torch.empty_like(x[0, 0, 0])  # [bs, h, d], scales [h]
    kernels.dequantize_fp8(fmt.payload(pieces)[0, 0, 0], fmt.scales(pieces)[0, 0, 0], one)
    assert torch.equal(one, out[0, 0, 0])


def test_quantise_refuses_wrong_shapes():
    x = blocks(2)
    fmt = OffloadLayout(LAYOUT)
    rows = torch.zeros((2, fmt.bytes_per_block), dtype=torch.uint8)
    with pytest.raises(ShapeError, match="scales"):
        kernels.quantize_fp8(x, fmt.payload(rows), fmt.scales(rows)[:, :, 0])
    with pytest.raises(ShapeError, match="q"):
        kernels.quantize_fp8(x, torch.zeros(x.shape), fmt.scales(rows))


def test_offload_layout_halves_the_block_and_names_its_format():
    l8b = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
    fmt = OffloadLayout(l8b)
    assert l8b.bytes_per_block == 2 * 2**20
    assert fmt.bytes_per_block == 2**20 + 32 * 2 * 8 * 4  # fp8 values + one fp32 scale per layer, K/V, head
    assert l8b.bytes_per_block / fmt.bytes_per_block > 1.99
    assert fmt.fingerprint != l8b.fingerprint and fmt.fingerprint.startswith(l8b.fingerprint)
    assert fmt.block_storage == ((fmt.bytes_per_block,), torch.uint8)


# ------------------------------------------------------------------ cache


def fp8_cache(l1_blocks: int, l2_blocks: int, l3=(), layout: KVLayout = LAYOUT, offload: str | None = FP8,
              device: str = "cpu", **kw):
    bb = layout.bytes_per_block
    return TieredKVCache(layout, CacheConfig(l1=l1_blocks * bb, l2=l2_blocks * bb, l3=list(l3),
                                             kv_offload_dtype=offload, **kw), device=device, model="fp8-test")


def test_l2_of_the_same_bytes_holds_twice_the_blocks():
    plain, fp8 = fp8_cache(4, 64, offload=None), fp8_cache(4, 64)
    assert plain.l2.num_blocks == 64
    # 2 x 2 x 16 x 2 x 32 fp8 bytes + 2 x 2 x 2 scales of 4 bytes = 4128 for 8192 bytes of bf16
    assert fp8.l2.num_blocks == 64 * 8192 // 4128 == 127
    assert fp8.l2.kv.dtype == torch.uint8 and fp8.l2.nbytes <= plain.l2.nbytes
    assert fp8.stats()["tiers"]["l2"]["capacity_bytes"] == 127 * 4128
    assert fp8.l1.kv.dtype == torch.bfloat16  # L1 keeps the model's dtype


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_served_from_l2_are_within_the_bound(device):
    cache = fp8_cache(l1_blocks=4, l2_blocks=16, device=device)
    tokens = list(range(160))  # 10 blocks: 4 fit L1 (and are written through), the rest spill into L2
    kv = cache_kv(160).to(device)
    assert cache.store(tokens, kv.unbind(1)) == 160  # a 2-layer layout takes (k, v)
    cache.evict("l1")  # everything now comes from L2
    n, got = cache.retrieve(tokens, limit=160)  # read out of L2, dequantised on the device
    assert n == 160
    check_close(got.cpu(), kv.cpu())
    st = cache.stats()["tiers"]["l2"]
    assert st["bytes_out"] == st["blocks_out"] * OffloadLayout(LAYOUT).bytes_per_block
    # loaded into L1 slots as the engine does (the mover's H2D path): the same values
    entries = [cache.index.entries[h] for h in cache.match(tokens, limit=160).hashes[:4]]
    slots = cache.tiers.take_l1(4)
    cache.tiers.mover.l2_to_l1([e.l2 for e in entries], slots).synchronize()
    loaded = cache.l1.kv[:, torch.tensor(slots, device=device)]  # [L, 4, 2, bs, h, d]
    check_close(loaded.transpose(1, 2).reshape(LAYOUT.kv_shape(64)).cpu(), kv[:, :, :64].cpu())
    cache.tiers.give_l1(slots)
    cache.close()


def test_blocks_served_from_a_disk_l3_are_within_the_bound_and_formats_never_mix(tmp_path):
    url = f"file://{tmp_path}?size=16MiB"
    tokens = list(range(100, 228))  # 8 blocks
    kv = cache_kv(128, seed=1)
    writer = fp8_cache(2, 4, [url], write_policy="write_through")
    assert writer.store(tokens, kv.unbind(1)) == 128
    assert writer.tiers.flush(timeout=30)
    writer.close()

    reader = fp8_cache(2, 4, [url])  # a fresh process's view: L1 and L2 empty
    n, got = reader.retrieve(tokens, limit=128)
    assert n == 128
    check_close(got, kv)
    assert reader.stats()["tiers"]["l3"]["blocks_out"] > 0
    reader.close()

    # a bf16 cache on the same directory finds none of it: another namespace, another format
    plain = fp8_cache(2, 4, [url], offload=None)
    assert plain.match(tokens, limit=128).tokens == 0
    n, _ = plain.retrieve(tokens, limit=128)
    assert n == 0
    plain.close()


def test_an_object_of_the_other_format_is_a_miss_never_data(tmp_path):
    # Same name, same block id: only the format differs. Either reader refuses the other's object.
    fmt = OffloadLayout(LAYOUT)
    ns, tokens = bytes(16), bytes(4 * LAYOUT.block_size)
    ids = [BlockId(xxhash.xxh3_128_intdigest(bytes(16) + ns + tokens), 0, ns, tokens, 0)]
    for writer_layout, reader_layout in ((LAYOUT, fmt), (fmt, LAYOUT)):
        d = tmp_path / writer_layout.fingerprint
        url = f"file://{d}?size=1MiB"
        shape, dtype = writer_layout.block_storage
        w = open_store(url, writer_layout)
        assert w.put_many(ids, [torch.ones(shape, dtype=dtype)]) == [True]
        w.close()
        r = open_store(url, reader_layout)
        shape, dtype = reader_layout.block_storage
        out = torch.zeros(shape, dtype=dtype)
        assert r.get_many(ids, [out], None) == [False]  # (out may hold bytes of it: a miss is never used)
        assert r.stats()["errors"]["layout"] == 1
        r.close()


# ------------------------------------------------------------------ configuration


def test_unknown_offload_dtype_is_refused_with_the_accepted_values():
    with pytest.raises(ConfigError, match="fp8_e4m3"):
        CacheConfig(kv_offload_dtype="fp8")
    with pytest.raises(ConfigError, match="kv_offload_dtype 'int4'.*fp8_e4m3"):
        EngineConfig(kv_offload_dtype="int4")  # before any model loads
    assert EngineConfig(kv_offload_dtype=FP8).cache_config().kv_offload_dtype == FP8
    assert load_options(["--kv-offload-dtype", FP8])["kv_offload_dtype"] == FP8
    assert load_options([])["kv_offload_dtype"] is None


# ------------------------------------------------------------------ engine

# Measured on CPU (fp32 model, so L1 is fp32 and fp8 L2 holds 4x the blocks), 16 prompts of
# 40-190 tokens, first token after the prefix is loaded from L2, fp8 vs unquantised L2:
#   tiny llama seed 0: argmax agrees 13/16, logits max-abs error max 2.54, mean 1.15 (logit std 2.48)
#   tiny llama seed 3: 12/16, max 3.59, mean 1.37 (std 2.46)
#   tiny qwen3 seed 0: 14/16, max 1.05, mean 0.46 (std 2.42); seed 3: 14/16, max 0.71, mean 0.42
# The random-weight models are chaotic (weights of std 0.3: attention scores of std ~6, so a
# softmax close to one-hot), far more sensitive than a trained model: the bundled SmolLM2
# agreed 128/128 greedy tokens over 4 prompts x 32 tokens served from fp8 L2, with a logits
# max-abs error of 0.48 (logit max 19.6). The bounds sit ~1.5x above the worst measurement.
BOUNDS = {"llama": (10, 5.0, 2.0), "qwen3": (12, 1.6, 0.7)}  # agree of 16, max error, mean error


def served_from_l2(path: str, offload: str | None, prompts: list[list[int]], device: str = "cpu"):
    """First-token logits [n, vocab] for `prompts` served from L2 (computed once, then evicted from L1)."""
    bb = LLM(path, device=device, dtype="float32", l1=1 << 20, l2=0).cache.layout.bytes_per_block
    # eager: first_tokens_from_l2 records each step's logits from the model's forward, which a
    # replayed CUDA graph does not call
    llm = LLM(path, device=device, dtype="float32", l1=64 * bb, l2=256 * bb, kv_offload_dtype=offload,
              enforce_eager=True)
    _, logits = first_tokens_from_l2(llm, prompts, SamplingParams(temperature=0, max_tokens=1))
    return logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prompts_served_from_fp8_l2_agree_with_unquantised_kv(kind, device, tmp_path):
    path = str(save_tiny_checkpoint(kind, tmp_path / kind, seed=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (40 + 10 * i,), generator=g).tolist() for i in range(16)]
    ref = served_from_l2(path, None, prompts, device)
    got = served_from_l2(path, FP8, prompts, device)
    assert ref.shape == got.shape == (16, 512)
    err = (ref - got).abs().amax(dim=-1)  # [16]
    agree = int((ref.argmax(-1) == got.argmax(-1)).sum())
    min_agree, max_err, mean_err = BOUNDS[kind]
    assert agree >= min_agree, (agree, err)
    assert err.max() < max_err and err.mean() < mean_err, err
    assert err.max() > 0  # the KV really was quantised


@pytest.mark.parametrize("device", DEVICES)
def test_a_sequence_streamed_from_fp8_l2_matches_within_the_bound(device, tmp_path):
    # A context four times L1: its oldest blocks live in fp8 L2 and attention streams them back
    # layer by layer, dequantised on the way. Tokens follow the unquantised run on most steps.
    path = str(save_tiny_checkpoint("qwen3", tmp_path / "q", seed=0))
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, 512, (440,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=8)
    bb = LLM(path, device=device, dtype="float32", l1=1 << 20, l2=0).cache.layout.bytes_per_block
    runs = []
    for offload in (None, FP8):
        llm = LLM(path, device=device, dtype="float32", l1=8 * bb, l2=64 * bb, kv_offload_dtype=offload,
                  max_num_batched_tokens=256, enforce_eager=True)
        runs.append(llm.generate([long], params, use_tqdm=False)[0].token_ids)
        assert llm.cache.streamer.bytes_read > 0
        assert not llm.engine.has_unfinished()
    # measured on CPU: all 8 tokens equal (tiny llama, more chaotic: the first 2); the bound
    # leaves room for one rounding-level flip late in the run
    same = next((i for i, (a, b) in enumerate(zip(*runs)) if a != b), 8)
    assert len(runs[1]) == 8 and same >= 4, runs


# The 2026 families (issue 39), measured as above (16 prompts, seeds 0 and 3, first token after a
# prefix served from L2, fp8 vs unquantised L2; bounds ~1.5x above the worse seed):
#   qwen3_moe:   agree 14, 12 of 16; max 3.72, 1.75; mean 0.69, 0.56 (logit std 2.4)
#   gpt_oss:     agree 11, 11;       max 6.10, 3.68; mean 1.83, 1.42 (std 2.4)
#   gemma3:      agree 13, 13;       max 2.66, 2.72; mean 1.32, 1.19 (std 4.9)
#   deepseek_v3: agree 11, 9;        max 8.60, 9.96; mean 1.93, 3.07 (std 2.4): the MLA latent
#     (one 288-wide head per plane, c_kv and k_pe sharing the V plane's scale) is quantised with
#     one scale per block and plane, and kv_b_proj's up-projection spreads its error over every head.
FAMILY_BOUNDS = {"qwen3_moe": (10, 5.6, 1.0), "gpt_oss": (9, 9.2, 2.7), "gemma3": (10, 4.1, 2.0),
                 "deepseek_v3": (7, 15.0, 4.6)}


@pytest.mark.parametrize("kind", list(FAMILY_BOUNDS))
def test_the_2026_families_served_from_fp8_l2_stay_within_their_bound(kind, tmp_path):
    # fp8 L2 holds a quarter of an fp32 block for every family, MLA's one latent head and
    # windowed layouts included. A model of full and window layers (gpt-oss, Gemma 3) keeps a cache
    # per group of layers, whose L2 blocks hold that group's layers; an fp8 L2 hit loads them whole
    # (the layer-trimmed load of one cache works on unquantised L2 only), as l2 bytes_out shows.
    path = str(save_tiny_checkpoint(kind, tmp_path / kind, seed=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (40 + 10 * i,), generator=g).tolist() for i in range(16)]
    layout = LLM(path, device="cpu", dtype="float32", l1=1 << 20, l2=0).cache.layout
    bb = layout.bytes_per_block
    groups = layout.groups if any(w is None for w in layout.windows) else (LayerGroup(tuple(range(layout.num_layers))),)
    runs = {}
    for offload in (None, FP8):
        llm = LLM(path, device="cpu", dtype="float32", l1=64 * bb, l2=256 * bb, kv_offload_dtype=offload)
        _, logits = first_tokens_from_l2(llm, prompts, SamplingParams(temperature=0, max_tokens=1))
        stats = llm.cache.stats()
        assert len(stats.get("groups", [stats])) == len(groups)
        runs[offload] = logits, [s["tiers"]["l2"]["bytes_out"] / s["tiers"]["l2"]["blocks_out"]
                                 for s in stats.get("groups", [stats])]
        llm.close()
    (ref, full_blocks), (got, fp8_blocks) = runs[None], runs[FP8]
    for group, fp8_block, full_block in zip(groups, fp8_blocks, full_blocks):
        sub = layout if len(groups) == 1 else layout.of_group(group)
        # whole blocks of the group's layers, a quarter of fp32's
        assert fp8_block == OffloadLayout(sub, FP8).bytes_per_block < sub.bytes_per_block / 3
        # unquantised L2 loads whole blocks of a group's layers: with one cache for a window model
        # (Mistral-like), only the full layers of the blocks every window has left behind
        trimmed = len(groups) == 1 and any(w is not None for w in layout.windows)
        assert (full_block < sub.bytes_per_block) == trimmed, (group, full_block, sub.bytes_per_block)
    err = (ref - got).abs().amax(dim=-1)
    agree = int((ref.argmax(-1) == got.argmax(-1)).sum())
    min_agree, max_err, mean_err = FAMILY_BOUNDS[kind]
    assert agree >= min_agree, (agree, err)
    assert err.max() < max_err and err.mean() < mean_err, err
    assert err.max() > 0  # the KV really was quantised
