"""copy_planes between PlaneTables (kernels/planes.py, reference.copy_planes, kernels/plane_copy.py).

Every layout an engine may register (tierkv's layer-first pool, vLLM's and FlashInfer's NHD/HND
per-layer tensors, block-first storage) as planes; the reference against a plain loop over
blocks, and the Triton kernel under the interpreter (interpreted.py: in a normal run one test
runs this file again in a child process) against the reference, bit for bit. Bad tables and
copies raise ShapeError. On the GPU: test_kernels_planes_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, in_child, kernel_modules, leave_only_the_child_run

from tierkv.kernels import PlaneTable, ShapeError
from tierkv.kernels import reference as ref

LAYERS, BS, HEADS, DIM = 3, 4, 2, 16
WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _random_bits(shape, dtype, g: torch.Generator) -> torch.Tensor:
    """Every bit pattern is fair game (NaNs too): copies move bits, so the tests compare bits."""
    word = WORDS[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(word)
    return torch.randint(info.min, info.max, shape, dtype=word, generator=g).view(dtype)


# name -> (storage shapes for num_blocks n, planes of that storage). Plane 2*l + c = K/V of layer l.
LAYOUTS = {
    "tierkv_l1": (lambda n: [(LAYERS, n, 2, BS, HEADS, DIM)],
                  lambda s: [s[0][l, :, c] for l in range(LAYERS) for c in range(2)]),
    "vllm": (lambda n: [(2, n, BS, HEADS, DIM)] * LAYERS,
             lambda s: [s[l][c] for l in range(LAYERS) for c in range(2)]),
    "flashinfer_nhd": (lambda n: [(n, 2, BS, HEADS, DIM)] * LAYERS,
                       lambda s: [s[l][:, c] for l in range(LAYERS) for c in range(2)]),
    "flashinfer_hnd": (lambda n: [(n, 2, HEADS, BS, DIM)] * LAYERS,
                       lambda s: [s[l][:, c].transpose(1, 2) for l in range(LAYERS) for c in range(2)]),
    "block_first": (lambda n: [(n, LAYERS, 2, BS, HEADS, DIM)],
                    lambda s: [s[0][:, l, c] for l in range(LAYERS) for c in range(2)]),
}
PAIRS = [(name, name) for name in LAYOUTS] + [
    ("vllm", "block_first"), ("block_first", "flashinfer_hnd"), ("flashinfer_nhd", "flashinfer_nhd"),
    ("tierkv_l1", "vllm"), ("flashinfer_hnd", "tierkv_l1"), ("block_first", "tierkv_l1"),
]


def _storage(layout: str, n: int, dtype, g: torch.Generator, zero: bool = False) -> list[torch.Tensor]:
    shapes = LAYOUTS[layout][0](n)
    if zero:
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    return [_random_bits(shape, dtype, g) for shape in shapes]


def _table(layout: str, storage: list[torch.Tensor]) -> PlaneTable:
    return PlaneTable(LAYOUTS[layout][1](storage))


def _bits(storage: list[torch.Tensor]) -> list[torch.Tensor]:
    return [s.view(WORDS[s.element_size()]) for s in storage]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b)))


def _case(src_layout, dst_layout, dtype, planes=None, seed=0, slot_dtype=torch.int64):
    """Random source, zeroed destination, slots, and the truth: a Python loop over blocks."""
    g = torch.Generator().manual_seed(seed)
    src = _storage(src_layout, 7, dtype, g)
    dst = _storage(dst_layout, 9, dtype, g, zero=True)
    src_slots = torch.tensor([6, 0, 3, 3, 5], dtype=slot_dtype)
    dst_slots = torch.tensor([2, 8, 0, 4, 7], dtype=slot_dtype)
    want = [t.clone() for t in dst]
    want_planes, src_planes = LAYOUTS[dst_layout][1](want), LAYOUTS[src_layout][1](src)
    first, end = planes or (0, len(src_planes))
    for p in range(first, end):
        for s, d in zip(src_slots.tolist(), dst_slots.tolist()):
            want_planes[p][d] = src_planes[p][s]
    return src, src_slots, dst, dst_slots, want


if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)


@pytest.fixture(scope="module")
def tk():
    pytest.importorskip("triton")
    return kernel_modules("plane_copy").plane_copy


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src_layout,dst_layout", PAIRS)
def test_triton_matches_reference_bit_for_bit(tk, src_layout, dst_layout, dtype):
    # the kernel reads and writes raw words, so bf16 and fp8 run under the interpreter too
    src, src_slots, dst, dst_slots, want = _case(src_layout, dst_layout, dtype)
    tk.copy_planes(_table(src_layout, src), src_slots, _table(dst_layout, dst), dst_slots)
    theirs = _storage(dst_layout, 9, dtype, None, zero=True)
    ref.copy_planes(_table(src_layout, src), src_slots, _table(dst_layout, theirs), dst_slots)
    assert _same(dst, theirs) and _same(dst, want)


@pytest.mark.parametrize("planes", [(2, 4), (5, 6), (3, 3)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_triton_plane_range(tk, planes, slot_dtype):
    src, src_slots, dst, dst_slots, want = _case("vllm", "block_first", torch.float16, planes, slot_dtype=slot_dtype)
    tk.copy_planes(_table("vllm", src), src_slots, _table("block_first", dst), dst_slots, planes)
    assert _same(dst, want)


@pytest.mark.parametrize("programs", [1, 4, 7])
@pytest.mark.parametrize("src_layout,dst_layout", [("vllm", "block_first"), ("block_first", "block_first")])
def test_triton_with_fewer_programs_than_items_copies_every_item(tk, monkeypatch, programs, src_layout, dst_layout):
    # a copy over PCIe runs on a few programs, each taking every G-th (slot, plane, piece) item:
    # a strided and a flat (both dense) case, over a plane range that starts past plane 0, with
    # tiles of 64 bytes so that each 256-byte block of a plane is 4 pieces
    monkeypatch.setattr(tk, "_TILE_BYTES", 64)
    src, src_slots, dst, dst_slots, want = _case(src_layout, dst_layout, torch.float16, (1, 5))
    tk.copy_planes(_table(src_layout, src), src_slots, _table(dst_layout, dst), dst_slots, (1, 5), programs=programs)
    assert _same(dst, want)


@pytest.mark.parametrize("bs,heads,dim", [(3, 5, 24), (16, 1, 8), (1, 3, 40), (2, 2, 1)])
def test_triton_odd_geometry(tk, bs, heads, dim):
    # D not a power of two (masked columns), bs*H not a tile multiple, size-1 axes
    g = torch.Generator().manual_seed(3)
    nhd = _random_bits((6, 2, bs, heads, dim), torch.int16, g)  # bits: no NaN != NaN here
    hnd = torch.zeros(5, 2, heads, bs, dim, dtype=torch.int16)
    blocks = torch.zeros(4, 2, bs, heads, dim, dtype=torch.int16)
    src = PlaneTable([nhd[:, 0], nhd[:, 1]])
    slots, rows = torch.tensor([5, 1, 2]), torch.tensor([0, 4, 2])
    tk.copy_planes(src, slots, PlaneTable([hnd[:, c].transpose(1, 2) for c in range(2)]), rows)
    tk.copy_planes(src, slots, PlaneTable([blocks[:, c] for c in range(2)]), torch.tensor([3, 0, 1]))
    for c in range(2):
        assert torch.equal(hnd[rows, c].transpose(1, 2), nhd[slots, c])
        assert torch.equal(blocks[[3, 0, 1], c], nhd[slots, c])
    assert not hnd[[1, 3]].any() and not blocks[2].any()


def test_triton_large_block_spans_several_tiles(tk):
    # 64 x 8 x 128 fp32 = 256 KiB a block: 8 flat tiles, and 8 row tiles when one side is strided
    g = torch.Generator().manual_seed(5)
    src = _random_bits((3, 64, 8, 128), torch.float32, g)
    flat, hnd = torch.zeros(2, 64, 8, 128), torch.zeros(2, 8, 64, 128)
    tk.copy_planes(PlaneTable([src]), torch.tensor([2, 0]), PlaneTable([flat]), torch.tensor([1, 0]))
    tk.copy_planes(PlaneTable([src]), torch.tensor([2, 0]), PlaneTable([hnd.transpose(1, 2)]), torch.tensor([1, 0]))
    assert torch.equal(flat.view(torch.int32), src[[0, 2]].view(torch.int32))
    assert torch.equal(hnd.transpose(1, 2).view(torch.int32), src[[0, 2]].view(torch.int32))


def test_dispatch_env_forces_triton(tk, monkeypatch):
    import tierkv.kernels as K

    src, src_slots, dst, dst_slots, want = _case("flashinfer_hnd", "vllm", torch.float32)
    monkeypatch.setenv("TIERKV_KERNELS", "triton")
    K.copy_planes(_table("flashinfer_hnd", src), src_slots, _table("vllm", dst), dst_slots)
    assert _same(dst, want)


@pytest.mark.parametrize("layers,half", [(None, 1), (range(1, 3), 0), (range(1, 3), 1), (range(2, 3), 1)],
                         ids=["whole-half1", "group-half0", "group-half1", "layer-half1"])
@pytest.mark.parametrize("l1_layout", ["tierkv_l1", "vllm"])
def test_triton_gathers_into_and_scatters_out_of_a_packed_staging_half(tk, layers, half, l1_layout):
    """The staged path's tables (tierkv/staging.py: a half of the buffer, each block's part of
    `layers` packed): the kernel gathers L1 blocks into one and scatters them back out, bit for
    bit as the reference, and writes nothing outside the half's parts."""
    from tierkv.layout import KVLayout
    from tierkv.staging import StagingBuffer

    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_size=BS, dtype=torch.float16)
    planes = (0, 2 * LAYERS) if layers is None else (2 * layers.start, 2 * layers.stop)
    g = torch.Generator().manual_seed(3)
    l1 = _storage(l1_layout, 9, torch.float16, g)
    ours, theirs = (StagingBuffer(layout, layout, 4, torch.device("cpu")) for _ in range(2))
    ours.tensor.zero_(), theirs.tensor.zero_()  # (allocated empty)
    n = ours.chunk_blocks(layers)
    slots, rows = torch.tensor([7, 2, 5, 0, 8, 1][:n]), torch.arange(n)
    tk.copy_planes(_table(l1_layout, l1), slots, ours.table(layers, half), rows, planes)
    ref.copy_planes(_table(l1_layout, l1), slots, theirs.table(layers, half), rows, planes)
    assert torch.equal(ours.tensor.view(torch.int16), theirs.tensor.view(torch.int16))
    written = ours.tensor.view(-1).view(torch.uint8).clone()  # nothing outside the half's parts
    start = half * ours.half_bytes
    written[start : start + n * ours.span(layers)[1]] = 0
    assert not written.any()
    back = _storage(l1_layout, 9, torch.float16, None, zero=True)
    tk.copy_planes(ours.table(layers, half), rows, _table(l1_layout, back), slots, planes)
    l1_planes, back_planes = LAYOUTS[l1_layout][1](l1), LAYOUTS[l1_layout][1](back)
    for p in range(2 * LAYERS):
        want = l1_planes[p][slots] if planes[0] <= p < planes[1] else torch.zeros_like(l1_planes[p][slots])
        assert torch.equal(back_planes[p][slots].view(torch.int16), want.view(torch.int16)), p


leave_only_the_child_run(globals())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src_layout,dst_layout", PAIRS)
def test_reference_matches_a_loop(src_layout, dst_layout, dtype):
    src, src_slots, dst, dst_slots, want = _case(src_layout, dst_layout, dtype)
    out = ref.copy_planes(_table(src_layout, src), src_slots, _table(dst_layout, dst), dst_slots)
    assert isinstance(out, PlaneTable) and _same(dst, want)


@pytest.mark.parametrize("planes", [(2, 4), (0, 1), (5, 6), (4, 4)])
def test_reference_one_layer_or_plane(planes):
    src, src_slots, dst, dst_slots, want = _case("tierkv_l1", "flashinfer_nhd", torch.bfloat16, planes)
    ref.copy_planes(_table("tierkv_l1", src), src_slots, _table("flashinfer_nhd", dst), dst_slots, planes)
    assert _same(dst, want)


def test_package_dispatches_cpu_tables_to_the_reference(monkeypatch):
    import tierkv.kernels as K

    monkeypatch.delenv("TIERKV_KERNELS", raising=False)
    src, src_slots, dst, dst_slots, want = _case("block_first", "flashinfer_hnd", torch.float16)
    K.copy_planes(_table("block_first", src), src_slots, _table("flashinfer_hnd", dst), dst_slots)
    assert K.backend_for(_table("block_first", src).ptrs) == "reference" and _same(dst, want)


def test_table_geometry_and_pointers():
    storage = _storage("flashinfer_hnd", 5, torch.bfloat16, torch.Generator().manual_seed(0))
    table = _table("flashinfer_hnd", storage)
    assert table.num_planes == 2 * LAYERS and table.num_blocks == 5
    assert table.block_shape == (BS, HEADS, DIM) and table.strides == (2 * HEADS * BS * DIM, DIM, BS * DIM)
    assert table.dtype == torch.bfloat16 and table.element_size == 2 and table.word_dtype == torch.int16
    assert not table.dense and _table("block_first", _storage("block_first", 5, torch.half, None, True)).dense
    assert table.ptrs.dtype == torch.int64 and table.ptrs.tolist() == [p.data_ptr() for p in table.planes]
    assert table.align == 16 and table.block_bytes == BS * HEADS * DIM * 2
    assert "strided" in repr(table)


def _planes(layout="vllm", n=4, dtype=torch.float16):
    return LAYOUTS[layout][1](_storage(layout, n, dtype, None, zero=True))


@pytest.mark.parametrize("planes,match", [
    ([], "at least one plane"),
    ([torch.zeros(4, BS, HEADS)], "num_blocks, block_size, kv_heads, head_dim"),
    (_planes()[:1] + [torch.zeros(5, BS, HEADS, DIM, dtype=torch.float16)], "plane 1 has shape"),
    (_planes()[:1] + [torch.zeros(4, BS, HEADS, DIM)], "plane 1 has dtype"),
    (_planes("vllm")[:1] + _planes("flashinfer_nhd")[:1], "plane 1 has strides"),
    ([torch.zeros(4, BS, DIM, HEADS).transpose(2, 3)], "dense along head_dim"),
    ([torch.zeros(4, BS, HEADS, DIM, dtype=torch.complex128)], "16 bytes"),
])
def test_bad_tables_raise(planes, match):
    with pytest.raises(ShapeError, match=match):
        PlaneTable(planes)


def test_pageable_planes_cannot_be_addressed_from_a_gpu():
    with pytest.raises(ShapeError, match="pin"):
        PlaneTable(_planes(), device="cuda")


def test_bad_copies_raise():
    vllm, other = PlaneTable(_planes()), PlaneTable(_planes("block_first", 6))
    slots = torch.tensor([0, 1])
    fp32 = PlaneTable(_planes(dtype=torch.float32))
    wide = PlaneTable([torch.zeros(4, BS, HEADS, DIM * 2, dtype=torch.float16)] * 2)
    cases = [
        ((fp32, slots, vllm, slots), "differ from dst blocks"),
        ((wide, slots, vllm, slots), r"\[4, 2, 32\]"),
        ((vllm, slots, other, torch.tensor([1])), "lists 2 blocks but dst_slots 1"),
        ((vllm, slots.float(), other, slots), "src_slots has dtype"),
        ((vllm, slots, "pool", slots), "dst must be a PlaneTable"),
        ((vllm, slots, PlaneTable(_planes()[:2]), slots), "pass planes="),
    ]
    for args, match in cases:
        with pytest.raises(ShapeError, match=match):
            ref.copy_planes(*args)
    for planes in [(0, 7), (-1, 2), (3, 2), (0, 1.0), [0, 2]]:
        with pytest.raises(ShapeError, match="plane range|planes must be"):
            ref.copy_planes(vllm, slots, other, slots, planes)
    ref.copy_planes(vllm, slots, PlaneTable(_planes()[:2]), slots, (0, 2))  # an explicit range fits
