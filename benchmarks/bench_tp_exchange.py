"""bench_tp_exchange: how fast L3 blocks cross between tensor-parallel ranks (CPU, gloo, 2 processes).

Under tensor parallelism rank 0 does all L3 I/O in whole-model blocks; the other ranks' KV heads
of every block written or read pass through shared-memory staging, paced by gloo on loopback
(tierkv/engine/head_exchange.py). This runs that code itself, HeadExchange on rank 0 against
HeadFollower on rank 1 (a real Tiering with an L2 pool), for Llama-3.1-8B blocks (2 MiB whole,
1 MiB a rank at TP=2): a write's gather (rank 1's pieces in, joined) and a read's scatter (split,
rank 1's pieces out). The figure is
whole-model GB/s, against this host's single-thread memcpy of the same bytes in the same run (the
copy every block needs anyway). Writes benchmarks/results/bench_tp_exchange-<h200|cpu>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from shapes import LLAMA_3_1_8B  # noqa: E402

from tierkv.config import CacheConfig  # noqa: E402
from tierkv.engine.head_exchange import (  # noqa: E402
    HeadExchange,
    HeadFollower,
    create_staging,
    open_staging,
    staging_dir,
)
from tierkv.engine.parallel import TensorParallel  # noqa: E402
from tierkv.heads import HeadSplit  # noqa: E402
from tierkv.tiering import Tiering  # noqa: E402

WHOLE = LLAMA_3_1_8B


def split(size: int) -> HeadSplit:
    return HeadSplit(WHOLE, [TensorParallel(r, size).kv_heads(WHOLE.num_kv_heads) for r in range(size)])


def rank_main(rank: int, size: int, init: str, blocks: int, rounds: int, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    groups = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    s = split(size)
    config = CacheConfig(l1=s.part.bytes_per_block, l2=blocks * s.part.bytes_per_block)
    tiering = Tiering(s.part, config, torch.device("cpu"))
    slots = list(range(blocks))
    shm = staging_dir(init)  # /dev/shm, as the engine's
    staging = create_staging(shm, s) if rank == 0 else None
    dist.barrier()  # rank 0 made the staging files
    if rank:
        # serves on its threads until rank 0 is done
        HeadFollower(tiering, *groups, open_staging(shm, rank, s.part.bytes_per_block))
        dist.barrier()
        dist.barrier()
        os._exit(0)
    exchange = HeadExchange(s, lambda moves: 0, *groups, staging)
    own = tiering.l2.rows[: blocks].clone()
    whole = torch.randint(0, 255, (blocks, WHOLE.bytes_per_block), dtype=torch.uint8)
    dist.barrier()
    times = {"gather": [], "scatter": [], "memcpy": []}
    for _ in range(rounds):
        t = time.perf_counter()
        exchange.gather(own, slots, 0)
        times["gather"].append(time.perf_counter() - t)
        t = time.perf_counter()
        exchange.scatter(whole, slots, 0, 1)
        times["scatter"].append(time.perf_counter() - t)
        copy = torch.empty_like(whole)
        t = time.perf_counter()
        copy.copy_(whole)
        times["memcpy"].append(time.perf_counter() - t)
    nbytes = blocks * WHOLE.bytes_per_block
    results.put({k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()})
    shutil.rmtree(shm, ignore_errors=True)
    dist.barrier()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256, help="2 MiB blocks per exchange (256: 512 MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=2, help="ranks")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = os.path.join(tempfile.mkdtemp(prefix="tierkv-bench-tp-"), "rendezvous")
    procs = [ctx.Process(target=rank_main, args=(r, a.size, init, a.blocks, a.rounds, results)) for r in range(a.size)]
    for p in procs:
        p.start()
    gbps = results.get(timeout=600)
    for p in procs:
        p.join(60)
    figures = dict(
        workload=dict(layout=WHOLE.fingerprint, ranks=a.size, blocks=a.blocks, rounds=a.rounds,
                      bytes_per_exchange=a.blocks * WHOLE.bytes_per_block),
        whole_model_gbps=dict(write_gather=gbps["gather"], read_scatter=gbps["scatter"]),
        memcpy_gbps=gbps["memcpy"],
        over_memcpy=dict(write_gather=gbps["gather"] / gbps["memcpy"], read_scatter=gbps["scatter"] / gbps["memcpy"]),
    )
    print(f"TP={a.size} L3 exchange, {a.blocks} blocks of {WHOLE.bytes_per_block >> 20} MiB: write (gather) "
          f"{gbps['gather']:.2f} GB/s, read (scatter) {gbps['scatter']:.2f} GB/s; memcpy {gbps['memcpy']:.2f} GB/s")
    print("wrote", write_results("bench_tp_exchange", figures, Path(a.out) if a.out else None))


if __name__ == "__main__":
    main()
