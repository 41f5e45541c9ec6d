"""What crosses vLLM's process boundary each step, both ways: plain lists of ints (vLLM pickles
them into its workers' queue), never tensors.

StepWork goes scheduler -> workers: the batch of L1<->L2 copies tierkv recorded this step, the
requests whose asynchronous (L3) load ends with it, and the blocks that could not be loaded.
CopiesDone comes back: the last batch every worker ran.

vLLM only duck-types these (it stores the one and calls `aggregate` on the other), so they do
not subclass its marker classes: the worker side then runs without vLLM (the H200 harness,
benchmarks/bench_vllm_worker.py, drives it there).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepWork:  # vLLM's KVConnectorMetadata
    batch: int = -1  # the batch number (TieredKVCache.take_moves); -1: none
    moves: list[tuple[int, list[int], list[int]]] = field(default_factory=list)  # (kind, src, dst)
    loaded_async: list[str] = field(default_factory=list)  # requests whose L3 load ends with this batch
    load_errors: list[int] = field(default_factory=list)  # vLLM block ids promised and not loaded


@dataclass
class CopiesDone:  # vLLM's KVConnectorWorkerMetadata
    batch: int  # every batch up to this one has been run, on every worker that reported

    def aggregate(self, other: CopiesDone) -> CopiesDone:
        return CopiesDone(min(self.batch, other.batch))  # done only where every rank is done
