"""The small-M Triton linear (kernels/small_linear.py) against torch's linear, on CPU under the Triton
interpreter (see interpreted.py: in a normal run this file's one test runs it again in a child
process). bf16 and the real layer shapes are GPU-tested (test_kernels_linear_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, TOL, in_child, kernel_modules, leave_only_the_child_run

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tk():
    return kernel_modules("small_linear")


def case(m, k, n, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n,bias,launch", [
    (1, 40, 24, False, (16, 16, 4, 2, 1)),        # one chunk: written directly; K, N not whole tiles
    (3, 40, 24, True, (16, 16, 4, 2, 2)),         # 2 chunks (32 + 8): partials summed by the last arriver
    (4, 100, 50, True, (32, 16, 4, 2, 5)),        # 5 chunks of 32 ask for 20 each: 4 (BLOCK_S 4), the last 4 wide
    (2, 64, 16, False, (16, 16, 4, 2, None)),     # the default choice: 1 tile on 4 SMs -> 2 chunks of 32
])
def test_matches_torch_linear(tk, m, k, n, bias, launch, dtype):
    x, w, b = case(m, k, n, dtype, bias)
    got = tk.small_linear.linear(x, w, b, launch=launch)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
                               .to(dtype), **TOL[dtype])


def test_the_counters_are_left_zeroed_for_the_next_call(tk):
    # the last arriver of each column tile resets its counter: a second call (and one with other
    # tiles) still finds every counter at zero, so its sums are whole again
    x, w, b = case(2, 64, 40, torch.float32, True)
    launch = (16, 16, 4, 2, 4)
    first = tk.small_linear.linear(x, w, b, launch=launch)
    assert int(tk.small_linear._counters[x.device].abs().sum()) == 0
    again = tk.small_linear.linear(x, w, b, launch=launch)
    assert torch.equal(first, again)
    torch.testing.assert_close(again, torch.nn.functional.linear(x, w, b), **TOL[torch.float32])


def test_more_rows_and_other_layouts_take_torchs_linear(tk):
    # 5 rows, a 3-d input, a transposed weight: torch's linear, same results as calling it
    x, w, b = case(5, 32, 16, torch.float32, True)
    for args in ((x, w, b), (x.view(5, 1, 32), w, b), (x[:2], w.t().contiguous().t(), b)):
        torch.testing.assert_close(tk.small_linear.linear(*args), torch.nn.functional.linear(*args), rtol=0, atol=0)


def test_the_default_split_gives_every_sm_programs(tk):
    # 4 SMs under the interpreter: 16 programs wanted. 1 column tile of 32 over K 2048 -> 8 chunks of
    # 256 (then K holds no more), 16 tiles -> 1; more tiles than counters -> 1 chunk
    cpu = torch.device("cpu")
    assert tk.small_linear._chunk(32, 2048, (32, 256, 4, 3, None), cpu) == (256, 8)
    assert tk.small_linear._chunk(512, 2048, (32, 256, 4, 3, None), cpu) == (2048, 1)
    assert tk.small_linear._chunk(32 * (tk.small_linear.MAX_TILES + 1), 2048, (32, 256, 4, 3, 4), cpu) == (2048, 1)


leave_only_the_child_run(globals())
