"""Tensor-parallel ranks 1..N-1: started, driven and stopped by rank 0, the user's process.

Rank 0 runs the whole engine: scheduler, cache decisions, sampling. `Workers` spawns one process
per other rank (torch.multiprocessing, spawn: CUDA cannot be forked) and joins them in a process
group: NCCL on GPUs (gloo on CPU) for the model's collectives, and a gloo group beside it for
control (StepPlans, sizes, stats), which never waits on a GPU. A worker loads its shard of the
model, builds its own cache (the same L1/L2 block counts, its own KV heads, no L3; a cache per
layer group where rank 0 has one, with rank 0's split of L1) and runner, then repeats every
StepPlan rank 0 sends until it is told to stop. With an L3, the workers' heads of the blocks
rank 0 writes and reads pass through shared memory, paced by two more gloo groups for each of
rank 0's caches (head_exchange.py).

A failure ends every rank. A worker that raises sends its traceback to rank 0 and exits; rank 0's
next collective with it fails, and rank 0 raises TensorParallelError naming the rank and stops
the others. A worker whose parent is gone exits on its own (a thread watches the parent's pid),
so no rank outlives the user's process, however that process ends. This file never schedules
and never samples.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import ConfigError, TensorParallelError
from ..groups import caches_of, make_cache
from ..heads import HeadSplit
from ..layout import KVLayout, OffloadLayout
from ..tiering import default_l1_bytes
from ..tiers.pool import blocks_for
from .config import EngineConfig
from .head_exchange import HeadExchange, HeadFollower, create_staging, open_staging, staging_dir
from .parallel import TensorParallel, init_process_group
from .step_plan import MOVES, STATS, STEP, STOP, StepPlan

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # a worker that has not reached the rendezvous by then (import, spawn) failed
STOP_TIMEOUT_S = 10.0  # then a worker that has not exited is terminated
PARENT_POLL_S = 0.5
_UNSET = 2**62  # what a worker contributes to a size only rank 0 decides (the MIN picks rank 0's)


def rank_device(device: str | None, rank: int) -> torch.device:
    """Rank `rank`'s device: cuda:rank on GPUs, the CPU otherwise. TP on GPUs takes every GPU from
    0 up, so a device other than "cuda" is refused (ConfigError, saying what to change)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device) == "cpu":
        return torch.device("cpu")
    if str(device) != "cuda":
        raise ConfigError(f"tensor parallelism runs rank r on cuda:r, so device must be 'cuda' (or unset), "
                          f"not {device!r}; choose the GPUs with CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", rank)


def own_l1_blocks(config: EngineConfig, layout: KVLayout, device: torch.device) -> int:
    """L1 blocks this rank could hold: config.l1, or the default for the memory its shard left."""
    l1 = config.cache_config().l1  # bytes (parsed), or None
    return blocks_for(l1 if l1 is not None else default_l1_bytes(device), layout.bytes_per_block, "l1")


def agree_sizes(control: dist.ProcessGroup, l1_blocks: int, l2_bytes: int = _UNSET, max_model_len: int = _UNSET,
                max_tokens: int = _UNSET) -> tuple[int, int, int, int]:
    """What every rank uses: the fewest L1 blocks any rank can hold (ranks hold the same slots),
    and rank 0's L2 bytes, max_model_len and max_num_batched_tokens (the others leave them
    _UNSET, which the minimum passes over)."""
    t = torch.tensor([l1_blocks, l2_bytes, max_model_len, max_tokens], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)
    return tuple(t.tolist())


class Workers:
    """Rank 0's handle on the other ranks: start, send plans, read stats, stop."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        self.size, self.closed = size, False
        self.serving = False  # every worker built its part and waits for plans (see `ready`)
        # cache -> its L1/L2 moves sent in plans so far (an L3 job's ticket counts them)
        self.moves_sent: dict[int, int] = {}
        self._has_l3 = bool(config.l3)
        self.l3_groups: list[tuple] = []  # each cache's put and get groups (`share_l1_split`)
        device = rank_device(config.device, 0)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ConfigError(f"tensor_parallel_size {size} needs {size} GPUs, but {torch.cuda.device_count()} "
                              f"are visible; lower it to {torch.cuda.device_count()} or less")
        if dist.is_initialized():
            raise ConfigError("tensor parallelism starts its own torch.distributed process group, but this "
                              "process has one already: create the engine before init_process_group, or "
                              "in another process")
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="tierkv-tp-")
        init_file = os.path.join(self._dir, "rendezvous")
        self._staging = staging_dir(init_file)  # shared memory for L3's KV heads (head_exchange.py)
        self._messages = ctx.Queue()  # (rank, "joining" | "error", text) from the workers
        self.procs = [
            ctx.Process(target=_worker_main, name=f"tierkv-tp-rank{rank}", daemon=True,
                        args=(rank, size, init_file, config, self._messages, os.getpid()))
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        atexit.register(self.close)  # runs before multiprocessing's own exit hook terminates them
        try:
            self._wait_joining()
            self.tp = init_process_group(0, size, init_file, device)
            self.control = dist.new_group(backend="gloo")
        except BaseException:
            self.close()
            raise

    def _wait_joining(self) -> None:
        """Wait until every worker reaches the rendezvous (or fails on the way: import, device)."""
        joining, end = set(), time.monotonic() + STARTUP_TIMEOUT_S
        while len(joining) < len(self.procs):
            try:
                rank, kind, text = self._messages.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > end or any(not p.is_alive() for p in self.procs):
                    # without a traceback the usual cause is a script's top level run again by the rank
                    raise self._failure(unexplained=" before it started; a script that uses tensor_parallel_size > 1 "
                                        "must guard its top level with `if __name__ == \"__main__\":`") from None
                continue
            if kind == "error":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed while starting:\n{text}")
            joining.add(rank)

    # ------------------------------------------------------------------ talking to the workers

    def agree_sizes(self, l1_blocks: int, l2_bytes: int, max_model_len: int, max_tokens: int) -> tuple[int, ...]:
        return self._guard(agree_sizes, self.control, l1_blocks, l2_bytes, max_model_len, max_tokens)

    def share_l1_split(self, blocks: list[int] | None) -> None:
        """Tell the workers how rank 0 splits L1 among the model's layer groups (None: one cache),
        and make each cache's L3 groups with them."""
        self._guard(_broadcast, torch.tensor([-1] if blocks is None else blocks, dtype=torch.int64), self.control)
        self.l3_groups = self._guard(_l3_groups, self._has_l3, 1 if blocks is None else len(blocks))

    def agree_l2_blocks(self, cache) -> None:
        self._guard(agree_l2_blocks, self.control, cache)

    def ready(self) -> None:
        """Wait until every worker has built its cache and runner (after rank 0 built its own)."""
        self._guard(dist.barrier, group=self.control)
        self.serving = True
        shutil.rmtree(self._staging, ignore_errors=True)  # every rank mapped its staging: drop the names

    def send(self, plan: StepPlan) -> None:
        """Broadcast `plan` to every worker (they repeat it); raises TensorParallelError if one died."""
        if any(not p.is_alive() for p in self.procs):
            raise self._failure()
        data = torch.from_numpy(plan.encode())
        self._guard(_broadcast, data, self.control)
        for cache, moves in enumerate(plan.moves):
            self.moves_sent[cache] = self.moves_sent.get(cache, 0) + len(moves)

    def send_moves(self, moves: list, cache: int = 0) -> int:
        """Send cache `cache`'s `moves` now, without a step; returns how many moves of that cache
        the workers have been sent in all."""
        if moves:
            self.send(StepPlan(MOVES, moves=[[] for _ in range(cache)] + [moves]))
        return self.moves_sent.get(cache, 0)

    def l3_exchange(self, whole: KVLayout | OffloadLayout, cache: int = 0) -> HeadExchange:
        """Rank 0's way to the workers' KV heads of cache `cache`'s blocks of `whole` (every
        head), for L3 I/O: its own staging and L3 groups, so that the caches' L3 threads never
        meet in one collective."""
        heads = (whole.kv if isinstance(whole, OffloadLayout) else whole).num_kv_heads
        split = HeadSplit(whole, [TensorParallel(r, self.size).kv_heads(heads) for r in range(self.size)])
        return HeadExchange(split, functools.partial(self.send_moves, cache=cache), *self.l3_groups[cache],
                            create_staging(self._staging, split, cache))

    def stats(self) -> list[dict]:
        """Each worker's cache stats (ranks 1..N-1, in order)."""
        self.send(StepPlan(STATS))
        return [json.loads(bytes(self._guard(_recv_bytes, rank, self.control)).decode()) for rank in range(1, self.size)]

    def _guard(self, fn, *args, **kwargs):
        """Run a collective with the workers; a worker that died turns its failure into TensorParallelError."""
        try:
            return fn(*args, **kwargs)
        except TensorParallelError:
            raise
        except Exception as e:  # gloo raises RuntimeError / DistBackendError when a peer is gone
            raise self._failure() from e

    def _failure(self, unexplained: str = "") -> TensorParallelError:
        """Why a worker stopped (its traceback when it sent one; else its exit code and
        `unexplained`), after stopping the others."""
        reason, end = None, time.monotonic() + 5.0
        while reason is None and time.monotonic() < end:
            try:
                rank, kind, text = self._messages.get(timeout=0.2)
            except queue.Empty:
                if all(p.is_alive() for p in self.procs):
                    continue
                dead = next(p for p in self.procs if not p.is_alive())
                reason = f"tensor-parallel {dead.name} exited with code {dead.exitcode}{unexplained}"
                continue
            if kind == "error":
                reason = f"tensor-parallel rank {rank} failed:\n{text}"
        self.close()
        return TensorParallelError(reason or "a tensor-parallel rank stopped answering")

    def close(self) -> None:
        """Stop every worker (politely, then by force) and leave the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        # A stop plan only reaches workers that wait for one; any other is terminated below.
        if self.serving and all(p.is_alive() for p in self.procs):
            try:
                _broadcast(torch.from_numpy(StepPlan(STOP).encode()), self.control)
            except Exception:  # a worker is gone already: the ones left are terminated below
                pass
        end = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)
        shutil.rmtree(self._staging, ignore_errors=True)


def agree_l2_blocks(control: dist.ProcessGroup, cache) -> None:
    """After every rank built its cache: each of its caches uses as many L2 slots as that cache
    of the rank with the fewest (a rank whose pinning fell short holds fewer than the bytes
    agreed, and slots must mirror)."""
    caches = caches_of(cache)
    n = torch.tensor([c.l2.num_blocks if c.l2 is not None else 0 for c in caches], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=control)
    for c, blocks in zip(caches, n.tolist()):
        if c.l2 is not None:
            c.l2.limit(blocks)


def _l3_groups(has_l3: bool, caches: int) -> list[tuple]:
    """Each cache's put and get groups of head_exchange.py (every rank makes them, in this order);
    none without an L3."""
    return [(dist.new_group(backend="gloo"), dist.new_group(backend="gloo")) if has_l3 else (None, None)
            for _ in range(caches)]


def _broadcast(data: torch.Tensor, control: dist.ProcessGroup) -> None:
    """Rank 0's side of `_receive`: the length, then the int64 payload."""
    dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0, group=control)
    dist.broadcast(data, 0, group=control)


def _receive_array(control: dist.ProcessGroup) -> torch.Tensor:
    """A worker's side of `_broadcast`: the int64 payload."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, 0, group=control)
    data = torch.empty(int(n), dtype=torch.int64)
    dist.broadcast(data, 0, group=control)
    return data


def _receive(control: dist.ProcessGroup) -> StepPlan:
    return StepPlan.decode(_receive_array(control).numpy())


def _send_bytes(payload: bytes, control: dist.ProcessGroup) -> None:
    dist.send(torch.tensor([len(payload)], dtype=torch.int64), 0, group=control)
    dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=control)


def _recv_bytes(rank: int, control: dist.ProcessGroup) -> torch.Tensor:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, rank, group=control)
    out = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(out, rank, group=control)
    return out.numpy()


# ---------------------------------------------------------------------- the worker process


def _worker_main(rank: int, size: int, init_file: str, config: EngineConfig, messages, parent: int) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="tierkv-parent-watch").start()
    try:
        _serve(rank, size, init_file, config, messages)
    except BaseException:
        messages.put((rank, "error", traceback.format_exc()))
        messages.close()
        messages.join_thread()  # the traceback must reach rank 0 before this process ends
        os._exit(1)


def _exit_with_parent(parent: int) -> None:
    """End this worker once rank 0's process is gone (killed, crashed), whatever it is doing."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def _serve(rank: int, size: int, init_file: str, config: EngineConfig, messages) -> None:
    from .loader import load_model
    from .runner import ModelRunner

    device = rank_device(config.device, rank)
    messages.put((rank, "joining", ""))
    tp = init_process_group(rank, size, init_file, device)
    control = dist.new_group(backend="gloo")
    lm = load_model(config.model, device=device, dtype=config.dtype, cache_dir=config.cache_dir, tp=tp)
    layout = lm.kv_layout(config.block_size)
    l1_blocks, l2_bytes, max_model_len, max_tokens = agree_sizes(control, own_l1_blocks(config, layout, device))
    has_l3 = bool(config.l3)
    config = dataclasses.replace(config, l1=l1_blocks * layout.bytes_per_block, l2=l2_bytes, l3=(),
                                 max_model_len=max_model_len, max_num_batched_tokens=max_tokens)
    split = _receive_array(control).tolist()  # rank 0's L1 blocks of each layer group's cache; [-1]: one cache
    blocks = None if split == [-1] else split
    l3_groups = _l3_groups(has_l3, 1 if blocks is None else len(blocks))
    cache = make_cache(layout, config.cache_config(), device=device, model=lm.fingerprint, blocks=blocks, tp_rank=rank)
    agree_l2_blocks(control, cache)
    runner = ModelRunner(lm, cache, config)
    # each cache repeats its own moves; with an L3 (rank 0's), its moves wait where a read lands,
    # and two threads of its own serve the reads and writes of its heads
    caches = caches_of(cache)
    replays = [c.tiers.replay for c in caches]
    if has_l3:
        shm = staging_dir(init_file)
        replays = [HeadFollower(c.tiers, *groups, open_staging(shm, rank, c.l2.layout.bytes_per_block, i)).replay
                   for i, (c, groups) in enumerate(zip(caches, l3_groups))]
    dist.barrier(group=control)  # ready: rank 0 built its own
    while True:
        plan = _receive(control)
        for replay, moves in zip(replays, plan.moves):
            replay(moves)
        if plan.kind == STEP:
            runner.run_plan(plan)
        elif plan.kind == STATS:
            _send_bytes(json.dumps(cache.stats()).encode(), control)
        elif plan.kind == STOP:
            break
    cache.close()
    # The process ends here without tearing the process group down: a gloo rank destroyed
    # while its peers go can abort in a C++ destructor (seen in a 4-rank test). Exiting closes
    # the sockets; rank 0 leaves the group once every worker has exited (Workers.close).
    os._exit(0)

