"""The fp8 Triton kernels (kernels/fp8.py) against the torch reference, bit for bit, run on CPU by
the Triton interpreter (see interpreted.py: in a normal run this file's one test runs it again in
a child process). fp16 and fp32 only: the interpreter rounds bf16 stores its own way; bf16 is
GPU-tested (test_kernels_fp8.py).
"""

from __future__ import annotations

import pytest
import torch
from fp8_cases import rounding_sweep
from interpreted import INTERPRETED, in_child, kernel_modules, leave_only_the_child_run

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)

pytest.importorskip("triton")

from tierkv.kernels import reference as ref  # noqa: E402
from tierkv.layout import KVLayout, OffloadLayout  # noqa: E402


@pytest.fixture(scope="module")
def fp8():
    return kernel_modules("fp8").fp8


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _pool(dtype, layers=3, slots=9, bs=16, heads=2, dim=64, seed=0) -> torch.Tensor:
    """[layers, slots, 2, bs, heads, dim]: heads of very different magnitudes, one all zero, one tiny."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(layers, slots, 2, bs, heads, dim, generator=g)
    pool *= torch.rand(layers, slots, 2, 1, heads, 1, generator=g) * 10
    pool[1, 3, 1, :, 0] = 0
    pool[0, 1, 0, :, 1] *= 1e-6  # values down in fp8's subnormals
    return pool.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_quantize_into_packed_rows_equals_the_reference(fp8, dtype):
    pool = _pool(dtype)
    fmt = OffloadLayout(KVLayout(3, 2, 64, dtype=dtype, block_size=16))
    slots = torch.tensor([7, 0, 3, 8, 1])
    got, want = (torch.full((5, fmt.bytes_per_block), 7, dtype=torch.uint8) for _ in range(2))
    fp8.gather_quantize_fp8(pool, slots, fmt.payload(got), fmt.scales(got))  # strided views into rows
    ref.gather_quantize_fp8(pool, slots, fmt.payload(want), fmt.scales(want))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_scatter_writes_exactly_the_reference_into_its_slots(fp8, dtype):
    pool = _pool(dtype)
    fmt = OffloadLayout(KVLayout(3, 2, 64, dtype=dtype, block_size=16))
    rows = torch.empty(4, fmt.bytes_per_block, dtype=torch.uint8)
    slots = torch.tensor([2, 8, 0, 5])
    ref.gather_quantize_fp8(pool, torch.tensor([1, 3, 4, 6]), fmt.payload(rows), fmt.scales(rows))
    got, want = torch.full_like(pool, 3.0), torch.full_like(pool, 3.0)
    fp8.dequantize_scatter_fp8(fmt.payload(rows), fmt.scales(rows), got, slots)
    ref.dequantize_scatter_fp8(fmt.payload(rows), fmt.scales(rows), want, slots)
    assert torch.equal(got, want)
    assert (got[:, [1, 3, 4, 6, 7]] == 3).all()  # other slots untouched


def test_block_first_quantize_and_dequantize(fp8):
    blocks = _pool(torch.float16).transpose(0, 1).contiguous()  # [n, layers, 2, bs, h, d]
    q, scales = torch.empty(blocks.shape, dtype=torch.float8_e4m3fn), torch.empty(9, 3, 2, 2)
    q_ref, scales_ref = torch.empty_like(q), torch.empty_like(scales)
    fp8.quantize_fp8(blocks, q, scales)
    ref.quantize_fp8(blocks, q_ref, scales_ref)
    assert torch.equal(_bytes(q), _bytes(q_ref)) and torch.equal(scales, scales_ref)
    got, want = torch.empty_like(blocks), torch.empty_like(blocks)
    fp8.dequantize_fp8(q, scales, got)
    ref.dequantize_fp8(q, scales, want)
    assert torch.equal(got, want)


def test_one_layer_of_packed_rows_dequantises_like_the_reference(fp8):
    # what attention does with streamed fp8 L2: one layer of packed rows [n, 2, bs, h, d] at a time
    fmt = OffloadLayout(KVLayout(3, 2, 64, dtype=torch.float16, block_size=16))
    rows = torch.empty(9, fmt.bytes_per_block, dtype=torch.uint8)
    ref.quantize_fp8(_pool(torch.float16).transpose(0, 1), fmt.payload(rows), fmt.scales(rows))
    q, scales = fmt.payload(rows)[:, 1], fmt.scales(rows)[:, 1]  # [9, 2, 16, 2, 64] strided, [9, 2, 2]
    got, want = torch.empty(q.shape, dtype=torch.float16), torch.empty(q.shape, dtype=torch.float16)
    fp8.dequantize_fp8(q, scales, got)
    ref.dequantize_fp8(q, scales, want)
    assert torch.equal(got, want)
    again, again_scales = torch.empty_like(q), torch.empty_like(scales)
    fp8.quantize_fp8(got, again, again_scales)
    ref_q, ref_scales = torch.empty_like(q), torch.empty_like(scales)
    ref.quantize_fp8(got, ref_q, ref_scales)
    assert torch.equal(_bytes(again), _bytes(ref_q)) and torch.equal(again_scales, ref_scales)


def test_rounding_to_fp8_matches_torch_on_every_kind_of_value(fp8):
    """fp8_cases.rounding_sweep: every kind of value, each head's scale exactly 1, so q must be
    torch's own cast of x."""
    x = rounding_sweep(3000)
    n = x.shape[0]
    q, scales = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(n, 1, 2, 1)
    fp8.quantize_fp8(x, q, scales)
    assert (scales == 1).all()
    assert torch.equal(_bytes(q), _bytes(x.to(torch.float8_e4m3fn)))


def test_other_shapes_fall_back_to_the_reference(fp8):
    x = torch.randn(5, 16, 2, 32)  # [.., T, H, D] without the block dims: not the kernel's layout
    q, scales = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(5, 2)
    q_ref, scales_ref = torch.empty_like(q), torch.empty_like(scales)
    fp8.quantize_fp8(x, q, scales)
    ref.quantize_fp8(x, q_ref, scales_ref)
    assert torch.equal(_bytes(q), _bytes(q_ref)) and torch.equal(scales, scales_ref)


leave_only_the_child_run(globals())
