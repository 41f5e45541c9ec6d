"""Triton upload: a step's host arrays into their device buffers, read by the GPU's own loads.

Before every step the engine sends its inputs (token ids, positions, slots, block tables: a few KB
to a few MB). Copied by cudaMemcpyAsync they go through the copy engines, which serve them after
the DMA in flight there: beside an L2 load's chunks such a copy started ~1.1 ms late on average
(H100, bench_rounds' trace at 4b5c5db: 180 copies, median 29 us, mean 1.13 ms, against a 2 us
median with no DMA), and the step waited with it. Here the SMs load the pinned host arrays through
unified addressing, so no copy engine is involved, every array of a step in one launch
(UploadTable: the pairs' addresses and the per-pair word counts, which the kernel reads from the
pinned header as it runs). This file moves bytes only; it never decides what to upload.
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl

from ._launch import check_triton_device
from .upload_table import UploadTable

BLOCK_WORDS = 1024  # int32 words a program loads at once (4 KiB): a few round trips over PCIe per array
MAX_PARTS = 32  # programs per pair at most: a long block table is read by several side by side


@triton.jit(do_not_specialize=["num_pairs"])
def _upload_kernel(Ptrs, num_pairs, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    counts = tl.load(Ptrs + 2 * num_pairs).to(tl.pointer_type(tl.int64))
    n = tl.load(counts + pair)                                  # int32 words this pair copies now
    src = tl.load(Ptrs + pair).to(tl.pointer_type(tl.int32))
    dst = tl.load(Ptrs + num_pairs + pair).to(tl.pointer_type(tl.int32))
    for start in tl.range(tl.program_id(1) * BLOCK, n, tl.num_programs(1) * BLOCK):
        offs = start + tl.arange(0, BLOCK)                      # [BLOCK]
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def upload(table: UploadTable, counts: Sequence[int]) -> None:
    """targets[i][:counts[i]] = sources[i][:counts[i]] for every pair, ordered on the current stream;
    the sources are read when the kernel runs, not now."""
    counts = table.set_counts(counts)
    check_triton_device(table.targets[0])
    words = max(n * (s.element_size() // 4) for n, s in zip(counts, table.sources))
    if words == 0:
        return
    parts = min(MAX_PARTS, triton.cdiv(words, BLOCK_WORDS))
    _upload_kernel[(len(table), parts)](table.ptrs, len(table), BLOCK=BLOCK_WORDS, num_warps=4)
