"""Scheduler: which requests run this step, and how many of their tokens.

Continuous batching under a per-step token budget. Running requests go first (a decode costs
one token), then prompts continue in chunks, then waiting requests are admitted by priority and
arrival while L1 can hold them. Admission goes through the cache: L1 hits are shared, L2 hits
load while other requests compute, and L3 hits are prefetched into L2 first (the request waits
for them up to a deadline, then recomputes what has not arrived). When L1 runs out, the
lowest-priority, latest request is preempted: its full blocks are committed and released, so
they demote to L2 instead of vanishing, and its next admission finds them there.

Never runs the model and never touches tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..cache import TieredKVCache
from ..errors import CacheFullError
from .request import Request, Status


@dataclass(slots=True)
class ScheduledStep:
    """This step's work: request i computes `num_new[i]` tokens starting at its `num_computed`."""

    requests: list[Request]
    num_new: list[int]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new)


class Scheduler:
    def __init__(
        self,
        cache: TieredKVCache,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        prefetch_deadline_s: float = 1.0,
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_caching = enable_prefix_caching
        self.prefetch_deadline_s = prefetch_deadline_s
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.given_up: list[Request] = []  # finished by the scheduler itself; the engine reports them
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        step = ScheduledStep([], [])
        for req in list(self.running):  # oldest first; a preemption below may remove later ones
            if req.status is not Status.RUNNING:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if n <= 0:
                continue
            if not self._make_room(req, n, step):
                continue  # req itself was preempted
            step.requests.append(req)
            step.num_new.append(n)
            budget -= n
        self._admit(step, budget)
        return step

    def _make_room(self, req: Request, n: int, step: ScheduledStep) -> bool:
        """Reserve slots for `n` more tokens of `req`, preempting others if L1 is short."""
        extra = req.num_computed + n - req.seq.num_tokens  # tokens beyond what its blocks cover
        while extra > 0 and not self.cache.can_append(req.seq, extra):
            victim = self._victim(exclude=step.requests)
            if victim is req and len(self.running) == 1:
                # alone and still out of room: all of L1 cannot hold it, so it ends here
                self._give_up(req)
                return False
            self.preempt(victim)
            if victim is req:
                return False
        if extra > 0:
            self.cache.append(req.seq, extra)
        return True

    def _victim(self, exclude: list[Request]) -> Request:
        """The running request to preempt: lowest priority, then latest arrival. Requests already
        in this step are never chosen; the one asking is, if it ranks lowest."""
        candidates = [r for r in self.running if r not in exclude]
        return min(candidates, key=lambda r: (r.priority, -r.arrival))

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        now = time.monotonic()
        # highest priority first, then first come first served
        for req in sorted(self.waiting, key=lambda r: (-r.priority, r.arrival)):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.prefetch is not None and not req.prefetch.done() and now < req.prefetch_until:
                continue  # its L3 blocks are still on their way: no need to look it up again yet
            limit = None if self.prefix_caching else 0
            match = self.cache.match(req.all_ids, req.salt, limit=limit)
            if match.by_tier["l3"] and req.prefetch is None:
                # bring the L3 part up into L2 in the background; others run meanwhile
                req.prefetch = self.cache.prefetch(match, self.prefetch_deadline_s, priority=req.priority)
                req.prefetch_until = now + self.prefetch_deadline_s
                if not req.prefetch.done():
                    continue
            if not self.cache.can_allocate(req.num_tokens, match):
                if not self.running and not step.requests:
                    self._give_up(req)  # nothing holds L1 and it still does not fit: it never will
                    continue
                break  # first come first served: nobody overtakes a request that does not fit yet
            try:
                req.seq = self.cache.allocate(req.all_ids, req.salt, priority=req.priority, match=match)
            except CacheFullError:
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            req.prefetch = None
            req.num_computed = req.seq.num_cached_tokens
            if req.cached_tokens is None:
                req.cached_tokens = req.seq.num_cached_tokens
            self.running.append(req)
            n = min(req.num_tokens - req.num_computed, budget)
            step.requests.append(req)
            step.num_new.append(n)
            budget -= n

    # ------------------------------------------------------------------ after the step

    def computed(self, req: Request, n: int) -> None:
        """`n` more tokens of `req` have their KV in its blocks: share the newly full blocks."""
        req.num_computed += n
        if self.prefix_caching and req.num_computed // self.cache.block_size > req.seq.committed:
            self.cache.commit(req.seq, req.tokens(0, req.num_computed))

    def preempt(self, req: Request) -> None:
        """Give `req`'s blocks back (its full ones stay cached, demoting to L2 under pressure)
        and put it back in the queue; it resumes from whatever the cache still holds."""
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        self.waiting.append(req)
        self.num_preemptions += 1

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()

    def _give_up(self, req: Request) -> None:
        """End a request whose tokens outgrew all of L1 (finish reason "length")."""
        self.finish(req, "length")
        self.given_up.append(req)

    def _release(self, req: Request) -> None:
        if req.seq is not None:
            self.cache.free(req.seq)
            req.seq = None
        if req in self.running:
            self.running.remove(req)
