"""dma.copy on a CUDA GPU: plain and strided (2-D) copies between pinned host memory and the
device, ordered on a side stream, bit for bit; a bad copy raises and leaves CUDA usable."""

from __future__ import annotations

import pytest
import torch

from tierkv import dma

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
