"""dma.copy and dma.copy_batch on a CUDA GPU: plain, strided (2-D) and batched scattered copies
between pinned host memory and the device, ordered on a side stream, bit for bit; a bad copy
raises and leaves CUDA usable. And the staged-DMA moves built on them (transfer.BlockMover with
DMA_MOVES on), over many staging chunks, scattered slots, groups of layers and a second thread,
bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from tierkv import dma, transfer
from tierkv.layout import KVLayout
from tierkv.tiers.gpu import DevicePool
from tierkv.tiers.host import HostPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]


def test_strided_copies_both_ways_on_a_side_stream():
    assert dma.available()
    blocks, row = 6, 4096  # six "blocks" of 4 KiB; copy bytes 1024..3072 of blocks 1..4
    host = torch.randint(0, 256, (blocks, row), dtype=torch.uint8).pin_memory()
    dev = torch.zeros((blocks, row), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the zeros above are the default stream's work
    with torch.cuda.stream(stream):
        dma.copy(dev[1].data_ptr() + 1024, host[1].data_ptr() + 1024, 2048, 4, dst_pitch=row, src_pitch=row,
                 stream=stream.cuda_stream)
    stream.synchronize()
    want = torch.zeros_like(host)
    want[1:5, 1024:3072] = host[1:5, 1024:3072]
    assert torch.equal(dev.cpu(), want)
    back = torch.zeros_like(host).pin_memory()
    dma.copy(back.data_ptr(), dev.data_ptr(), row, blocks, stream=torch.cuda.current_stream().cuda_stream)  # whole rows
    torch.cuda.synchronize()
    assert torch.equal(back, want)


def test_a_bad_copy_raises_and_cuda_stays_usable():
    dev = torch.zeros(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="cudaMemcpy2DAsync"):
        dma.copy(dev.data_ptr(), dev.data_ptr(), 16, 2, dst_pitch=8, src_pitch=16)  # pitch < width
    assert (dev + 1).sum().item() == 16  # no sticky error for torch's next kernel


def test_a_batch_of_scattered_copies_lands_bit_for_bit_both_ways():
    assert dma.batched()  # torch's runtime (CUDA 12.8+) has cudaMemcpyBatchAsync
    rows, row = 16, 8192
    host = torch.randint(0, 256, (rows, row), dtype=torch.uint8).pin_memory()
    dev = torch.zeros((rows, row), dtype=torch.uint8, device="cuda")
    order = [5, 0, 11, 3, 14]  # host row order[i] -> device row i: bytes 1024..5120 of each
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the zeros above are the default stream's work
    dma.copy_batch([dev[i].data_ptr() + 1024 for i in range(len(order))],
                   [host[r].data_ptr() + 1024 for r in order], [4096] * len(order), stream=stream.cuda_stream)
    stream.synchronize()
    want = torch.zeros_like(host)
    want[: len(order), 1024:5120] = host[order, 1024:5120]
    assert torch.equal(dev.cpu(), want)
    back = torch.zeros_like(host).pin_memory()  # whole rows back, to the rows they came from
    dma.copy_batch([back[r].data_ptr() for r in order], [dev[i].data_ptr() for i in range(len(order))],
                   [row] * len(order), stream=stream.cuda_stream)
    stream.synchronize()
    want_back = torch.zeros_like(host)
    want_back[order] = want[: len(order)]
    assert torch.equal(back, want_back)
    # the legacy default stream, which a batch refuses, gets one copy each
    dma.copy_batch([dev[15].data_ptr()], [host[15].data_ptr()], [row], stream=0)
    torch.cuda.synchronize()
    assert torch.equal(dev[15].cpu(), host[15])
    with pytest.raises(ValueError, match="as many destinations"):
        dma.copy_batch([dev[0].data_ptr()], [host[0].data_ptr(), host[1].data_ptr()], [row], stream=0)


@pytest.fixture
def staged_dma(monkeypatch):
    """Staged DMA for every move, through a staging buffer of 5 blocks (many chunks a move)."""
    layout = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    monkeypatch.setattr(transfer, "DMA_MOVES", True)
    monkeypatch.setattr(transfer, "MIN_DMA_BYTES", 0)
    monkeypatch.setattr(transfer, "MIN_DMA_ROW", 0)
    monkeypatch.setattr(transfer, "STAGING_BYTES", 5 * layout.bytes_per_block)
    l1, l2 = DevicePool(layout, 64, "cuda"), HostPool(layout, 96, pin=True)
    mover = transfer.BlockMover(l1, l2)
    assert mover.dma and mover.staging.tensor.shape[0] == 5
    return l1, l2, mover


def slots(n: int, of: int, seed: int) -> list[int]:
    """`n` distinct slots below `of`: runs of neighbours in shuffled order, as an LRU hands them back."""
    g = torch.Generator().manual_seed(seed)
    picked = sorted(torch.randperm(of, generator=g)[:n].tolist())
    runs = [list(r) for r in _split(picked)]
    order = torch.randperm(len(runs), generator=g).tolist()
    return [s for i in order for s in runs[i]]


def _split(picked: list[int]):
    run = [picked[0]]
    for s in picked[1:]:
        if s != run[-1] + 1:
            yield run
            run = []
        run.append(s)
    yield run


@pytest.mark.parametrize("on_thread", [False, True], ids=["main-thread", "engine-thread"])
def test_staged_dma_moves_are_bit_for_bit_over_many_chunks(staged_dma, on_thread):
    l1, l2, mover = staged_dma
    src, dst = slots(37, 64, seed=1), slots(37, 64, seed=2)
    at = slots(37, 96, seed=3)  # L2 slots: 37 blocks in several runs, not in order
    l1.kv.copy_(torch.randn(l1.kv.shape, dtype=torch.float32, device="cuda").to(l1.kv.dtype))
    want = l1.read(src).cpu()

    def moves():
        mover.l1_to_l2(src, at).synchronize()  # whole blocks: gathered, then a DMA per run
        assert torch.equal(l2.kv[torch.tensor(at)], want)
        l1.kv[:, torch.tensor(dst, device="cuda")] = 0
        load = mover.l2_to_l1(at, dst)  # by groups of layers: strided DMAs, then scatters
        for layer in range(l1.layout.num_layers):  # the compute stream waits layer by layer, as attention does
            load.wait_layer(layer)
            got = l1.kv[layer, torch.tensor(dst, device="cuda")].cpu()
            assert torch.equal(got, want[:, layer]), f"layer {layer}"
        # a save of some layers only (a layer-wise save): strided DMAs into those layers of each block
        l2.kv[torch.tensor(at)] = 0
        mover.l1_to_l2(dst, at, layers=range(2, 5)).synchronize()
        got = l2.kv[torch.tensor(at)]
        assert torch.equal(got[:, 2:5], want[:, 2:5]) and not got[:, :2].any() and not got[:, 5:].any()

    errors = []
    if on_thread:  # tierkv-serve moves blocks from its engine thread
        worker = threading.Thread(target=lambda: _collect(moves, errors))
        worker.start()
        worker.join()
    else:
        _collect(moves, errors)
    assert not errors, errors[0]


def _collect(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test's thread
        errors.append(e)
