"""kernels.linear on a CUDA GPU: one bf16/fp16 row captured in a CUDA graph goes through the Triton
GEMV (kernels/matvec.py) and replays equal to torch's linear in fp32 within the dtype's rounding, at
Llama-3.1-8B's shapes and ragged ones; eager calls and more rows stay on cuBLAS."""

from __future__ import annotations

import pytest
import torch

from tierkv import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]


def captured(fn, *args):
    """(graph, its output, whether the GEMV was chosen during capture) for fn(*args)."""
    from tierkv.kernels import matvec

    chose = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)  # warm-up outside the graph: Triton compiles, cuBLAS picks its kernel
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chose.append(matvec.takes_gemv(args[0], args[1]))
        out = fn(*args)
    return graph, out, chose[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, bias", [
    (6144, 4096, False),    # Llama-3.1-8B qkv
    (4096, 14336, False),   # down: K of seven 2048-wide chunks
    (896, 896, True),       # Qwen2-0.5B-like qkv with bias: K under one chunk
    (1001, 3000, True),     # ragged N and K: the masked path
])
def test_one_row_in_a_graph_takes_the_gemv_and_matches_linear(dtype, n, k, bias):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=g)
    graph, out, chose = captured(kernels.linear, x, w, b)
    assert chose
    for _ in range(2):  # replays read the static input as it is now
        x.copy_(torch.randn(1, k, device="cuda", dtype=dtype, generator=g))
        graph.replay()
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        torch.cuda.synchronize()
        assert out.shape == (1, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_eager_calls_more_rows_and_fp32_stay_on_cublas():
    from tierkv.kernels import matvec

    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    one, two = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16), torch.randn(2, 512, device="cuda",
                                                                                    dtype=torch.bfloat16)
    assert not matvec.takes_gemv(one, w)                       # eager: the host pays each launch
    assert not captured(kernels.linear, two, w)[2]             # two rows: cuBLAS's GEMM
    assert not captured(kernels.linear, one.float(), w.float())[2]  # fp32: not what the GEMV was tuned for
    graph, out, chose = captured(kernels.linear, one, w.t().contiguous().t())  # a column-major weight
    assert not chose
    graph.replay()
    torch.testing.assert_close(out.float(), torch.nn.functional.linear(one.float(), w.float()), rtol=2e-2, atol=2e-2)
