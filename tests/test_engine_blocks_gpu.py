"""The vLLM connector's worker path on a GPU, without vLLM (the H200 has none): vLLM 0.32's CUDA
page tensors (per layer [N, H, B, 2D], K then V in the last axis, views of one backing buffer in
its LBNHC and LBHNC orders) as an engine-owned L1, an L2 in a shared memory file that the
"worker" maps and pins (HostPool.attach), and the decider's recorded copies run on them: a block
saved from one engine block and loaded into another arrives bit for bit, in both orders."""

from __future__ import annotations

import os

import pytest
import torch

from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.layout import stored_layout
from tierkv.recorded_moves import L1_TO_L2, L2_TO_L1, run_moves
from tierkv.tiers import DevicePool, HostPool
from tierkv.transfer import BlockMover

pytestmark = pytest.mark.gpu
LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)


def vllm_pages(order: str, blocks: int) -> dict[str, torch.Tensor]:
    """Per-layer views [N, H, B, 2D] of one backing buffer, as vLLM 0.32's allocator makes them."""
    L, _, B, H, D = LAYOUT.block_shape
    if order == "LBNHC":  # FlashAttention's default: tokens outer
        backing = torch.randn(L, blocks, B, H, 2 * D, dtype=LAYOUT.dtype, device="cuda")
        return {f"layer.{i}": backing[i].transpose(1, 2) for i in range(L)}
    backing = torch.randn(L, blocks, H, B, 2 * D, dtype=LAYOUT.dtype, device="cuda")  # LBHNC: heads outer
    return {f"layer.{i}": backing[i] for i in range(L)}


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC"])
def test_vllm_cuda_pages_round_trip_through_a_pinned_shared_l2(order, tmp_path):
    shm = f"/dev/shm/tierkv-gpu-test-{os.getpid()}-{order}"
    blocks, prompt = 64, list(range(1000, 1000 + 16 * 10 + 3))  # 10 full blocks
    decider = TieredKVCache(LAYOUT, CacheConfig(l2=32 * LAYOUT.bytes_per_block, l2_file=shm), model="m",
                            engine_blocks=blocks)
    try:
        round_trip(decider, shm, order, blocks, prompt)
    finally:
        decider.close()
    assert not os.path.exists(shm)


def round_trip(decider: TieredKVCache, shm: str, order: str, blocks: int, prompt: list[int]) -> None:
    pages = vllm_pages(order, blocks)
    worker = BlockMover(DevicePool.of_buffers(LAYOUT, pages, "vllm_paged"),
                        HostPool.attach(stored_layout(LAYOUT, None), shm))
    assert worker.l2.pinned  # cudaHostRegister took the shared mapping

    def run(kind: int) -> None:
        number, moves = decider.take_moves()
        run_moves(worker, moves, kinds=(kind,)).synchronize()
        decider.moves_done(number)

    first = list(range(3, 3 + 11))
    seq = decider.allocate(prompt, slots=first)
    decider.commit(seq, prompt)
    run(L1_TO_L2)
    decider.free(seq)
    k = {n: t[first[:10], :, :, : LAYOUT.head_dim].clone() for n, t in pages.items()}
    v = {n: t[first[:10], :, :, LAYOUT.head_dim :].clone() for n, t in pages.items()}
    other = list(range(40, 51))
    seq = decider.allocate(prompt, slots=other)
    assert seq.num_cached_tokens == 160 and seq.cached_by_tier["l2"] == 160
    run(L2_TO_L1)
    for n, t in pages.items():
        assert torch.equal(t[other[:10], :, :, : LAYOUT.head_dim], k[n])
        assert torch.equal(t[other[:10], :, :, LAYOUT.head_dim :], v[n])
    decider.free(seq)
