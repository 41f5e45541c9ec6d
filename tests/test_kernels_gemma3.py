"""Gemma 3's kernel variants: rms_norm(unit_offset=True), the (1 + w) norm, and gelu_tanh_mul, the
GeGLU. The reference equals transformers' Gemma3RMSNorm and Gemma3MLP activation bit for bit; the
Triton kernels equal the reference under the interpreter (fp32, fp16: interpreted.py) and, in
bf16 on the GPU (`gpu` marker, for the H200), round like it almost everywhere.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, TOL, in_child, kernel_modules, leave_only_the_child_run

from tierkv.kernels import reference as ref

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, most: float = 0.01) -> None:
    """Within the dtype's tolerance, and rounded as the reference rounds for all but `most`."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    tol = TOL.get(dtype, dict(rtol=1.6e-2, atol=1.6e-2))
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if dtype != torch.float32 and want.numel():
        differ = (got != want).float().mean().item()
        assert differ <= most, f"{differ:.1%} of the elements differ from the reference's rounding"


def _gelu_close(got: torch.Tensor, want: torch.Tensor, gate_up: torch.Tensor, dtype: torch.dtype) -> None:
    """_close, the rounding compared where gate > -2: below, torch's 1 + tanh(y) cancels and its
    last bits are noise (the kernel's g * sigmoid(2y) keeps them)."""
    torch.testing.assert_close(got.float(), want.float(), **TOL.get(dtype, dict(rtol=1.6e-2, atol=1.6e-2)))
    kept = gate_up[:, : gate_up.shape[1] // 2] > -2
    _close(got[kept].contiguous(), want[kept].contiguous(), dtype)


def _norm_case(dtype: torch.dtype, rows: int, h: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wide = (3 * torch.randn(rows, h + 5, generator=g)).to(dtype).to(device)
    x = wide[:, 2 : 2 + h]  # rows strided, as q/k heads of the qkv GEMM are
    attn = torch.randn(rows, h, generator=g).to(dtype).to(device)
    w = (0.5 * torch.randn(h, generator=g)).to(dtype).to(device)  # Gemma's weights sit around 0
    return x, attn, w


def _gate_up(dtype: torch.dtype, tokens: int, inter: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    wide = 4 * torch.randn(tokens, 2 * inter + 3, generator=g)
    if inter >= 8:  # gates where tanh saturates both ways, and around 0
        wide[0, 1:9] = torch.tensor([-60.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 20.0, 60.0])
    return wide.to(dtype).to(device)[:, 1 : 1 + 2 * inter]  # rows strided by 2I + 3


# ---- Triton under the interpreter (run in a child process in a normal run)


@pytest.fixture(scope="module")
def tk():
    pytest.importorskip("triton")
    return kernel_modules("norm", "activation")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h", [32, 1000])
def test_unit_offset_rms_norm_matches_reference(tk, dtype, h):
    x, attn, w = _norm_case(dtype, 6, h, seed=h)
    _close(tk.norm.rms_norm(x, w, 1e-6, unit_offset=True), ref.rms_norm(x, w, 1e-6, unit_offset=True), dtype)
    got, got_sum = tk.norm.rms_norm(attn, w, 1e-6, residual=x, unit_offset=True)
    want, want_sum = ref.rms_norm(attn, w, 1e-6, residual=x, unit_offset=True)
    assert torch.equal(got_sum, want_sum)
    _close(got, want, dtype)
    # and it is another norm than Llama's, not the same kernel path
    assert not torch.allclose(got.float(), tk.norm.rms_norm(attn, w, 1e-6, residual=x)[0].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [1, 1000, 2500])
def test_gelu_tanh_mul_matches_reference(tk, dtype, inter):
    gate_up = _gate_up(dtype, 5, inter, seed=inter)
    _gelu_close(tk.activation.gelu_tanh_mul(gate_up), ref.gelu_tanh_mul(gate_up), gate_up, dtype)
    assert tk.activation.gelu_tanh_mul(torch.empty(0, 2 * inter, dtype=dtype)).shape == (0, inter)


leave_only_the_child_run(globals())


# ---- the reference against transformers' Gemma 3 modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_gemma3_rmsnorm(dtype):
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    x, attn, w = _norm_case(dtype, 7, 96)
    norm = gemma3.Gemma3RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        assert torch.equal(ref.rms_norm(x, w, 1e-6, unit_offset=True), norm(x))
        out, total = ref.rms_norm(attn, w, 1e-6, residual=x, unit_offset=True)
        assert torch.equal(total, x + attn) and torch.equal(out, norm(x + attn))
        heads = x.view(7, 3, 32)  # q_norm over each head of a strided row
        head_norm = gemma3.Gemma3RMSNorm(32, eps=1e-6).to(dtype)
        head_norm.weight.copy_(w[:32])
        assert torch.equal(ref.rms_norm(heads, w[:32], 1e-6, unit_offset=True), head_norm(heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_gelu_pytorch_tanh(dtype):
    activations = pytest.importorskip("transformers.activations")
    gate_up = _gate_up(dtype, 5, 300)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ref.gelu_tanh_mul(gate_up), activations.ACT2FN["gelu_pytorch_tanh"](gate) * up)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma3_kernels_on_gpu_round_like_the_reference(dtype):
    """Gemma-3-4B sizes: hidden 2560, heads of 256, intermediate 10240, up to 8192 tokens."""
    from tierkv.kernels import activation, norm

    for rows, h in ((1, 2560), (8192, 2560), (8192 * 8, 256)):
        x, attn, w = _norm_case(dtype, rows, h, device="cuda", seed=rows)
        _close(norm.rms_norm(x, w, 1e-6, unit_offset=True), ref.rms_norm(x, w, 1e-6, unit_offset=True), dtype)
        got, got_sum = norm.rms_norm(attn, w, 1e-6, residual=x, unit_offset=True)
        want, want_sum = ref.rms_norm(attn, w, 1e-6, residual=x, unit_offset=True)
        assert torch.equal(got_sum, want_sum)
        _close(got, want, dtype)
    for tokens in (1, 8192):
        gate_up = _gate_up(dtype, tokens, 10240, device="cuda", seed=tokens)
        _gelu_close(activation.gelu_tanh_mul(gate_up), ref.gelu_tanh_mul(gate_up), gate_up, dtype)
