"""Moves blocks between L2 (the host pool) and L3 (the stores), off the engine's thread.

One writer and one reader thread call the stores' batched, internally parallel APIs on L2 slots
that the caller holds for them, and post each finished job to a queue the caller drains (a long
queue of writes never delays a read). Writes go in pieces, each started only when no read is in
flight (or after WRITE_YIELD_S): a request waits for a read, while a write only frees L2, and
on one device a write running beside a read slows it. A read is estimated when it is queued (behind the reads
ahead of it), read in pieces so that it can be abandoned between them, and timed: the last reads'
estimate against actual time is kept for the cache's stats. Under tensor parallelism (an `exchange`,
engine/head_exchange.py) the stores take whole-model blocks: a write joins the other ranks' KV
heads of its slots to this rank's, and a read splits what it read and hands the other ranks
their heads. This file decides nothing about which blocks move, and never touches the index.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .tiers import HostPool
from .tiers.codec import BlockId
from .tiers.l3 import L3Store
from .transfer import DONE, Transfer

log = logging.getLogger(__name__)

PIECE_BLOCKS = 32  # a read goes to the stores this many blocks at a time (an abandoned one stops between), a write at least this many
RECENT_READS = 16  # reads whose estimate and actual time the stats keep
# Each timed read moves the estimates' scale by (actual / estimate) ** SCALE_STEP, within
# SCALE_BOUNDS: a read also waits for the copies out of its L2 slots, for writes sharing the
# device, for the GIL, none of which the store's bytes-per-second sees (long_doc at 8K on the H200:
# reads took 1.9-2.1x their estimates at steady load, 4.9x in a point that wrote 12.8 GB to the same disk).
SCALE_STEP, SCALE_BOUNDS = 0.2, (0.25, 16.0)
# Longest a write piece waits for the reads in flight before it starts anyway: writes hold their
# L2 slots until done, so they must not starve while reads keep coming.
WRITE_YIELD_S = 1.0


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
    # get: reads not started by then are skipped; moved earlier by `L3Mover.abandon`
    deadline: float | None = None
    after: Transfer = DONE  # get: the L1/L2 copies that may still read the slots it writes
    submitted: float = 0.0  # get: time.monotonic() when queued
    estimate_s: float = 0.0  # get: the read's expected seconds from `submitted` to landing (its queue included)
    abandoned: bool = False
    tried: int = 0  # get: blocks of the pieces it started (the rest were skipped, not failed)
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
        # (blocks, estimated s, actual s, abandoned) of the last reads, for stats(): appended by the reader thread
        self._timed: deque[tuple[int, float, float, bool]] = deque(maxlen=RECENT_READS)
        self._ratio_sum, self._ratio_count, self._abandoned = 0.0, 0, 0
        self.estimate_scale = 1.0  # what reads took over what the store's speed promised: set by the reader thread
        self._reads = 0  # read jobs submitted and not yet read: a write piece waits for 0 (`_reads_done`)
        self._reads_done = threading.Condition()

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
            ticket: int | None = None, after: Transfer = DONE) -> L3Job:
        """Read blocks into L2 `slots`, trying the stores in order, once `after` (the L1/L2 copies
        that may still read those slots: a slot given back right after a load out of it was
        issued) is complete; what has not started by `deadline` misses."""
        self.gets += 1
        job = L3Job("get", ids, slots, priority=priority, ticket=ticket, number=self.gets, deadline=deadline,
                    after=after, submitted=time.monotonic(), estimate_s=self.estimate_seconds(len(ids)))
        self.in_flight += 1
        self.queued_reads += len(ids)
        with self._reads_done:
            self._reads += 1
        self._reader.submit(self._run, job, self._get, None)
        return job

    @staticmethod
    def abandon(job: L3Job) -> None:
        """Read no more of `job` than its pieces already started: the caller recomputes the rest
        (its leading blocks that did arrive still land)."""
        job.abandoned = True
        job.deadline = time.monotonic()

    def _run(self, job: L3Job, work, arg) -> None:
        try:
            job.ok = work(job, arg)
        except Exception:  # stores never raise on I/O; this is a bug, but it must not lose the job
            log.exception("L3 %s of %d blocks failed", job.kind, len(job.ids))
            job.ok = [False] * len(job.ids)
        if job.kind == "get":
            self._time(job)
            with self._reads_done:
                self._reads -= 1
                self._reads_done.notify_all()
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
        for piece in self._write_pieces(job.ids):
            with self._reads_done:  # the reads in flight go first (WRITE_YIELD_S at most)
                self._reads_done.wait_for(lambda: self._reads == 0, timeout=WRITE_YIELD_S)
            for store in self.stores:
                ok[piece] = [a or b for a, b in zip(ok[piece], store.put_many(job.ids[piece], bufs[piece]))]
        return ok

    def _write_pieces(self, ids: list[BlockId]) -> list[slice]:
        """A write's blocks in pieces of PIECE_BLOCKS or more, cut only where a chunk object
        starts (a chain position that is a multiple of chunk_blocks), so each chunk is put whole."""
        k, pieces, start = self.chunk_blocks, [], 0
        for i in range(1, len(ids)):
            if i - start >= PIECE_BLOCKS and ids[i].pos % k == 0:
                pieces.append(slice(start, i))
                start = i
        return pieces + [slice(start, len(ids))] if ids else pieces

    def _time(self, job: L3Job) -> None:
        """Keep the read's estimate against its actual time (reader thread; stats() reads them)."""
        actual = time.monotonic() - job.submitted
        self._timed.append((len(job.ids), job.estimate_s, actual, job.abandoned))
        if job.estimate_s > 0:  # an abandoned read took at least this long: it counts too
            scale = self.estimate_scale * (actual / job.estimate_s) ** SCALE_STEP
            self.estimate_scale = min(max(scale, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        if job.abandoned:
            self._abandoned += 1
        elif job.estimate_s > 0:
            self._ratio_sum += actual / job.estimate_s
            self._ratio_count += 1

    def _get(self, job: L3Job, _: None) -> list[bool]:
        # L1/L2 copies may still read these slots (a load issued just before they were given back
        # to L2's free list): wait for them before the stores write into them
        job.after.synchronize()
        if self.exchange is None:
            return self._read_pieces(job, [self.l2.kv[s] for s in job.slots])
        # whole-model blocks [n, bytes] land here, then each rank takes its heads (this one too)
        blocks = torch.zeros((len(job.ids), self.exchange.split.whole.bytes_per_block), dtype=torch.uint8)
        try:
            return self._read_pieces(job, list(blocks))
        finally:  # read or not, the other ranks wait for this read's pieces: always send them
            self.l2.rows[torch.tensor(job.slots)] = self.exchange.scatter(blocks, job.slots, job.ticket, job.number)

    def _read_pieces(self, job: L3Job, bufs: list[torch.Tensor]) -> list[bool]:
        """Read the job's blocks a piece at a time, each under the job's deadline as it is then
        (an abandoned job starts no more pieces), stopping at the first piece with a miss: a block
        after a miss could not be reached anyway."""
        ok = [False] * len(job.ids)
        for i in range(0, len(job.ids), PIECE_BLOCKS):
            if job.deadline is not None and time.monotonic() >= job.deadline:
                break
            part = slice(i, i + PIECE_BLOCKS)
            job.tried = min(len(job.ids), i + PIECE_BLOCKS)
            ok[part] = self.read(job.ids[part], bufs[part], job.deadline)
            if not all(ok[part]):
                break
        return ok

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
        saturated one while the GPU idled: long-doc, H200). Scaled by what the last reads took
        against their estimates (`estimate_scale`)."""
        return self.seconds_to_read(self.queued_reads + num_blocks)

    def seconds_to_read(self, num_blocks: int) -> float:
        """Expected seconds for the first store to read `num_blocks` once their read starts (scaled)."""
        return self.stores[0].estimate_load_seconds(num_blocks) * self.estimate_scale

    @property
    def read_measured(self) -> bool:
        """Whether reads from the first store have been timed (estimate_seconds is then measured)."""
        return self.stores[0].read_measured

    def stats(self) -> list[dict]:
        return [store.stats() for store in self.stores]

    def read_stats(self) -> dict:
        """The last reads' estimated and actual seconds (queued to landed), and the mean of actual /
        estimate over every read that was not abandoned: a bounded summary, not a log."""
        recent = list(self._timed)
        return {
            "recent": [{"blocks": n, "estimate_s": est, "actual_s": act, "abandoned": ab} for n, est, act, ab in recent],
            "timed": self._ratio_count,
            "abandoned": self._abandoned,
            "mean_actual_over_estimate": self._ratio_sum / self._ratio_count if self._ratio_count else None,
            "estimate_scale": self.estimate_scale,
        }

    def close(self) -> None:
        """Finish queued work, then close the stores."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        for store in self.stores:
            store.close()
