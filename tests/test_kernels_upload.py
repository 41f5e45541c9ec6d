"""upload: a step's host arrays into their device buffers in one call (kernels/upload_table.py,
reference.upload, kernels/array_upload.py). The Triton kernel under the interpreter (interpreted.py: in
a normal run one test runs this file again in a child process) and the reference copy exactly the
counted prefix of every pair, and nothing past it; on a GPU the kernel reads pinned host arrays
beside a running DMA. Bad tables and counts raise ShapeError."""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, in_child, kernel_modules, leave_only_the_child_run

from tierkv import kernels
from tierkv.kernels import ShapeError, UploadTable
from tierkv.kernels import reference as ref

SIZES = {"ids": (torch.int64, 5000), "tables": (torch.int32, 9000), "lens": (torch.int32, 7), "pos": (torch.int64, 3)}


def _pairs(device="cpu", pin=False, g=None):
    """Host arrays of random values and device buffers filled with -1, per SIZES."""
    g = g or torch.Generator().manual_seed(0)
    sources = [torch.randint(-2**30, 2**30, (n,), dtype=dt, generator=g) for dt, n in SIZES.values()]
    if pin:
        sources = [s.pin_memory() for s in sources]
    targets = [torch.full((n + 5,), -1, dtype=dt, device=device) for dt, n in SIZES.values()]
    return sources, targets


def _check(sources, targets, counts):
    for s, t, n in zip(sources, targets, counts):
        t = t.cpu()
        assert torch.equal(t[:n], s[:n])
        assert bool((t[n:] == -1).all()), "nothing past the count is written"


# several programs per pair (9000 int32 words), an int64 pair, an empty pair, a whole pair
COUNTS = [[4100, 9000, 0, 3], [1, 1, 1, 1], [0, 0, 0, 0], [5000, 2049, 7, 2]]

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)


@pytest.fixture(scope="module")
def tk():
    return kernel_modules("array_upload").array_upload


@pytest.mark.parametrize("counts", COUNTS)
def test_triton_copies_each_counted_prefix(tk, counts):
    sources, targets = _pairs()
    tk.upload(UploadTable(sources, targets), counts)
    _check(sources, targets, counts)


def test_triton_reuses_a_table_with_new_values_and_counts(tk):
    sources, targets = _pairs()
    table = UploadTable(sources, targets)
    tk.upload(table, [10, 10, 7, 3])
    _check(sources, targets, [10, 10, 7, 3])
    for s, t in zip(sources, targets):
        s.mul_(-1)
        t.fill_(-1)
    tk.upload(table, [20, 5, 7, 3])
    _check(sources, targets, [20, 5, 7, 3])


leave_only_the_child_run(globals())


@pytest.mark.parametrize("counts", COUNTS)
def test_reference_copies_each_counted_prefix(counts):
    sources, targets = _pairs()
    ref.upload(UploadTable(sources, targets), counts)
    _check(sources, targets, counts)


def test_the_package_sends_cpu_targets_to_the_reference():
    sources, targets = _pairs()
    kernels.upload(UploadTable(sources, targets), [3, 4, 5, 1])
    _check(sources, targets, [3, 4, 5, 1])


def test_the_header_holds_int32_words():
    sources, targets = _pairs()
    table = UploadTable(sources, targets)
    assert table.set_counts([3, 4, 5, 1]) == [3, 4, 5, 1]
    assert table.counts.tolist() == [6, 4, 5, 2]  # int64 arrays take two words an element
    assert table.ptrs.tolist()[-1] == table.counts.data_ptr() and len(table) == 4


@pytest.mark.parametrize("change, match", [
    (lambda s, t: (s[:1], t), "pairs each source with a target"),
    (lambda s, t: ([s[0].view(50, 100)] + s[1:], t), "1-D and contiguous"),
    (lambda s, t: (s, [t[0].to(torch.int32)] + t[1:]), "dtype"),
    (lambda s, t: (s, [t[0][:10]] + t[1:]), "at least its length"),
    (lambda s, t: ([x.to(torch.int16) for x in s], [x.to(torch.int16) for x in t]), "4 or 8 bytes"),
])
def test_bad_tables_raise(change, match):
    with pytest.raises(ShapeError, match=match):
        UploadTable(*change(*_pairs()))


def test_bad_counts_raise():
    table = UploadTable(*_pairs())
    with pytest.raises(ShapeError, match="a count per pair"):
        table.set_counts([1, 2])
    with pytest.raises(ShapeError, match="cannot upload 5001"):
        table.set_counts([5001, 0, 0, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_on_a_gpu_pinned_arrays_arrive_beside_a_dma_and_pageable_ones_are_refused():
    g = torch.Generator().manual_seed(1)
    with pytest.raises(ShapeError, match="pinned"):
        UploadTable(*_pairs(device="cuda", g=g))
    sources, targets = _pairs(device="cuda", pin=True, g=g)
    table = UploadTable(sources, targets)
    big = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(big, device="cuda")
    side = torch.cuda.Stream()
    for counts in COUNTS:
        for s, t in zip(sources, targets):  # new values each time, and a target as it was before any upload
            s.mul_(-1)
            t.fill_(-1)
        with torch.cuda.stream(side):
            dev.copy_(big, non_blocking=True)  # a load's DMA on another stream meanwhile
        kernels.upload(table, counts)
        torch.cuda.synchronize()
        _check(sources, targets, counts)
