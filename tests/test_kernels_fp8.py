"""The fused fp8 block moves (gather + quantise, dequantise + scatter) and the fp8 kernels on the GPU.

CPU: the package functions (the reference there) are gather_blocks + quantize_fp8 and its
inverse, and refuse bad arguments. GPU: the Triton kernels write the reference's bytes exactly,
bf16 included (which the interpreter cannot check, test_kernels_fp8_triton.py), into strided
views of packed L2 rows, for Llama-shaped and odd-shaped blocks, and BlockMover moves fp8 blocks
L1 -> L2 -> L1 with them.
"""

from __future__ import annotations

import pytest
import torch
from fp8_cases import rounding_sweep

import tierkv.kernels as K
from tierkv.kernels import ShapeError
from tierkv.kernels import reference as ref
from tierkv.layout import KVLayout, OffloadLayout



def on_gpu(test):
    no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
    return pytest.mark.gpu(no_gpu(test))


def _pool(layers, slots, bs, heads, dim, dtype, device="cpu", seed=0) -> torch.Tensor:
    """[layers, slots, 2, bs, heads, dim], heads of very different magnitudes, one all zero, one tiny."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(layers, slots, 2, bs, heads, dim, generator=g)
    pool *= torch.rand(layers, slots, 2, 1, heads, 1, generator=g) * 10
    pool[-1, 1, 1, :, 0] = 0
    pool[0, 0, 0, :, -1] *= 1e-6  # down in fp8's subnormals
    return pool.to(dtype).to(device)


def _rows(fmt: OffloadLayout, n: int, device) -> torch.Tensor:
    return torch.full((n, fmt.bytes_per_block), 7, dtype=torch.uint8, device=device)


def test_gather_quantize_is_gather_then_quantize():
    pool = _pool(3, 9, 16, 2, 32, torch.bfloat16)
    fmt = OffloadLayout(KVLayout(3, 2, 32, block_size=16))
    slots = torch.tensor([7, 0, 3])
    fused, apart = _rows(fmt, 3, "cpu"), _rows(fmt, 3, "cpu")
    K.gather_quantize_fp8(pool, slots, fmt.payload(fused), fmt.scales(fused))
    blocks = K.gather_blocks(pool, slots, torch.empty(3, 3, 2, 16, 2, 32, dtype=torch.bfloat16))
    K.quantize_fp8(blocks, fmt.payload(apart), fmt.scales(apart))
    assert torch.equal(fused, apart)


def test_dequantize_scatter_is_the_inverse_into_its_slots_only():
    pool = _pool(3, 9, 16, 2, 32, torch.float32)
    fmt = OffloadLayout(KVLayout(3, 2, 32, dtype=torch.float32, block_size=16))
    rows = _rows(fmt, 3, "cpu")
    K.gather_quantize_fp8(pool, torch.tensor([7, 0, 3]), fmt.payload(rows), fmt.scales(rows))
    out = torch.full_like(pool, 5.0)
    K.dequantize_scatter_fp8(fmt.payload(rows), fmt.scales(rows), out, torch.tensor([1, 2, 4]))
    blocks = torch.empty(3, 3, 2, 16, 2, 32)
    K.dequantize_fp8(fmt.payload(rows), fmt.scales(rows), blocks)
    assert torch.equal(out[:, [1, 2, 4]], blocks.transpose(0, 1))
    assert (out[:, [0, 3, 5, 6, 7, 8]] == 5).all()
    # within fp8's rounding: each value off by at most half a step at its head's top (amax / 14)
    err = (out[:, [1, 2, 4]] - pool[:, [7, 0, 3]]).abs().amax(dim=(3, 5))         # [layers, 3, 2, h]
    assert (err <= pool[:, [7, 0, 3]].abs().amax(dim=(3, 5)) / 14).all()


def test_fused_moves_refuse_mismatched_arguments():
    pool = torch.zeros(3, 9, 2, 16, 2, 32)
    q, scales, slots = torch.zeros(2, 3, 2, 16, 2, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 3, 2, 2), torch.tensor([1, 2])
    with pytest.raises(ShapeError, match="q must be"):
        K.gather_quantize_fp8(pool, slots[:1], q, scales)
    with pytest.raises(ShapeError, match="scales must be"):
        K.dequantize_scatter_fp8(q, scales[..., :1], pool, slots)
    with pytest.raises(ShapeError, match="dtype"):
        K.gather_quantize_fp8(pool, slots, q.float(), scales)


# ---------------------------------------------------------------------------------------- GPU


# (dtype, (layers, block_size, kv heads, head dim)): every dtype on Llama's head shape, odd shapes in bf16
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (4, 16, 8, 128)), (torch.float16, (4, 16, 8, 128)),
                                         (torch.float32, (4, 16, 8, 128)), (torch.bfloat16, (3, 32, 2, 64)),
                                         (torch.bfloat16, (2, 16, 3, 96))])
@on_gpu
def test_triton_writes_the_reference_bytes_both_ways(dtype, shape):
    from tierkv.kernels import fp8

    layers, bs, heads, dim = shape
    pool = _pool(layers, 70, bs, heads, dim, dtype, "cuda")
    fmt = OffloadLayout(KVLayout(layers, heads, dim, dtype=dtype, block_size=bs))
    slots = torch.randperm(70, device="cuda")[:33]
    got, want = _rows(fmt, 33, "cuda"), _rows(fmt, 33, "cuda")
    fp8.gather_quantize_fp8(pool, slots, fmt.payload(got), fmt.scales(got))
    ref.gather_quantize_fp8(pool, slots, fmt.payload(want), fmt.scales(want))
    assert torch.equal(got, want)
    back, back_ref = torch.full_like(pool, 3.0), torch.full_like(pool, 3.0)
    fp8.dequantize_scatter_fp8(fmt.payload(got), fmt.scales(got), back, slots)
    ref.dequantize_scatter_fp8(fmt.payload(want), fmt.scales(want), back_ref, slots)
    assert torch.equal(back, back_ref)
    # block-first: the forms read_l2 and to_host use
    blocks = pool[:, slots].transpose(0, 1)  # [33, layers, 2, bs, h, d], strided
    again = _rows(fmt, 33, "cuda")
    fp8.quantize_fp8(blocks, fmt.payload(again), fmt.scales(again))
    assert torch.equal(again, want)
    out, out_ref = torch.empty_like(blocks), torch.empty_like(blocks)
    fp8.dequantize_fp8(fmt.payload(got), fmt.scales(got), out)
    ref.dequantize_fp8(fmt.payload(got), fmt.scales(got), out_ref)
    assert torch.equal(out, out_ref)


@on_gpu
def test_triton_rounds_every_kind_of_value_as_torch_does():
    from tierkv.kernels import fp8

    x = rounding_sweep(100_000).cuda()
    n = x.shape[0]
    q, scales = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(n, 1, 2, 1, device="cuda")
    fp8.quantize_fp8(x, q, scales)
    assert (scales == 1).all()
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


@on_gpu
def test_package_dispatches_fp8_moves_to_triton_on_cuda():
    from tierkv.kernels import fp8

    for name in ("quantize_fp8", "dequantize_fp8", "gather_quantize_fp8", "dequantize_scatter_fp8"):
        assert K._impl(name, torch.empty(1, device="cuda")) is getattr(fp8, name)
        assert K._impl(name, torch.empty(1)) is getattr(ref, name)


@on_gpu
def test_block_mover_round_trips_fp8_blocks_with_one_kernel_each_way():
    from tierkv.tiers import DevicePool, HostPool
    from tierkv.transfer import BlockMover

    layout = KVLayout(4, 8, 128, dtype=torch.bfloat16, block_size=16)
    fmt = OffloadLayout(layout)
    l1, l2 = DevicePool(layout, 300, torch.device("cuda")), HostPool(fmt, 400)
    l1.kv.copy_(_pool(4, 300, 16, 8, 128, torch.bfloat16, "cuda"))
    mover = BlockMover(l1, l2)
    src, dst = list(range(0, 300, 2)), list(range(100, 250))  # 150 blocks, 1 MiB each: one chunk
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        mover.l1_to_l2(src, dst).synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_fp8_kernel" in n for n in names) == 1 and not any("elementwise" in n for n in names), names
    want = _rows(fmt, len(src), "cuda")
    ref.gather_quantize_fp8(l1.kv, torch.tensor(src, device="cuda"), fmt.payload(want), fmt.scales(want))
    assert torch.equal(l2.kv[dst].cuda(), want)
    back = list(range(150, 300))
    mover.l2_to_l1(dst, back).synchronize()
    expect = torch.empty_like(l1.kv)
    ref.dequantize_scatter_fp8(fmt.payload(want), fmt.scales(want), expect, torch.tensor(back, device="cuda"))
    assert torch.equal(l1.kv[:, back], expect[:, back])
