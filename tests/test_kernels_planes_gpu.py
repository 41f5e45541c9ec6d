"""copy_planes on a CUDA GPU: bf16 and fp8 blocks bit for bit between device layouts and pinned
host planes (read and written by the GPU through unified addressing), against the reference on
CPU copies of the same bytes. Real shapes (Llama-3.1-8B's 8 x 128 heads, 16-token blocks).
"""

from __future__ import annotations

import pytest
import torch

import tierkv.kernels as K
from tierkv.kernels import PlaneTable
from tierkv.kernels import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

LAYERS, BS, HEADS, DIM = 4, 16, 8, 128
WORDS = {1: torch.int8, 2: torch.int16}

# name -> (storage shapes for n blocks, planes of that storage); plane 2*l + c = K/V of layer l
LAYOUTS = {
    "tierkv_l1": (lambda n: [(LAYERS, n, 2, BS, HEADS, DIM)],
                  lambda s: [s[0][l, :, c] for l in range(LAYERS) for c in range(2)]),
    "vllm": (lambda n: [(2, n, BS, HEADS, DIM)] * LAYERS, lambda s: [s[l][c] for l in range(LAYERS) for c in range(2)]),
    "flashinfer_hnd": (lambda n: [(n, 2, HEADS, BS, DIM)] * LAYERS,
                       lambda s: [s[l][:, c].transpose(1, 2) for l in range(LAYERS) for c in range(2)]),
    "block_first": (lambda n: [(n, LAYERS, 2, BS, HEADS, DIM)],
                    lambda s: [s[0][:, l, c] for l in range(LAYERS) for c in range(2)]),
}


def _storage(layout, n, dtype, where, g=None):
    """where: "cuda", "pinned" or "cpu"; random bits when g is given, else zeros."""
    out = []
    for shape in LAYOUTS[layout][0](n):
        word = WORDS[torch.empty(0, dtype=dtype).element_size()]
        t = (torch.randint(-100, 100, shape, dtype=word, generator=g) if g is not None
             else torch.zeros(shape, dtype=word)).view(dtype)
        out.append(t.cuda() if where == "cuda" else t.pin_memory() if where == "pinned" else t)
    return out


def _table(layout, storage, on_gpu=True):
    return PlaneTable(LAYOUTS[layout][1](storage), device="cuda" if on_gpu else None)


def _bits(storage):
    return [s.cpu().view(WORDS[s.element_size()]) for s in storage]


CASES = [  # (src layout, where, dst layout, where)
    ("vllm", "cuda", "block_first", "cuda"),
    ("block_first", "pinned", "tierkv_l1", "cuda"),
    ("block_first", "pinned", "vllm", "cuda"),
    ("block_first", "pinned", "flashinfer_hnd", "cuda"),
    ("tierkv_l1", "cuda", "block_first", "pinned"),
    ("flashinfer_hnd", "cuda", "block_first", "pinned"),
    ("flashinfer_hnd", "cuda", "vllm", "cuda"),
    ("tierkv_l1", "cuda", "tierkv_l1", "pinned"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("src_layout,src_at,dst_layout,dst_at", CASES)
@pytest.mark.parametrize("planes", [None, (2, 4)])
def test_copy_planes_bit_exact(src_layout, src_at, dst_layout, dst_at, dtype, planes):
    g = torch.Generator().manual_seed(0)
    src = _storage(src_layout, 50, dtype, src_at, g)
    dst = _storage(dst_layout, 40, dtype, dst_at)
    src_slots = torch.randperm(50, generator=g)[:24]
    dst_slots = torch.randperm(40, generator=g)[:24]
    want = _storage(dst_layout, 40, dtype, "cpu")
    ref.copy_planes(_table(src_layout, [s.cpu() for s in src], False), src_slots,
                    _table(dst_layout, want, False), dst_slots, planes)
    source, dest = _table(src_layout, src), _table(dst_layout, dst)
    assert K.backend_for(source.ptrs) == "triton"
    K.copy_planes(source, src_slots.cuda(), dest, dst_slots.cuda().int(), planes)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_bits(dst), _bits(want)))
    assert sum(int(t.count_nonzero()) for t in _bits(dst)) > 0


def test_large_copy_of_whole_blocks_and_one_layer():
    # 300 blocks of 32 planes: thousands of programs, int32 slots, the last slot of each pool
    g = torch.Generator().manual_seed(1)
    host = torch.randint(-2**15, 2**15 - 1, (320, 16, 2, BS, HEADS, DIM), dtype=torch.int16, generator=g)
    host = host.view(torch.bfloat16).pin_memory()
    pool = torch.zeros(16, 400, 2, BS, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    l2 = PlaneTable([host[:, l, c] for l in range(16) for c in range(2)], device="cuda")
    l1 = PlaneTable([pool[l, :, c] for l in range(16) for c in range(2)])
    src = torch.cat([torch.randperm(319, generator=g)[:299], torch.tensor([319])])
    dst = torch.cat([torch.randperm(399, generator=g)[:299], torch.tensor([399])])
    K.copy_planes(l2, src.int().cuda(), l1, dst.int().cuda())
    torch.cuda.synchronize()
    assert torch.equal(pool[:, dst.cuda()].transpose(0, 1).cpu().view(torch.int16), host[src].view(torch.int16))
    back = torch.zeros_like(host).pin_memory()
    K.copy_planes(l1, dst.cuda(), PlaneTable([back[:, l, c] for l in range(16) for c in range(2)], device="cuda"),
                  src.cuda(), planes=(6, 8))  # layer 3 alone
    torch.cuda.synchronize()
    assert torch.equal(back[src, 3].view(torch.int16), host[src, 3].view(torch.int16))
    assert int(back.view(torch.int16).count_nonzero()) == int(back[src, 3].view(torch.int16).count_nonzero())
