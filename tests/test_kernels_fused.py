"""The fused decoder kernels' torch reference (CPU) against transformers' formulas.

rms_norm, rope_kv_write and silu_mul stand in for the decoder's RMSNorm, RoPE + kv_write and
F.silu(gate) * up. The CPU engine is held token-for-token equal to transformers, so the reference
must equal those formulas, written out below as transformers (and model.py before the fused
kernels) has them, bitwise (torch.equal), in fp32 and bf16, on the strided views the decoder hands
it (q/k/v split from one qkv GEMM output); and transformers' own modules where it is installed.
Bad inputs raise a ShapeError that names the argument, before anything is written.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import tierkv.kernels as K
from tierkv.engine.model_config import ModelConfig
from tierkv.engine.rope import rope_inv_freq
from tierkv.kernels import ShapeError
from tierkv.kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16]


class RMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, line for line."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma3RMSNorm, line for line: scales by (1 + weight) in fp32, then casts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q, k: x [T, H, D], cos, sin [T, 1, D]."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _norm_module(h: int, eps: float, dtype: torch.dtype, g: torch.Generator, cls=RMSNorm) -> RMSNorm:
    norm = cls(h, eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(h, generator=g))  # not all ones: the multiply rounds
    return norm.to(dtype)


def _qkv(tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator, scale: float = 1.0):
    """q [T, Hq, D], k, v [T, Hkv, D] as model.Attention makes them: strided views of one GEMM output."""
    qkv = (scale * torch.randn(tokens, (hq + 2 * hkv) * d, generator=g)).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)


def _cos_sin(tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator):
    """cos, sin [T, D] for random positions up to 128K, computed as CausalLM.rope does."""
    cfg = ModelConfig("llama", 16, hq * d, 16, 1, hq, hkv, d, rope_theta=500000.0)
    positions = torch.randint(0, 131072, (tokens,), generator=g)
    freqs = positions[:, None].float() * rope_inv_freq(cfg)[None, :]   # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                             # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


# ---------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,eps", [(64, 1e-6), (96, 1e-5), (4096, 1e-5)])
def test_rms_norm_equals_hf_rmsnorm(dtype, h, eps):
    g = torch.Generator().manual_seed(h)
    norm = _norm_module(h, eps, dtype, g)
    x = (3 * torch.randn(9, h, generator=g)).to(dtype)
    with torch.no_grad():
        want = norm(x)
    got = ref.rms_norm(x, norm.weight.detach(), eps)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)


def test_rms_norm_rounding_order_is_visible_in_bf16():
    # rounding the normalised value to bf16 before the weight (HF) must differ from one rounding at
    # the end for these inputs, else the equality tests above could not tell the two orders apart
    g = torch.Generator().manual_seed(1)
    norm = _norm_module(256, 1e-6, torch.bfloat16, g)
    x = torch.randn(16, 256, generator=g).to(torch.bfloat16)
    w = norm.weight.detach()
    got = ref.rms_norm(x, w, 1e-6)
    x32 = x.float()
    once = (w.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert not torch.equal(got, once)
    with torch.no_grad():
        assert torch.equal(got, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_head_views(dtype):
    # Qwen3's q_norm/k_norm: RMSNorm over each head's D features of the strided q and k views
    g = torch.Generator().manual_seed(2)
    q, k, _ = _qkv(7, 8, 2, 64, dtype, g, scale=2.0)
    assert not q.is_contiguous() and not k.is_contiguous()
    q_norm, k_norm = _norm_module(64, 1e-6, dtype, g), _norm_module(64, 1e-6, dtype, g)
    with torch.no_grad():
        want_q, want_k = q_norm(q), k_norm(k)
    assert torch.equal(ref.rms_norm(q, q_norm.weight.detach(), 1e-6), want_q)
    assert torch.equal(ref.rms_norm(k, k_norm.weight.detach(), 1e-6), want_k)


@pytest.mark.parametrize("shape", [(32,), (2, 3, 5, 32)])
def test_rms_norm_any_leading_dims(shape):
    g = torch.Generator().manual_seed(3)
    norm = _norm_module(32, 1e-5, torch.bfloat16, g)
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ref.rms_norm(x, norm.weight.detach(), 1e-5), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_is_the_decoder_add_then_norm(dtype):
    # DecoderLayer: x = x + attn(...); h = post_attention_layernorm(x). The fused call is
    # rms_norm(attn_out, w, eps, residual=x) -> (h, new x).
    g = torch.Generator().manual_seed(4)
    norm = _norm_module(128, 1e-6, dtype, g)
    stream = (4 * torch.randn(11, 128, generator=g)).to(dtype)
    attn_out = torch.randn(11, 128, generator=g).to(dtype)
    with torch.no_grad():
        want_sum = stream + attn_out
        want = norm(want_sum)
    got, got_sum = ref.rms_norm(attn_out, norm.weight.detach(), 1e-6, residual=stream)
    assert got_sum.dtype == dtype and torch.equal(got_sum, want_sum)
    assert torch.equal(got, want)
    if dtype == torch.bfloat16:  # the sum is rounded to bf16 before the norm, not kept in fp32
        assert not torch.equal(got_sum.float(), stream.float() + attn_out.float())


def test_rms_norm_does_not_write_its_inputs():
    g = torch.Generator().manual_seed(5)
    x, r, w = torch.randn(3, 16, 16, generator=g).to(torch.bfloat16)
    before = (x.clone(), r.clone())
    out, s = ref.rms_norm(x, w[0], 1e-6, residual=r)
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])
    assert out.data_ptr() not in (x.data_ptr(), r.data_ptr()) and s.data_ptr() not in (x.data_ptr(), r.data_ptr())


# ---------------------------------------------------------------- rope_kv_write


def _pool_after(kv: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """What kv [nb, 2, bs, Hkv, D] must hold after writing token t's k_rot/v at slots[t] (-1 = none)."""
    want = kv.clone()
    bs = kv.shape[2]
    for t, slot in enumerate(slots):
        if slot >= 0:
            want[slot // bs, 0, slot % bs] = k_rot[t]
            want[slot // bs, 1, slot % bs] = v[t]
    return want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (32, 8, 128), (6, 3, 80)])
def test_rope_kv_write_equals_rotate_then_kv_write(dtype, hq, hkv, d):
    g = torch.Generator().manual_seed(hq + d)
    tokens, nb, bs = 13, 6, 4
    q, k, v = _qkv(tokens, hq, hkv, d, dtype, g)
    cos, sin = _cos_sin(tokens, hq, hkv, d, dtype, g)
    # shuffled slots, two padding tokens; the pool's last slot is never a target, so a -1 that
    # wrapped around to it would show
    slots = torch.randperm(nb * bs - 1, generator=g)[:tokens]
    slots[[2, 9]] = -1
    kv = torch.randn(nb, 2, bs, hkv, d, generator=g).to(dtype)
    want_kv = _pool_after(kv, rotate(k, cos[:, None], sin[:, None]), v, slots.tolist())
    want_q = rotate(q, cos[:, None], sin[:, None])
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    got_q = ref.rope_kv_write(q, k, v, cos, sin, kv, slots)
    assert got_q.shape == (tokens, hq, d) and got_q.dtype == dtype
    assert torch.equal(got_q, want_q)
    assert torch.equal(kv, want_kv)
    assert torch.equal(q, q_before) and torch.equal(k, k_before) and torch.equal(v, v_before)


def test_rope_kv_write_into_a_layer_view_touches_only_that_layer():
    g = torch.Generator().manual_seed(6)
    q, k, v = _qkv(5, 4, 2, 32, torch.bfloat16, g)
    cos, sin = _cos_sin(5, 4, 2, 32, torch.bfloat16, g)
    pool = torch.randn(3, 4, 2, 8, 2, 32, generator=g).to(torch.bfloat16)   # [layers, nb, 2, bs, h, d]
    slots = torch.tensor([30, 0, -1, 17, 9], dtype=torch.int32)
    want = pool.clone()
    want[1] = _pool_after(pool[1], rotate(k, cos[:, None], sin[:, None]), v, slots.tolist())
    ref.rope_kv_write(q, k, v, cos, sin, pool[1], slots)
    assert torch.equal(pool, want)


def test_rope_kv_write_all_tokens_skipped_still_rotates_q():
    g = torch.Generator().manual_seed(7)
    q, k, v = _qkv(3, 4, 1, 16, torch.float32, g)
    cos, sin = _cos_sin(3, 4, 1, 16, torch.float32, g)
    kv = torch.randn(2, 2, 4, 1, 16, generator=g)
    before = kv.clone()
    got = ref.rope_kv_write(q, k, v, cos, sin, kv, torch.full((3,), -1))
    assert torch.equal(kv, before)
    assert torch.equal(got, rotate(q, cos[:, None], sin[:, None]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (32, 4, 128), (6, 3, 80)])
@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_rope_kv_write_with_qk_norm_equals_norm_then_rotate(dtype, hq, hkv, d, norm_cls):
    # Qwen3 (RMSNorm) and Gemma 3 (unit offset): each q and k head normalised over D, then rotated;
    # v never normalised
    g = torch.Generator().manual_seed(hq + d)
    tokens, nb, bs, eps = 9, 4, 4, 1e-6
    q, k, v = _qkv(tokens, hq, hkv, d, dtype, g, scale=3.0)
    cos, sin = _cos_sin(tokens, hq, hkv, d, dtype, g)
    q_norm, k_norm = _norm_module(d, eps, dtype, g, norm_cls), _norm_module(d, eps, dtype, g, norm_cls)
    slots = torch.randperm(nb * bs - 1, generator=g)[:tokens]
    slots[[1, 6]] = -1
    kv = torch.randn(nb, 2, bs, hkv, d, generator=g).to(dtype)
    with torch.no_grad():
        want_q = rotate(q_norm(q), cos[:, None], sin[:, None])
        want_kv = _pool_after(kv, rotate(k_norm(k), cos[:, None], sin[:, None]), v, slots.tolist())
    before = q.clone(), k.clone(), v.clone()
    norms = dict(q_norm=q_norm.weight.detach(), k_norm=k_norm.weight.detach(), eps=eps,
                 unit_offset=norm_cls is GemmaRMSNorm)
    plain_kv = kv.clone()
    got_q = ref.rope_kv_write(q, k, v, cos, sin, kv, slots, **norms)
    assert torch.equal(got_q, want_q)
    assert torch.equal(kv, want_kv)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before))
    # the norms did something, and the package entry (the CPU engine's call) passes them through
    assert not torch.equal(got_q, ref.rope_kv_write(q, k, v, cos, sin, plain_kv, slots))
    assert torch.equal(K.rope_kv_write(q, k, v, cos, sin, plain_kv, slots, **norms), want_q)
    assert torch.equal(plain_kv, want_kv)


# ---------------------------------------------------------------- silu_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1, 96, 1500])
def test_silu_mul_equals_mlp_formula(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    # a column slice of a wider tensor: rows are strided, as from a GEMM with padded output
    wide = (4 * torch.randn(6, 2 * inter + 5, generator=g)).to(dtype)
    gate_up = wide[:, 3 : 3 + 2 * inter]
    assert not gate_up.is_contiguous()
    gate, up = gate_up.split([inter, inter], dim=-1)
    got = ref.silu_mul(gate_up)
    assert got.shape == (6, inter) and got.dtype == dtype
    assert torch.equal(got, F.silu(gate) * up)


def test_silu_mul_rounds_silu_before_the_product_in_bf16():
    # HF rounds silu(gate) to bf16 before `* up`; for these inputs that differs from one rounding
    g = torch.Generator().manual_seed(8)
    gate_up = (3 * torch.randn(8, 512, generator=g)).to(torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    once = (F.silu(gate) * up).to(torch.bfloat16)
    assert not torch.equal(ref.silu_mul(gate_up), once)


# ---------------------------------------------------------------- against transformers itself


def test_reference_equals_transformers_llama_ops():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(9)
    dtype, hq, hkv, d = torch.bfloat16, 8, 2, 64
    hf_norm = modeling.LlamaRMSNorm(256, eps=1e-5)
    with torch.no_grad():
        hf_norm.weight.copy_(1 + 0.2 * torch.randn(256, generator=g))
    hf_norm = hf_norm.to(dtype)
    x = (2 * torch.randn(10, 256, generator=g)).to(dtype)
    with torch.no_grad():
        assert torch.equal(ref.rms_norm(x, hf_norm.weight.detach(), 1e-5), hf_norm(x))

    q, k, v = _qkv(10, hq, hkv, d, dtype, g)
    cos, sin = _cos_sin(10, hq, hkv, d, dtype, g)
    want_q, want_k = modeling.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)   # T as batch
    kv = torch.zeros(4, 2, 4, hkv, d, dtype=dtype)
    slots = torch.arange(10)
    assert torch.equal(ref.rope_kv_write(q, k, v, cos, sin, kv, slots), want_q)
    assert torch.equal(kv[:, 0].reshape(16, hkv, d)[:10], want_k)

    gate_up = (3 * torch.randn(10, 2 * 300, generator=g)).to(dtype)
    gate, up = gate_up.split([300, 300], dim=-1)
    assert torch.equal(ref.silu_mul(gate_up), ACT2FN["silu"](gate) * up)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_reference_qk_norm_equals_transformers(family):
    # the q_norm / k_norm of Qwen3Attention / Gemma3Attention, then apply_rotary_pos_emb
    modeling = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    norm_cls = modeling.Qwen3RMSNorm if family == "qwen3" else modeling.Gemma3RMSNorm
    g = torch.Generator().manual_seed(12)
    dtype, hq, hkv, d, eps = torch.bfloat16, 8, 2, 64, 1e-6
    hf_q, hf_k = norm_cls(d, eps=eps), norm_cls(d, eps=eps)
    with torch.no_grad():
        for norm in (hf_q, hf_k):
            norm.weight.copy_(0.5 * torch.randn(d, generator=g))
    hf_q, hf_k = hf_q.to(dtype), hf_k.to(dtype)
    q, k, v = _qkv(10, hq, hkv, d, dtype, g, scale=2.0)
    cos, sin = _cos_sin(10, hq, hkv, d, dtype, g)
    with torch.no_grad():
        want_q, want_k = modeling.apply_rotary_pos_emb(hf_q(q), hf_k(k), cos, sin, unsqueeze_dim=1)
    kv = torch.zeros(4, 2, 4, hkv, d, dtype=dtype)
    got_q = ref.rope_kv_write(q, k, v, cos, sin, kv, torch.arange(10), q_norm=hf_q.weight.detach(),
                              k_norm=hf_k.weight.detach(), eps=eps, unit_offset=family == "gemma3")
    assert torch.equal(got_q, want_q)
    assert torch.equal(kv[:, 0].reshape(16, hkv, d)[:10], want_k)
    assert torch.equal(kv[:, 1].reshape(16, hkv, d)[:10], v)


# ---------------------------------------------------------------- dispatch and bad inputs


def test_package_serves_cpu_from_the_reference():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(4, 32, generator=g).to(torch.bfloat16)
    w = torch.randn(32, generator=g).to(torch.bfloat16)
    assert K.backend_for(x) == "reference"
    assert torch.equal(K.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    out, s = K.rms_norm(x, w, 1e-6, residual=x)
    assert torch.equal(s, x + x) and torch.equal(out, ref.rms_norm(x + x, w, 1e-6))
    gate_up = torch.randn(4, 64, generator=g)
    assert torch.equal(K.silu_mul(gate_up), ref.silu_mul(gate_up))
    q, k, v = _qkv(4, 4, 2, 16, torch.float32, g)
    cos, sin = _cos_sin(4, 4, 2, 16, torch.float32, g)
    kv, want_kv = torch.zeros(2, 2, 4, 2, 16), torch.zeros(2, 2, 4, 2, 16)
    slots = torch.tensor([3, 0, -1, 5])
    assert torch.equal(K.rope_kv_write(q, k, v, cos, sin, kv, slots), ref.rope_kv_write(q, k, v, cos, sin, want_kv, slots))
    assert torch.equal(kv, want_kv)


@pytest.mark.parametrize("name", ["rms_norm", "rope_kv_write", "silu_mul"])
def test_every_fused_kernel_has_a_triton_home(name):
    pytest.importorskip("triton")
    assert name in K.__all__
    module = importlib.import_module(f"tierkv.kernels.{K._TRITON_HOME[name]}")
    assert callable(getattr(module, name))


def test_no_triton_module_hides_a_public_kernel():
    # Importing package.sub sets the package's attribute `sub`: a Triton module named like a
    # public entry (kernels/linear.py for kernels.linear) replaced the function with the module on
    # the first CUDA call, and every engine on a GPU then failed ("'module' object is not callable").
    pytest.importorskip("triton")
    for home in set(K._TRITON_HOME.values()):
        importlib.import_module(f"tierkv.kernels.{home}")
    hidden = [name for name in K.__all__ if not callable(getattr(K, name)) or isinstance(getattr(K, name), type(K))]
    assert not hidden, f"tierkv.kernels names that are modules, not functions: {hidden}"


def _bad_rms_norm():
    x = torch.randn(3, 8).to(torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    return [
        (lambda: ref.rms_norm(x, torch.ones(6, dtype=torch.bfloat16), 1e-6), r"weight has 6 features but x is \[\.\.\., 8\]"),
        (lambda: ref.rms_norm(x, torch.ones(8), 1e-6), "weight dtype torch.float32 must equal x dtype torch.bfloat16"),
        (lambda: ref.rms_norm(x, w, torch.tensor(1e-6)), "eps must be a non-negative Python float"),
        (lambda: ref.rms_norm(x, w, -1.0), "eps must be"),
        (lambda: ref.rms_norm(x.long(), w, 1e-6), "x has dtype torch.int64"),
        (lambda: ref.rms_norm([1.0] * 8, w, 1e-6), "x must be a tensor"),
        (lambda: ref.rms_norm(x, w, 1e-6, residual=torch.randn(3, 8)), "residual has dtype torch.float32"),
        (lambda: ref.rms_norm(x, w, 1e-6, residual=x[:2]), r"residual shape \(2, 8\) must equal x shape \(3, 8\)"),
        (lambda: ref.rms_norm(x, w, 1e-6, residual=x[None]), "residual must have 2 dims"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_rms_norm())))
def test_rms_norm_bad_inputs(case):
    call, message = _bad_rms_norm()[case]
    with pytest.raises(ShapeError, match=message):
        call()


def _bad_rope():
    """(kwargs overrides of a good call, message); the good call is 3 tokens, Hq 4, Hkv 2, D 16."""
    g = torch.Generator().manual_seed(11)
    q, k, v = _qkv(3, 4, 2, 16, torch.float16, g)
    cos, sin = _cos_sin(3, 4, 2, 16, torch.float16, g)
    good = dict(q=q, k=k, v=v, cos=cos, sin=sin, kv=torch.zeros(2, 2, 4, 2, 16, dtype=torch.float16),
                slot_mapping=torch.tensor([0, 1, 2]))
    odd_q, odd_k, odd_v = _qkv(3, 4, 2, 15, torch.float16, g)
    w = torch.ones(16, dtype=torch.float16)
    return good, [
        (dict(cos=cos[:, :8]), r"cos must be \[T, D\] = \[3, 16\]"),
        (dict(sin=sin[:2]), r"sin must be \[T, D\] = \[3, 16\]"),
        (dict(cos=cos[:, None]), "cos must have 2 dims"),
        (dict(sin=sin.float()), "sin dtype torch.float32 must equal q dtype torch.float16"),
        (dict(q=q[:2]), "q has 2 tokens but k/v have 3"),
        (dict(q=q[..., :8]), "q head_dim 8 != k/v head_dim 16"),
        (dict(q=q.float()), "q dtype torch.float32 must equal the pool dtype"),
        (dict(k=k.float(), v=v.float()), "must equal the pool dtype"),
        (dict(v=v[:, :1]), "k and v must have one shape"),
        (dict(slot_mapping=torch.tensor([0, 1])), "slot_mapping has 2 entries for 3 tokens"),
        (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "slot_mapping has dtype torch.float32"),
        (dict(q=odd_q, k=odd_k, v=odd_v, kv=torch.zeros(2, 2, 4, 2, 15, dtype=torch.float16)), "head_dim must be even"),
        (dict(q_norm=w), "q_norm and k_norm go together: got q_norm without k_norm"),
        (dict(k_norm=w), "q_norm and k_norm go together: got k_norm without q_norm"),
        (dict(q_norm=w[:8], k_norm=w), r"q_norm must be \[D\] = \[16\] \(one weight per head feature\), got \(8,\)"),
        (dict(q_norm=w, k_norm=w[None]), r"k_norm must be \[D\] = \[16\]"),
        (dict(q_norm=w, k_norm=w.float()), "k_norm dtype torch.float32 must equal q dtype torch.float16"),
        (dict(q_norm=w, k_norm=w, eps=-1.0), "eps must be a non-negative Python float"),
        (dict(q_norm=w, k_norm=w, eps=torch.tensor(1e-6)), "eps must be a non-negative Python float"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_rope()[1])))
def test_rope_kv_write_bad_inputs_fail_before_writing(case):
    good, cases = _bad_rope()
    overrides, message = cases[case]
    args = {**good, **overrides}
    before = args["kv"].clone()
    with pytest.raises(ShapeError, match=message):
        ref.rope_kv_write(**args)
    assert torch.equal(args["kv"], before)


@pytest.mark.parametrize("gate_up,message", [
    (torch.randn(4, 7), "odd width 7"),
    (torch.randn(2, 4, 8), "gate_up must have 2 dims"),
    (torch.ones(4, 8, dtype=torch.int32), "gate_up has dtype torch.int32"),
])
def test_silu_mul_bad_inputs(gate_up, message):
    with pytest.raises(ShapeError, match=message):
        ref.silu_mul(gate_up)
