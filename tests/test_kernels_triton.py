"""The Triton kernels against the torch reference, run on CPU by the Triton interpreter.

TRITON_INTERPRET=1 must be set before triton itself is imported (triton.language's own @jit
helpers are built at import), which an ordinary pytest process cannot promise. So in a normal run
this file holds one test that runs this same file in a child pytest with the variable set; in
the child (TRITON_INTERPRET=1) it holds the real tests. No other test file sees the variable.
fp16 and fp32 only: bf16 tl.dot is wrong under the interpreter (DEVICE.md); bf16 is GPU-tested.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:

    def test_triton_kernels_under_interpreter():
        pytest.importorskip("triton")
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"interpreter tests failed:\n{run.stdout[-20000:]}\n{run.stderr[-5000:]}"


pytest.importorskip("triton")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from tierkv.kernels import reference as ref  # noqa: E402
from tierkv.kernels.testing import cu_seqlens, make_paged  # noqa: E402
from sampling_cases import safe_top_p  # noqa: E402

_MODULES = ("_launch", "decode", "prefill", "write", "block_copy", "norm", "rope", "activation", "sampling")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.fixture(scope="module")
def tk():
    """The Triton kernel modules, built for the interpreter."""
    mods = {name: importlib.import_module(f"tierkv.kernels.{name}") for name in _MODULES}
    assert mods["_launch"].INTERPRETING
    return type("Kernels", (), mods)


def _decode_case(tk, lens, hkv, group, d, bs, dtype, window=None, seed=0, **launch):
    g = torch.Generator().manual_seed(seed)
    pb = make_paged(lens, hkv, d, bs, dtype=dtype, generator=g)
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(dtype)
    got = tk.decode._paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, d**-0.5, window, **launch)
    want = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, d**-0.5, window)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _prefill_case(tk, lens, q_lens, hkv, group, d, bs, dtype, window=None, seed=0, **launch):
    g = torch.Generator().manual_seed(seed)
    pb = make_paged(lens, hkv, d, bs, dtype=dtype, generator=g)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=g).to(dtype)
    cu = cu_seqlens(q_lens)
    got = tk.prefill._paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5, window, **launch)
    want = ref.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5, window)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_ragged_lengths_and_gqa(tk, dtype, group, splits):
    # lengths 0, 1, not a multiple of the block size, exactly one block, several blocks
    _decode_case(tk, [0, 1, 17, 16, 45], 2, group, 32, 16, dtype, num_splits=splits, block_n=16)


@pytest.mark.parametrize("bs,block_n", [(16, 32), (32, 16), (64, 16)])
def test_decode_tiles_across_and_within_pages(tk, bs, block_n):
    _decode_case(tk, [70, 5, 129], 2, 4, 16, bs, torch.float16, num_splits=2, block_n=block_n)


@pytest.mark.parametrize("d", [64, 128, 40])
def test_decode_head_dims(tk, d):
    _decode_case(tk, [33, 9], 1, 4, d, 16, torch.float16, block_n=16)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_sliding_window(tk, splits):
    _decode_case(tk, [1, 20, 77], 2, 4, 16, 16, torch.float32, window=9, num_splits=splits, block_n=16)


def test_decode_default_launch_choices(tk):
    _decode_case(tk, [300, 3], 2, 4, 64, 16, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_plain_chunked_and_prefix_hits(tk, dtype, group):
    # plain prefill (q_len == len), chunk after a cached prefix, one token, an empty request
    _prefill_case(tk, [21, 50, 9, 12], [21, 18, 1, 0], 1, group, 32, 16, dtype)


@pytest.mark.parametrize("bs,bm,bn", [(16, 16, 32), (32, 32, 16), (64, 16, 16)])
def test_prefill_tiles_across_and_within_pages(tk, bs, bm, bn):
    _prefill_case(tk, [100, 37], [70, 37], 2, 2, 16, bs, torch.float16, block_m=bm, block_n=bn)


@pytest.mark.parametrize("window", [1, 6, 40])
def test_prefill_sliding_window(tk, window):
    _prefill_case(tk, [45, 30], [30, 30], 2, 4, 16, 16, torch.float32, window=window)


@pytest.mark.parametrize("d", [64, 128, 40])
def test_prefill_head_dims(tk, d):
    _prefill_case(tk, [40], [24], 1, 2, d, 16, torch.float16)


# a mixed batch: 1 new token over a long, page-misaligned context; 17 new over 23 cached; a cold
# sequence; one whose 4 cached tokens are shorter than any split's share (only the last split
# sees a key, the others have empty ranges). With 16-key tiles and 7 splits the first sequence's
# 64 fully visible keys give 4 splits work and leave 3 empty.
MIXED_LENS, MIXED_Q_LENS = [70, 40, 20, 9], [1, 17, 20, 5]


# every split count, each state of the window, and 7 splits (an empty one) both ways
@pytest.mark.parametrize("splits,window", [(1, None), (2, 37), (3, None), (7, None), (7, 37)])
def test_prefill_splits_match_reference(tk, splits, window):
    _prefill_case(tk, MIXED_LENS, MIXED_Q_LENS, 1, 4, 64, 16, torch.float32, window,
                  num_splits=splits, block_m=16, block_n=16)


# a group of 3 packs 5 tokens into a 16-row tile and leaves its last row to no token
@pytest.mark.parametrize("group,pack,d", [(1, None, 128), (4, False, 64), (4, True, 128), (3, True, 64)])
def test_prefill_splits_gqa_packing_and_head_dims(tk, group, pack, d):
    _prefill_case(tk, MIXED_LENS, MIXED_Q_LENS, 1, group, d, 16, torch.float16, None,
                  num_splits=3, pack=pack, block_m=16, block_n=16)


@pytest.mark.parametrize("bs,bm,bn,window", [(16, 32, 32, None), (32, 16, 16, 20), (16, 64, 16, None)])
def test_prefill_splits_across_pages_and_tiles(tk, bs, bm, bn, window):
    # packed rows with 32- and 64-row tiles: 8 and 16 new tokens a tile, the last tile part empty
    _prefill_case(tk, MIXED_LENS, MIXED_Q_LENS, 1, 4, 32, bs, torch.float16, window,
                  num_splits=2, pack=True, block_m=bm, block_n=bn)


def test_prefill_automatic_launch_splits_only_short_extends(tk, monkeypatch):
    monkeypatch.setattr(tk.prefill, "sm_count", lambda device: 132)     # an H200
    cpu = torch.device("cpu")
    choose = tk.prefill.choose_launch
    # Llama-3.1-8B: 32 q heads on 8 kv heads, d=128; a 3-token hit on 12K cached tokens
    hit = choose(3, 1, 32, 8, 12288, 128, cpu)
    assert (hit.block_m, hit.pack) == (16, 4) and hit.num_splits > 1
    assert 8 * hit.num_splits <= 2 * 132                       # about 2 programs per SM, no more
    assert hit.num_splits * 4 * hit.block_n <= 12288           # at least 4 tiles of work a split
    batch = choose(8 * 16, 8, 32, 8, 8192 + 16, 128, cpu)
    assert batch.pack == 4 and batch.num_splits > 1
    for n, tiles in ((4096, (128, 64, 4)), (16384, (256, 64, 8)), (32768, (256, 64, 8))):
        cold = choose(n, 1, 32, 8, n, 128, cpu)                # cold prefills keep their launch
        assert (cold.block_m, cold.block_n, cold.num_warps, cold.pack, cold.num_splits) == (*tiles, 1, 1)
    # a short cold prefill has nothing fully visible to split, however few its programs
    assert choose(300, 1, 32, 8, 304, 128, cpu).num_splits == 1


def test_prefill_automatic_splits_match_reference(tk, monkeypatch):
    monkeypatch.setattr(tk.prefill, "sm_count", lambda device: 64)
    choose, used = tk.prefill.choose_launch, []

    def recorded(*args, **kwargs):  # the launch the kernel really ran with
        used.append(choose(*args, **kwargs))
        return used[-1]

    monkeypatch.setattr(tk.prefill, "choose_launch", recorded)
    _prefill_case(tk, [300], [3], 2, 4, 64, 16, torch.float16)
    assert used[0].num_splits > 1 and used[0].pack == 4


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    data=st.data(),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 4, 8]),
    d=st.sampled_from([16, 32, 64]),
    bs=st.sampled_from([16, 32, 64]),
    window=st.sampled_from([None, 3, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_prefill_and_decode_random_shapes(tk, lens, data, hkv, group, d, bs, window, dtype):
    q_lens = [data.draw(st.integers(0, n), label="q_len") for n in lens]
    _prefill_case(tk, lens, q_lens, hkv, group, d, bs, dtype, window, block_m=16, block_n=16)
    _decode_case(tk, lens, hkv, group, d, bs, dtype, window, num_splits=data.draw(st.sampled_from([None, 2])), block_n=16)


def test_kv_write_matches_reference_and_skips(tk):
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 2, 16, 2, 64, generator=g).half()
    want = kv.clone()
    k, v = torch.randn(2, 6, 2, 64, generator=g).half()
    slots = torch.tensor([79, -1, 0, 33, -1, 16])
    tk.write.kv_write(k, v, kv, slots)
    ref.kv_write(k, v, want, slots)
    assert torch.equal(kv, want)


def test_kv_write_strided_pool(tk):
    # a layer view of a layer-first pool [layers, blocks, 2, bs, h, d] is not contiguous per layer
    pool = torch.zeros(3, 4, 2, 8, 2, 16)
    want = pool.clone()
    k, v = torch.randn(2, 5, 2, 16)
    slots = torch.tensor([0, 9, 31, -1, 17])
    tk.write.kv_write(k, v, pool[1], slots)
    ref.kv_write(k, v, want[1], slots)
    assert torch.equal(pool, want)


def test_decode_reads_a_strided_layer_view(tk):
    g = torch.Generator().manual_seed(4)
    pb = make_paged([40, 7], 2, 32, 16, dtype=torch.float16, generator=g)
    pool = torch.zeros(2, *pb.kv.shape, dtype=torch.float16)
    pool[1] = pb.kv
    q = torch.randn(2, 8, 32, generator=g).half()
    got = tk.decode._paged_decode(q, pool[1], pb.block_tables, pb.seq_lens, 0.2, num_splits=2, block_n=16)
    want = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.2)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])


def test_block_gather_scatter_round_trip(tk):
    pool = torch.randn(3, 9, 2, 16, 2, 64).half()
    slots = torch.tensor([7, 0, 3, 8])
    staged = torch.empty(4, 3, 2, 16, 2, 64).half()
    tk.block_copy.gather_blocks(pool, slots, staged)
    assert torch.equal(staged, ref.gather_blocks(pool, slots, torch.empty_like(staged)))
    fresh = torch.zeros_like(pool)
    tk.block_copy.scatter_blocks(staged, fresh, slots)
    assert torch.equal(fresh[:, slots], pool[:, slots])
    assert not fresh[:, [1, 2, 4, 5, 6]].any()


def test_copy_blocks_between_strided_layer_views(tk):
    host = torch.randn(9, 3, 2, 16, 2, 64).half()  # L2-like: [slots, layers, 2, bs, h, d]
    staging = torch.zeros(6, 2, 16, 2, 64).half()
    src, rows = torch.tensor([8, 0, 5]), torch.tensor([4, 1, 2])
    tk.block_copy.copy_blocks(host[:, 1], src, staging, rows)  # layer 1: rows strided by 3 layers
    assert torch.equal(staging[rows], host[src, 1])
    assert not staging[[0, 3, 5]].any()


def test_dispatch_env_forces_triton(tk, monkeypatch):
    import tierkv.kernels as K

    monkeypatch.setenv("TIERKV_KERNELS", "triton")
    pb = make_paged([5], 1, 16, 16)
    q = torch.randn(1, 2, 16)
    assert K.backend_for(q) == "triton"
    torch.testing.assert_close(K.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.3),
                               ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.3))
    monkeypatch.setenv("TIERKV_KERNELS", "reference")
    assert K.backend_for(q) == "reference"


def test_bad_inputs_fail_before_launch(tk):
    from tierkv.errors import ShapeError

    pb = make_paged([5], 2, 16, 16)
    with pytest.raises(ShapeError, match="dtype"):
        tk.decode.paged_decode(torch.randn(1, 2, 16).half(), pb.kv, pb.block_tables, pb.seq_lens, 1.0)
    with pytest.raises(ShapeError, match="multiple"):
        tk.prefill.paged_prefill(torch.randn(3, 3, 16), pb.kv, pb.block_tables, cu_seqlens([3]), pb.seq_lens, 1.0)
    with pytest.raises(ShapeError, match="pool dtype"):
        tk.write.kv_write(torch.randn(1, 2, 16).half(), torch.randn(1, 2, 16).half(), pb.kv, torch.tensor([0]))



# ---- fused decoder kernels: rms_norm, rope_kv_write, silu_mul


def _rows_close(got, want, dtype):
    """Within the tolerance and, in fp16, rounded in HF's order: a kernel that kept the fp32 value
    and rounded once at the end would differ from the reference in about a quarter of the
    elements, one in the fp32 sum or exp only in a few per ten thousand."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    if dtype == torch.float16 and want.numel():
        differ = (got != want).float().mean().item()
        assert differ <= 0.01, f"{differ:.1%} of the elements differ from the reference's rounding"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h", [96, 128, 1000])
def test_rms_norm_matches_reference(tk, dtype, h):
    g = torch.Generator().manual_seed(h)
    x = (3 * torch.randn(6, h, generator=g)).to(dtype)
    w = (1 + 0.2 * torch.randn(h, generator=g)).to(dtype)
    attn = torch.randn(6, h, generator=g).to(dtype)
    _rows_close(tk.norm.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)
    got, got_sum = tk.norm.rms_norm(attn, w, 1e-5, residual=x)
    want, want_sum = ref.rms_norm(attn, w, 1e-5, residual=x)
    assert torch.equal(got_sum, want_sum)  # one fp32 add rounded to the dtype, as torch's
    _rows_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_strided_views_and_leading_dims(tk, dtype):
    g = torch.Generator().manual_seed(1)
    w = (1 + 0.2 * torch.randn(64, generator=g)).to(dtype)
    qkv = torch.randn(5, (8 + 2 + 2) * 64, generator=g).to(dtype)
    q = qkv[:, : 8 * 64].view(5, 8, 64)                  # Qwen3 q_norm input: rows 768 apart
    k = qkv[:, 8 * 64 : 10 * 64].view(5, 2, 64)
    base = torch.randn(4, 3, 2, 64, generator=g).to(dtype)
    cases = [
        (q, None), (k, None),
        (base[:, 0, 0], None),                           # [4, 64], rows 384 apart
        (base[0, 0, 0], None),                           # one row [64]
        (base.transpose(0, 1), None),                    # 4-D whose leading dims cannot merge
        (q, torch.randn(5, 8, 64, generator=g).to(dtype)),
        (base.transpose(0, 1), torch.randn(3, 4, 2, 64, generator=g).to(dtype)),  # x strided, residual not
    ]
    for x, residual in cases:
        got, want = tk.norm.rms_norm(x, w, 1e-6, residual), ref.rms_norm(x, w, 1e-6, residual)
        if residual is None:
            assert got.is_contiguous()
            _rows_close(got, want, dtype)
        else:
            assert torch.equal(got[1], want[1])
            _rows_close(got[0], want[0], dtype)


def test_rms_norm_row_layouts_fit_the_grid(tk):
    # rows (a, b) of [A, B, H] are grid axes 0 and 1; CUDA caps axis 1 at 65535, so a larger B is
    # folded into A (too many rows for the interpreter to run, so only the layout is checked)
    x = torch.empty(2, 65540, 8)[:, :, :4]
    t, (a, b), strides = tk.norm._as_rows(x)
    assert (a, b) == (2 * 65540, 1) and tuple(t.shape) == (2 * 65540, 4)
    assert t.data_ptr() == x.data_ptr() and strides == (8, 0, 1)    # merged as a view, rows 8 apart
    q = torch.empty(3, 40 * 64)[:, : 32 * 64].view(3, 32, 64)       # strided heads keep their view
    t, (a, b), strides = tk.norm._as_rows(q)
    assert t.data_ptr() == q.data_ptr() and (a, b) == (3, 32) and strides == (40 * 64, 64, 1)


def _rope_case(tk, tokens, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    angles = torch.randint(0, 100_000, (tokens, 1), generator=g).float() * torch.rand(1, d // 2, generator=g)
    angles = torch.cat((angles, angles), dim=-1)                   # [T, D], the HF layout
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    pool = torch.randn(2, 5, 2, 4, hkv, d, generator=g).to(dtype)  # [layers, nb, 2, bs, Hkv, D]
    slots = torch.randperm(5 * 4 - 1, generator=g)[:tokens]        # the last slot never a target
    slots[::3] = -1
    want_pool = pool.clone()
    want_q = ref.rope_kv_write(q, k, v, cos, sin, want_pool[1], slots)
    got_q = tk.rope.rope_kv_write(q, k, v, cos, sin, pool[1], slots)
    # each product and sum rounded to the dtype as torch rounds them: bitwise the reference
    assert got_q.is_contiguous() and torch.equal(got_q, want_q)
    assert torch.equal(pool, want_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (32, 8, 128), (6, 3, 80), (4, 4, 32)])
def test_rope_kv_write_bitwise_reference(tk, dtype, hq, hkv, d):
    _rope_case(tk, 7, hq, hkv, d, dtype, seed=hq + d)


def test_rope_kv_write_several_kv_head_tiles(tk):
    # D=512 gives 4-head tiles: 15 query heads in 4 tiles, 5 kv heads in 2, both last tiles partial
    _rope_case(tk, 4, 15, 5, 512, torch.float16, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [1, 1000, 2500])
def test_silu_mul_matches_reference(tk, dtype, inter):
    g = torch.Generator().manual_seed(inter)
    wide = (4 * torch.randn(5, 2 * inter + 3, generator=g)).to(dtype)
    gate_up = wide[:, 1 : 1 + 2 * inter]                           # rows strided by 2I + 3
    got = tk.activation.silu_mul(gate_up)
    assert got.is_contiguous()
    _rows_close(got, ref.silu_mul(gate_up), dtype)


def test_fused_kernels_empty_batch(tk):
    x, w = torch.empty(0, 32), torch.ones(32)
    assert tk.norm.rms_norm(x, w, 1e-6).shape == (0, 32)
    out, s = tk.norm.rms_norm(x, w, 1e-6, residual=x)
    assert out.shape == s.shape == (0, 32)
    assert tk.activation.silu_mul(torch.empty(0, 64)).shape == (0, 32)
    kv = torch.zeros(2, 2, 4, 2, 16)
    empty = torch.empty(0, 2, 16)
    q = tk.rope.rope_kv_write(torch.empty(0, 4, 16), empty, empty, torch.empty(0, 16), torch.empty(0, 16),
                              kv, torch.empty(0, dtype=torch.int64))
    assert q.shape == (0, 4, 16) and not kv.any()


def test_dispatch_env_forces_triton_for_fused_kernels(tk, monkeypatch):
    import tierkv.kernels as K

    monkeypatch.setenv("TIERKV_KERNELS", "triton")
    called = []
    for module, name in ((tk.norm, "rms_norm"), (tk.rope, "rope_kv_write"), (tk.activation, "silu_mul")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    x, w = torch.randn(3, 16), torch.randn(16)
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOL[torch.float32])
    gate_up = torch.randn(3, 32)
    torch.testing.assert_close(K.silu_mul(gate_up), ref.silu_mul(gate_up), **TOL[torch.float32])
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cos, sin = torch.randn(3, 16), torch.randn(3, 16)
    kv, want_kv = torch.zeros(2, 2, 4, 2, 16), torch.zeros(2, 2, 4, 2, 16)
    slots = torch.tensor([5, -1, 0])
    assert torch.equal(K.rope_kv_write(q, k, k, cos, sin, kv, slots), ref.rope_kv_write(q, k, k, cos, sin, want_kv, slots))
    assert torch.equal(kv, want_kv)
    assert called == ["rms_norm", "silu_mul", "rope_kv_write"]


def test_fused_bad_inputs_fail_before_launch(tk):
    from tierkv.errors import ShapeError

    kv = torch.zeros(2, 2, 4, 2, 16)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    with pytest.raises(ShapeError, match=r"cos must be \[T, D\]"):
        tk.rope.rope_kv_write(q, k, k, torch.randn(3, 8), torch.randn(3, 16), kv, torch.tensor([0, 1, 2]))
    assert not kv.any()
    with pytest.raises(ShapeError, match="weight dtype"):
        tk.norm.rms_norm(torch.randn(3, 16).half(), torch.randn(16), 1e-6)
    with pytest.raises(ShapeError, match="odd width"):
        tk.activation.silu_mul(torch.randn(3, 15))


# ---- sampling: top_k_top_p_filter (bisection on the fp32 bit pattern, no sort)


def _filter_rows(vocab: int, seed: int, dtype=torch.float32):
    """Ten rows of every kind: k of 1, 2, mid, V - 1, V, > V and off; p tiny, 1 and between two
    cumulative masses (so the kernel's chunked sums and the reference's cumsum must agree); ties
    everywhere in one row, -inf entries in one, a row all -inf, and +0.0 / -0.0 tied at the top."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1.0, 0.3, 2.0, 4.0, 1.0, 1.0, 1.0, 0.5, 1.0, 2.0])
    logits = torch.randn(len(scales), vocab, generator=g) * scales[:, None]
    logits[4] = (logits[4] * 3).round() / 3                       # ~20 values, each tied many times
    logits[5, torch.randperm(vocab, generator=g)[: vocab // 3]] = float("-inf")
    logits[6] = -logits[6].abs() - 0.1
    logits[6, :9] = torch.tensor([0.0, -0.0] * 4 + [0.0])          # nine zeros lead the row
    logits = logits.to(dtype)
    top_k = torch.tensor([1, 2, vocab // 7, vocab - 1, 5, 3, 2, vocab, vocab + 9, 0])
    top_p = safe_top_p(logits, g)
    top_p[0], top_p[1] = 1e-7, 1.0                                # the top run alone; off
    logits[9] = float("-inf")                                      # nothing to choose from
    return logits, top_k, top_p


def _filter_case(tk, logits, top_k, top_p, alone=True, **launch):
    """Kernel vs reference with both filters, and (alone) with each filter on its own."""
    for k, p in ((top_k, None), (None, top_p), (top_k, top_p))[0 if alone else 2:]:
        got = tk.sampling._top_k_top_p_filter(logits, k, p, **launch)
        want = ref.top_k_top_p_filter(logits, k, p)
        assert got.dtype == logits.dtype and got.shape == logits.shape
        kept = want != float("-inf")
        assert torch.equal(got != float("-inf"), kept), (k is not None, p is not None)
        assert torch.equal(got[kept], want[kept]) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("vocab,block", [(1000, 256), (3001, 512), (5000, 2048)])
def test_top_k_top_p_filter_matches_reference(tk, vocab, block):
    logits, top_k, top_p = _filter_rows(vocab, seed=vocab)
    _filter_case(tk, logits, top_k, top_p, block=block)
    # the cases cut where they should: a lone top token, a tie kept whole, the -0.0 / +0.0 run
    kept = (tk.sampling._top_k_top_p_filter(logits, top_k, None, block=block) != float("-inf")).sum(-1)
    assert kept[0] == 1 and kept[6] == 9 and kept[4] > top_k[4]


def test_top_k_top_p_filter_fp16_ties(tk):
    # fp16 randn repeats values everywhere, so most boundaries fall inside a tie
    logits, top_k, top_p = _filter_rows(2048, seed=7, dtype=torch.float16)
    _filter_case(tk, logits, top_k, top_p, block=1024)


def test_top_k_top_p_filter_strided_rows(tk):
    logits, top_k, top_p = _filter_rows(700, seed=3)
    wide = torch.full((10, 737), 50.0)          # the columns past 700 would win any filter
    wide[:, :700] = logits
    _filter_case(tk, wide[:, :700], top_k, top_p, alone=False, block=256)
    # a column-major copy has unit stride down the batch, not along the row
    _filter_case(tk, logits.t().contiguous().t(), top_k.int(), top_p, alone=False, block=256)


def test_top_k_top_p_filter_dispatch_and_sampler(tk, monkeypatch):
    import tierkv.kernels as K
    from tierkv.engine.sampler import Sampler, SamplingBatch, SamplingParams

    monkeypatch.setenv("TIERKV_KERNELS", "triton")
    called = []
    real = tk.sampling.top_k_top_p_filter
    monkeypatch.setattr(tk.sampling, "top_k_top_p_filter", lambda *a: called.append(1) or real(*a))
    logits, top_k, top_p = _filter_rows(300, seed=11)
    assert torch.equal(K.top_k_top_p_filter(logits, top_k, top_p), ref.top_k_top_p_filter(logits, top_k, top_p))
    # the sampler filters through the kernel: every draw lands in the reference's kept set
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(16, 300, generator=g) * 2
    params = [SamplingParams(top_k=int(k), top_p=float(p))
              for k, p in zip(torch.randint(2, 40, (16,), generator=g), torch.rand(16, generator=g) * 0.9 + 0.05)]
    batch = SamplingBatch.build(params, 300, "cpu")
    tokens = Sampler()(logits, batch).token_ids
    kept = ref.top_k_top_p_filter(logits, batch.top_k, batch.top_p) != float("-inf")
    assert kept.gather(1, tokens[:, None]).all() and called == [1, 1]


if not INTERPRETED:
    # the parent run only launches the child; the cases above run there, under the interpreter
    for _name in [n for n in list(globals()) if n.startswith("test_") and n != "test_triton_kernels_under_interpreter"]:
        del globals()[_name]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (14, 2, 64), (16, 16, 128), (8, 1, 256)])
def test_compiled_variants_cover_every_launch_serving_can_pick(heads, kv_heads, head_dim):
    # compile_variants compiles launch_variants(); any launch choose_launch picks for a real batch
    # must be one of them, or a server would stall mid-run compiling it
    import random

    from tierkv.kernels import prefill

    dev = torch.device("cpu")
    compiled = {(v.block_m, v.block_n, v.num_warps, v.pack, v.num_splits == 1)
                for v in prefill.launch_variants(heads, kv_heads, head_dim, dev)}
    rng = random.Random(0)
    for _ in range(2000):
        num_seqs = rng.choice([1, 2, 3, 7, 16, 64, 200])
        tokens = num_seqs * rng.choice([1, 2, 3, 5, 16, 31, 40, 70, 100, 200, 900, 3000]) + rng.randrange(num_seqs)
        context = rng.choice([0, 100, 5000, 120_000])
        launch = prefill.choose_launch(tokens, num_seqs, heads, kv_heads, tokens // num_seqs + context, head_dim, dev)
        key = (launch.block_m, launch.block_n, launch.num_warps, launch.pack, launch.num_splits == 1)
        assert key in compiled, (tokens, num_seqs, context, launch)
