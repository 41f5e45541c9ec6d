"""The fused decoder kernels (rms_norm, rope_kv_write, silu_mul) and the sampler's
top_k_top_p_filter against the torch reference, run on CPU by the Triton interpreter (see
interpreted.py: in a normal run this file's one test runs it again in a child process).
"""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, TOL, in_child, kernel_modules, leave_only_the_child_run

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)


pytest.importorskip("triton")
from sampling_cases import safe_top_p  # noqa: E402

from tierkv.kernels import reference as ref  # noqa: E402


@pytest.fixture(scope="module")
def tk():
    return kernel_modules("norm", "rope", "activation", "sampling")


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


def _qk_norm_case(tk, tokens, hq, hkv, d, dtype, unit_offset, exact, seed=0):
    """rope_kv_write with q_norm / k_norm, kernel against reference: bitwise where `exact`, else
    within _rows_close. exact: q and k are multiples of 1/8 in [-4, 4], so every sum of squares
    over a head is exact in fp32 whatever the order of the adds; the reference (torch) and the
    kernel sum in different orders, which on other inputs moves the fp32 sum by an ulp or so."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randint(-32, 33, (tokens, (hq + 2 * hkv) * d), generator=g) / 8 if exact \
        else 3 * torch.randn(tokens, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv.to(dtype).split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    angles = torch.randint(0, 100_000, (tokens, 1), generator=g).float() * torch.rand(1, d // 2, generator=g)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_norm, k_norm = ((1 + 0.3 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
    pool = torch.randn(2, 5, 2, 4, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(5 * 4 - 1, generator=g)[:tokens]
    slots[1::3] = -1
    norms = (q_norm, k_norm, 1e-6, unit_offset)
    want_pool = pool.clone()
    want_q = ref.rope_kv_write(q, k, v, cos, sin, want_pool[1], slots, *norms)
    got_q = tk.rope.rope_kv_write(q, k, v, cos, sin, pool[1], slots, *norms)
    assert got_q.is_contiguous()
    assert torch.equal(pool[0], want_pool[0]) and torch.equal(pool[1, :, 1], want_pool[1, :, 1])  # v as is
    if exact:
        assert torch.equal(got_q, want_q) and torch.equal(pool, want_pool)
    else:
        _rows_close(got_q, want_q, dtype)
        _rows_close(pool[1, :, 0], want_pool[1, :, 0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (6, 3, 80)])
def test_rope_kv_write_qk_norm_bitwise_reference_on_exact_sums(tk, dtype, unit_offset, hq, hkv, d):
    # with the sum exact, the rsqrt, HF's roundings, the weight (or 1 + weight) and the rotation
    # are left: all must be bitwise the reference's
    _qk_norm_case(tk, 5, hq, hkv, d, dtype, unit_offset, exact=True, seed=hq + d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rope_kv_write_qk_norm_matches_reference(tk, dtype, unit_offset):
    _qk_norm_case(tk, 5, 32, 4, 128, dtype, unit_offset, exact=False, seed=5)


def test_rope_kv_write_qk_norm_several_tiles(tk):
    # D=512: 4-head tiles, the last q and k tiles partial; their unused rows must not be stored
    _qk_norm_case(tk, 3, 15, 5, 512, torch.float16, False, exact=True, seed=9)


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
    from tierkv.kernels import ShapeError

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


leave_only_the_child_run(globals())
