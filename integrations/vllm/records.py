"""What crosses vLLM's process boundary each step, both ways: plain lists of ints (vLLM pickles
them into its workers' queue), never tensors.

StepWork goes scheduler -> workers: the batch of L1<->L2 copies tierkv recorded this step (one
list per vLLM KV-cache group: each group's blocks have ids of their own), the requests whose
asynchronous load ends with it, and what could not be loaded: block ids where vLLM has one
KV-cache group, whole requests where it has several (it takes no block ids then: they are not
unique across groups).
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
    # per KV-cache group: its (kind, src, dst) copies
    moves: list[list[tuple[int, list[int], list[int]]]] = field(default_factory=list)
    loaded_async: list[str] = field(default_factory=list)  # requests whose asynchronous load ends with this batch
    load_errors: list[int] = field(default_factory=list)  # vLLM block ids promised and not loaded (one group)
    failed_async: list[str] = field(default_factory=list)  # of loaded_async, those not loaded whole (groups)


@dataclass
class CopiesDone:  # vLLM's KVConnectorWorkerMetadata
    batch: int  # every batch up to this one has been run, on every worker that reported

    def aggregate(self, other: CopiesDone) -> CopiesDone:
        return CopiesDone(min(self.batch, other.batch))  # done only where every rank is done
