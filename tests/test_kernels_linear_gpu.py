"""The small-M Triton linear (kernels/small_linear.py) on a CUDA GPU in bf16 at the decode shapes of
Qwen3-30B-A3B and gpt-oss-20b (qkv, o_proj, router), against torch's linear in fp32 and bf16, and
captured in a CUDA graph (replayed with other inputs)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

# name -> (K, N, bias): Qwen3-30B qkv, o_proj, router; gpt-oss-20b qkv (with bias), router (with bias)
SHAPES = {"qwen3-qkv": (2048, 5120, False), "qwen3-o": (4096, 2048, False), "qwen3-router": (2048, 128, False),
          "gpt-oss-qkv": (2880, 5120, True), "gpt-oss-router": (2880, 32, True)}


def _case(shape, m, seed=0):
    k, n, bias = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g, device="cuda").bfloat16() if bias else None
    return x, w, b


def _rel(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("launch", [None, (16, 128, 4, 3, 1), (64, 256, 4, 3, 8)])
def test_bf16_matches_torch_linear(shape, m, launch):
    from tierkv.kernels import small_linear

    x, w, b = _case(shape, m)
    got = small_linear.linear(x, w, b, launch=launch)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    in_bf16 = torch.nn.functional.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == in_bf16.shape
    # one rounding of an fp32 sum: as close to the exact result as cuBLAS's bf16 output is
    assert _rel(got, want) <= max(1.5 * _rel(in_bf16, want), 4e-3)
    counters = small_linear._counters.get(x.device)  # made by the first call that splits K
    assert counters is None or int(counters.abs().sum()) == 0   # left zeroed for the next call


def test_the_same_bits_every_call_and_in_a_cuda_graph():
    from tierkv.kernels import small_linear as kernels  # its `linear`, at the default launch

    x, w, b = _case("gpt-oss-qkv", 2)
    eager = [kernels.linear(x, w, b) for _ in range(10)]
    assert all(torch.equal(e, eager[0]) for e in eager[1:])
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.linear(static, w, b)
    for seed in (1, 2):
        new, _, _ = _case("gpt-oss-qkv", 2, seed)
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, kernels.linear(new, w, b))
