"""Moves blocks between L2 (the host pool) and L3 (the stores), off the engine's thread.

One writer and one reader thread call the stores' batched, internally parallel APIs on L2 slots
that the caller holds for them, and post each finished job to a queue the caller drains (a long
queue of writes never delays a read). Under tensor parallelism (an `exchange`,
engine/head_exchange.py) the stores take whole-model blocks: a write joins the other ranks' KV
heads of its slots to this rank's, and a read splits what it read and hands the other ranks
their heads. This file decides nothing about which blocks move, and never touches the index.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .tiers import HostPool
from .tiers.codec import BlockId
from .tiers.l3 import L3Store
from .transfer import Transfer

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class L3Job:
    """One batch of L3 reads or writes on L2 slots; `ok` and `finished` are set by the worker thread."""

    kind: str  # "put" or "get"
    ids: list[BlockId]
    slots: list[Any]  # the L2 slots read from (put) or written into (get), one per id; put: or a host block
    entries: list[Any] = field(default_factory=list)  # put: the caller's records of these blocks
    held: list[Any] = field(default_factory=list)  # put: the entries the caller holds in L2 until done
    priority: int = 0
    ticket: int | None = None  # tensor parallel: the moves the other ranks must repeat first (exchange)
    number: int = 0  # get: 1 for the mover's first read, 2 for the next...
    ok: list[bool] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    landed: bool = False  # get: set by the caller once it has indexed the blocks


class L3Mover:
    def __init__(self, stores: list[L3Store], l2: HostPool, exchange=None) -> None:
        self.stores, self.l2, self.exchange = stores, l2, exchange
        self.gets = 0  # reads submitted so far (numbers them)
        # One thread each way: a long queue of writes never delays a read. Each call fans out
        # inside the store (its own thread pool), so one thread here is enough to fill the link.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierkv-l3-put")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierkv-l3-get")
        self._finished: queue.SimpleQueue[L3Job] = queue.SimpleQueue()
        self._signal = threading.Event()
        self.in_flight = 0  # jobs submitted and not yet returned by finished_jobs()
        # blocks submitted to read and not yet returned: a new read lands after them (one reader)
        self.queued_reads = 0

    @property
    def chunk_blocks(self) -> int:
        """Blocks of the largest chunk object among the stores: writes are grouped up to it."""
        return max(store.chunk_blocks for store in self.stores)

    def contains(self, hashes: list[int], first_pos: int = 0) -> list[bool]:
        """Which `hashes` (a chain's blocks from position `first_pos`) some store holds: one
        batched query per store, for what earlier ones lacked. Called on the engine's thread, so
        each store answers within its `lookup_timeout` or not at all (a miss: l3.py)."""
        found = [False] * len(hashes)
        for store in self.stores:
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            # a later store is asked about the chain from the first block that earlier ones lack
            start = todo[0]
            hits = store.contains_many(hashes[start:], first_pos + start, store.lookup_timeout)
            for i, hit in enumerate(hits, start):
                found[i] = found[i] or hit
        return found

    def put(self, ids: list[BlockId], slots: list[Any], after: Transfer, entries: list[Any],
            ticket: int | None = None) -> L3Job:
        """Write L2 `slots` (or host blocks) to every store once `after` (the copy that filled them) is complete."""
        job = L3Job("put", ids, slots, entries, ticket=ticket)
        self.in_flight += 1
        self._writer.submit(self._run, job, self._put, after)
        return job

    def get(self, ids: list[BlockId], slots: list[int], deadline: float | None, priority: int = 0,
            ticket: int | None = None) -> L3Job:
        """Read blocks into L2 `slots`, trying the stores in order; what is not read by `deadline` misses."""
        self.gets += 1
        job = L3Job("get", ids, slots, priority=priority, ticket=ticket, number=self.gets)
        self.in_flight += 1
        self.queued_reads += len(ids)
        self._reader.submit(self._run, job, self._get, deadline)
        return job

    def _run(self, job: L3Job, work, arg) -> None:
        try:
            job.ok = work(job, arg)
        except Exception:  # stores never raise on I/O; this is a bug, but it must not lose the job
            log.exception("L3 %s of %d blocks failed", job.kind, len(job.ids))
            job.ok = [False] * len(job.ids)
        job.finished.set()
        self._finished.put(job)
        self._signal.set()

    def _put(self, job: L3Job, after: Transfer) -> list[bool]:
        after.synchronize()
        if self.exchange is not None:  # whole-model blocks [n, bytes]: every rank's heads of the slots
            bufs = list(self.exchange.gather(self.l2.rows[torch.tensor(job.slots)], job.slots, job.ticket))
        else:
            bufs = [self.l2.kv[s] if isinstance(s, int) else s for s in job.slots]  # [layers, 2, bs, h, d] each, contiguous
        ok = [False] * len(job.ids)
        for store in self.stores:
            ok = [a or b for a, b in zip(ok, store.put_many(job.ids, bufs))]
        return ok

    def _get(self, job: L3Job, deadline: float | None) -> list[bool]:
        if self.exchange is None:
            return self.read(job.ids, [self.l2.kv[s] for s in job.slots], deadline)
        # whole-model blocks [n, bytes] land here, then each rank takes its heads (this one too)
        blocks = torch.zeros((len(job.ids), self.exchange.split.whole.bytes_per_block), dtype=torch.uint8)
        try:
            return self.read(job.ids, list(blocks), deadline)
        finally:  # read or not, the other ranks wait for this read's pieces: always send them
            self.l2.rows[torch.tensor(job.slots)] = self.exchange.scatter(blocks, job.slots, job.ticket, job.number)

    def read(self, ids: list[BlockId], bufs: list[torch.Tensor], deadline: float | None) -> list[bool]:
        """Read `ids` into `bufs` (contiguous host blocks) in the calling thread, trying the stores in order."""
        ok = [False] * len(ids)
        for store in self.stores:
            todo = [i for i, hit in enumerate(ok) if not hit]
            if not todo:
                break
            got = store.get_many([ids[i] for i in todo], [bufs[i] for i in todo], deadline)
            for i, hit in zip(todo, got):
                ok[i] = hit
        return ok

    def finished_jobs(self) -> list[L3Job]:
        jobs = []
        while True:
            try:
                jobs.append(self._finished.get_nowait())
            except queue.Empty:
                self.in_flight -= len(jobs)
                self.queued_reads -= sum(len(job.ids) for job in jobs if job.kind == "get")
                return jobs

    def wait_any(self, timeout: float | None) -> None:
        """Return once a job has finished since the last finished_jobs() (or after `timeout`)."""
        if self._finished.empty():
            self._signal.wait(timeout)
        self._signal.clear()

    def estimate_seconds(self, num_blocks: int) -> float:
        """Expected seconds to read `num_blocks` from the first store (where reads go first), after
        the reads queued before them: under load, load-or-recompute then sees a busy disk as
        slow (it had counted each read as if it had the disk alone, and requests queued on a
        saturated one while the GPU idled: long-doc, H200)."""
        return self.stores[0].estimate_load_seconds(self.queued_reads + num_blocks)

    @property
    def read_measured(self) -> bool:
        """Whether reads from the first store have been timed (estimate_seconds is then measured)."""
        return self.stores[0].read_measured

    def stats(self) -> list[dict]:
        return [store.stats() for store in self.stores]

    def close(self) -> None:
        """Finish queued work, then close the stores."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        for store in self.stores:
            store.close()
