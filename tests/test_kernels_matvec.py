"""kernels/matvec.py (one row of activations times a row-major weight) against torch's linear, run
on CPU by the Triton interpreter (interpreted.py); bf16 and its speed are the GPU's
(benchmarks/bench_gemv.py)."""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, TOL, in_child, kernel_modules

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)
else:
    @pytest.fixture(scope="module")
    def tk():
        return kernel_modules("matvec")

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("n, k, launch", [
        (64, 256, {}),                                      # the default launch, whole tiles
        (48, 192, dict(block_n=8, block_k=128)),             # K not a multiple of the chunk
        (37, 256, dict(block_n=8, block_k=64)),              # N not a multiple of the rows
        (5, 1000, dict(block_n=2, block_k=512, num_warps=2)),
    ])
    def test_gemv_matches_linear(tk, dtype, n, k, launch):
        g = torch.Generator().manual_seed(n * k)
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(1, k, generator=g).to(dtype)
        got = tk.matvec.gemv(x, w, **launch)
        assert got.shape == (1, n) and got.dtype == dtype
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(x.float(), w.float()), **TOL[dtype])

    def test_gemv_adds_the_bias_and_takes_a_flat_row(tk):
        g = torch.Generator().manual_seed(3)
        w, x, b = torch.randn(40, 96, generator=g), torch.randn(96, generator=g), torch.randn(40, generator=g)
        got = tk.matvec.gemv(x, w, b, block_n=16, block_k=32)
        assert got.shape == (40,)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), **TOL[torch.float32])

    def test_gemv_refuses_more_than_one_row_or_a_transposed_weight(tk):
        with pytest.raises(ValueError, match="one row"):
            tk.matvec.gemv(torch.randn(2, 8), torch.randn(4, 8))
        with pytest.raises(ValueError, match="row-major"):
            tk.matvec.gemv(torch.randn(1, 8), torch.randn(8, 4).t())
