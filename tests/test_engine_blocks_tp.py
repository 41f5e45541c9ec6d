"""Tensor parallelism where the engine owns L1 (the vLLM connector's layout): the decider's L2
slots hold whole-model blocks, and each rank copies its own KV heads into its slice of them
(HostPool.attach(heads=)). Blocks two ranks saved load back, head for head, into one engine of
every head (TP=1), and the reverse: tensor-parallel sizes share L2 and L3."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from tierkv import CacheConfig, KVLayout, TieredKVCache
from tierkv.recorded_moves import L1_TO_L2, L2_TO_L1, run_moves
from tierkv.tiers import DevicePool, HostPool
from tierkv.transfer import BlockMover

WHOLE = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype=torch.float32)
BLOCKS = 16


def engine(tp: int, rank: int, shm: str) -> tuple[dict[str, torch.Tensor], BlockMover]:
    """One rank's vLLM CPU pages [N, H/tp, B, 2D] per layer and the mover over its L2 slice."""
    h = WHOLE.num_kv_heads // tp
    pages = {f"l{i}": torch.randn(BLOCKS, h, WHOLE.block_size, 2 * WHOLE.head_dim) for i in range(WHOLE.num_layers)}
    l1 = DevicePool.of_buffers(replace(WHOLE, num_kv_heads=h), pages, "vllm_cpu")
    heads = (rank * h, (rank + 1) * h) if tp > 1 else None
    return pages, BlockMover(l1, HostPool.attach(WHOLE, shm, heads=heads), warm_up=False)


def run(cache: TieredKVCache, movers: list[BlockMover], kind: int) -> None:
    number, moves = cache.take_moves()
    for mover in movers:
        run_moves(mover, moves, kinds=(kind,))
    cache.moves_done(number)


def test_two_ranks_save_one_block_that_a_single_rank_engine_loads_and_back(tmp_path):
    shm = f"/dev/shm/tierkv-tp-test-{os.getpid()}"
    cache = TieredKVCache(WHOLE, CacheConfig(l2=32 * WHOLE.bytes_per_block, l2_file=shm), model="m",
                          engine_blocks=BLOCKS)
    try:
        tokens = list(range(100, 100 + 4 * 3 + 1))  # 3 full blocks
        ranks = [engine(2, r, shm) for r in range(2)]
        seq = cache.allocate(tokens, slots=[1, 2, 3, 4])
        cache.commit(seq, tokens)
        run(cache, [m for _, m in ranks], L1_TO_L2)
        cache.free(seq)
        # what the two ranks held, heads side by side: rank 0 heads 0-1, rank 1 heads 2-3
        want = {n: torch.cat([pages[n][[1, 2, 3]] for pages, _ in ranks], dim=1) for n in ranks[0][0]}

        single, mover = engine(1, 0, shm)
        seq = cache.allocate(tokens, slots=[5, 6, 7, 8])
        assert seq.num_cached_tokens == 12
        run(cache, [mover], L2_TO_L1)
        for n in single:
            assert torch.equal(single[n][[5, 6, 7]], want[n])
        cache.free(seq)

        # the reverse: a block the single engine saved loads into the two ranks, each its heads
        other = list(range(500, 513))
        seq = cache.allocate(other, slots=[9, 10, 11, 12])
        cache.commit(seq, other)
        run(cache, [mover], L1_TO_L2)
        cache.free(seq)
        seq = cache.allocate(other, slots=[13, 14, 15, 0])
        run(cache, [m for _, m in ranks], L2_TO_L1)
        for r, (pages, _) in enumerate(ranks):
            for n in pages:
                assert torch.equal(pages[n][[13, 14, 15]], single[n][[9, 10, 11]][:, 2 * r : 2 * r + 2])
        cache.free(seq)
    finally:
        cache.close()
