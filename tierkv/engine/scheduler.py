"""Scheduler: which requests run this step, and how many of their tokens.

Continuous batching under a per-step token budget. Running requests go first (a decode costs
one token), then prompts continue in chunks, then waiting requests are admitted by priority and
arrival while L1 can hold them. Admission goes through the cache: L1 hits are shared, L2 hits
load while other requests compute (a long one a slice a step before its admission, so that no
step waits for the host to issue it all; a step waits for one request's loads at most, layer by
layer, when nothing else can run and that load is long), and L3 hits are prefetched into L2
first (the request waits for them up to a deadline, then recomputes what has not arrived;
when loading all of it first would be slower than recomputing, the end of the L3 part is read
in the background while the start is recomputed, and taken once the computation reaches it).
When L1 runs out, the lowest-priority, latest request is preempted: its full blocks are
committed and released, so they demote to L2 instead of vanishing, and its next admission finds
them there. A request that all of L1 cannot hold is streamed instead: it keeps at most half of
L1, moves its oldest computed blocks to L2 as it grows, and attention reads them back layer by
layer. With async scheduling a running request may have a sampled token on its way to the host
("pending"): it is scheduled as if that token were known, unless that token is its last: then
its seat and blocks go back at once, for a waiting request to take in the same schedule.

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


# Blocks a streamed request moves to L2 at once when it needs room: one copy of many blocks
# rather than one per step.
OFFLOAD_BATCH_BLOCKS = 64

# Loads shorter than this are waited for whole before their request computes, even when nothing
# else can run. A step that starts while its loads land runs eagerly (a CUDA graph cannot wait
# for each layer's copy), and launching it eagerly keeps the engine thread busy for longer than a
# short load takes: 37 ms for a Llama-3.1-8B step on an H100 (bench_rounds at 8e4fc74), against
# ~20 ms to load an 8K-token history (1 GB); requests that arrive meanwhile are not admitted, so
# their loads do not queue behind it.
# Waiting instead, the engine admits them while the load lands, and the step replays a graph.
# A long load (a 100K-token history: ~0.25 s) still starts layer by layer: its first layers
# compute while the later ones are on their way.
LAYER_BY_LAYER_MIN_S = 0.05

# While others compute, a request admitted loads at most this many L2 blocks in that step; the
# rest is warmed into L1 beforehand, this many a step (`Admission.warm`). Admitting costs the
# host per block loaded (eviction, index, DMA launches: ~11 us on the H100's host, bench_admission
# at 81f5540), and the step launches only after that: a whole 8K-token Llama-3.1-8B history (~500
# blocks, ~15 ms with its lookup) kept the GPU idle ~9 ms after each decode step (~8 ms) of a
# turnover, ~40 steps a hit round of bench_rounds (acbb6f8 step log). A slice of 256 should stay
# within a step, and 256 such blocks (512 MiB) keep PCIe busy for that step, so the load is not
# slower. Measured (two A/B pairs, H100): hit rounds 80% of their bound against 74% without, and
# 74% against 70% on a slower host; the GPU idle between steps 0.10-0.12 s a round, not 0.25-0.35.
LOAD_SLICE_BLOCKS = 256


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
        # Seconds to recompute one prompt token, set by the engine: a cached prefix in a slow tier
        # is only loaded where that is faster (None: always load).
        self.recompute_seconds_per_token: float | None = None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.given_up: list[Request] = []  # finished by the scheduler itself; the engine reports them
        self.num_preemptions = 0
        self.tail_waits = 0
        self.loading: list[Request] = []  # running requests whose loads were in flight at the last schedule()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        step = ScheduledStep([], [])
        self.tail_waits = 0  # running requests that wait for their L3 tail this step
        loading = self.loading = []  # requests whose L2 blocks are still on their way into L1
        for req in list(self.running):  # oldest first; a preemption below may remove later ones
            if req.status is not Status.RUNNING:
                continue
            if _loading(req):
                loading.append(req)
                continue
            if req.adopt_at is not None and req.num_computed >= req.adopt_at:
                if self._tail_on_its_way(req):
                    self.tail_waits += 1
                    continue  # it lands before recomputing it would end: others compute meanwhile
                self._adopt(req)
            if self._ends_by_length(req):
                self._release_early(req)  # computing one more would be waste, and so would its seat
                continue
            n = self._new_tokens(req, budget)
            if n <= 0:
                continue
            if not self._make_room(req, n, step):
                continue  # req itself was preempted
            step.requests.append(req)
            step.num_new.append(n)
            budget -= n
        self._admit(step, budget, loading)
        if not step.requests:
            # Nothing else to compute: the one whose blocks land first (loads queue on one copy
            # stream, in admission order) starts now, layer by layer as they land, if its load is
            # long (see LAYER_BY_LAYER_MIN_S); the others join once theirs have. Were they all to
            # start together, the step would wait for the last one's loads, so the GPU would
            # compute nothing while all of them load, and requests admitted together would keep
            # finishing together, each wave's loads again alone.
            for req in loading:
                if self._ends_by_length(req):
                    continue
                if not self._layer_by_layer(req):
                    break  # its blocks land first, soon: it joins then, as a step that may replay a graph
                n = self._new_tokens(req, budget)
                if n > 0 and self._make_room(req, n, step):
                    step.requests.append(req)
                    step.num_new.append(n)
                    break
        return step

    def _release_early(self, req: Request) -> None:
        """`req`'s token on its way is its last by max_tokens: give its seat and blocks back now,
        its full blocks committed first so that they stay cached, rather than once the engine takes
        that token back, after launching the next step. A waiting request can then be admitted in
        this schedule, a step earlier (at a wave's end, bench_rounds' seats stood empty 2-3 steps
        each). `req` stays RUNNING, outside `running`, until the engine finishes it. Its blocks are
        reused only by work queued after the step still writing them: steps on the same stream,
        and moves on the copy stream, which waits for the compute stream (BlockMover)."""
        self.commit(req)
        self._release(req)

    def _layer_by_layer(self, req: Request) -> bool:
        """Whether `req`, its loads in flight, may start before they landed (its load is long)."""
        return self.cache.load_seconds(req.seq) >= LAYER_BY_LAYER_MIN_S

    def _new_tokens(self, req: Request, budget: int) -> int:
        """Tokens a running request computes this step: what it lacks, within the budget, its
        chunk cap and its L3 tail's start."""
        return min(req.num_tokens - req.num_computed, budget, self._chunk_cap(req), self._until_adopt(req))

    @staticmethod
    def _ends_by_length(req: Request) -> bool:
        """Whether the token `req` has on its way reaches max_tokens, ending it."""
        limit = req.params.max_tokens
        return req.pending > 0 and limit is not None and len(req.output_ids) + req.pending >= limit

    def _make_room(self, req: Request, n: int, step: ScheduledStep) -> bool:
        """Reserve slots for `n` more tokens of `req`, preempting others if L1 is short. First
        `req` lets go of the blocks no query of it reads any more (in a cache whose every layer
        is windowed, a window group's among them: those before the window of its next query),
        unless it streams."""
        self.cache.let_go(req.seq, req.num_computed, streams=self._streams(req))
        extra = req.num_computed + n - req.seq.num_tokens  # tokens beyond what its blocks cover
        while extra > 0:
            try:  # one cache call a request and step, where room is there (almost always)
                self.cache.append(req.seq, extra)
                return True
            except CacheFullError:  # nothing was taken
                pass
            if self._offload_own(req, extra):
                continue
            victim = self._victim(exclude=step.requests)
            if victim is req and len(self.running) == 1:
                # alone and still out of room: all of L1 cannot hold it, so it ends here
                self._give_up(req)
                return False
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _streams(self, req: Request) -> bool:
        """Whether `req` runs streamed: it is already, or all of L1 could never hold it."""
        if req.seq is not None and req.seq.offloaded:
            return True
        return self.cache.must_stream(req.num_tokens)

    def _chunk_cap(self, req: Request) -> int:
        """Most new tokens `req` computes in one step: a streamed request keeps to its window, and
        so does one that lets go of what its sliding window has left (`cache.step_tokens`)."""
        return min(req.num_tokens, self.cache.step_tokens(self._streams(req)))

    def _offload_own(self, req: Request, extra: int) -> bool:
        """Make room for `extra` tokens of `req` by moving its own oldest computed blocks to L2;
        done for requests that stream, or that are alone and would otherwise end here."""
        if self.cache.l2 is None or not (self._streams(req) or self.running == [req]):
            return False
        movable = req.num_computed // self.cache.block_size - req.seq.offloaded  # full blocks in L1
        if movable <= 0:
            return False
        want = max(self.cache.blocks_needed(extra), OFFLOAD_BATCH_BLOCKS)
        return self.cache.offload(req.seq, min(want, movable)) > 0

    @staticmethod
    def _until_adopt(req: Request) -> int:
        """Tokens `req` may compute before it stops to take its L3 tail (no limit without one)."""
        return req.num_tokens if req.adopt_at is None else max(1, req.adopt_at - req.num_computed)

    def _tail_on_its_way(self, req: Request) -> bool:
        """Whether `req`, which computed up to its L3 tail, waits for it this step. It waits only
        while the read is expected (`Prefetch.expected_by`: from what of it is left to read) to
        land sooner than recomputing the tail would end, and never longer than that recompute
        takes: a read that turns out late is abandoned as soon as that shows, and what of it has
        landed is taken, the rest recomputed."""
        tail = req.tail
        if tail.done():
            return False
        now = time.monotonic()
        if tail.give_up_at is None:  # it reached the tail just now
            recompute_s = req.tail_tokens * (self.recompute_seconds_per_token or 0.0)
            tail.reached_at, tail.give_up_at = now, now + recompute_s
        if max(now, tail.expected_by(now)) < tail.give_up_at:
            return True
        tail.abandoned_at = now
        tail.abandon()
        return False

    def _adopt(self, req: Request) -> None:
        """`req` computed up to its L3 tail: take what of the tail has landed in L2 by now."""
        before = dict(req.seq.cached_by_tier)
        gained = self.cache.adopt(req.seq, req.tokens(0, len(req.prompt_ids))) * self.cache.block_size
        req.num_computed += gained
        req.cached_tokens = (req.cached_tokens or 0) + gained
        for tier, tokens in req.seq.cached_by_tier.items():  # adopt adds what it took, by tier
            req.cached_by_tier[tier] += tokens - before[tier]
        req.tail, req.adopt_at = None, None

    def _victim(self, exclude: list[Request]) -> Request:
        """The running request to preempt: lowest priority, then latest arrival. Requests already
        in this step are never chosen; the one asking is, if it ranks lowest."""
        candidates = [r for r in self.running if r not in exclude]
        return min(candidates, key=lambda r: (r.priority, -r.arrival))

    def _admit(self, step: ScheduledStep, budget: int, loading: list[Request]) -> None:
        """Admit waiting requests, each by the cache's plan for it, while L1 and the budget last.
        One whose blocks load joins this step only if the step would otherwise wait for no load
        (it is empty and no running request is `loading`); otherwise it is the last admitted
        this step."""
        now = time.monotonic()
        # highest priority first, then first come first served
        for req in sorted(self.waiting, key=lambda r: (-r.priority, r.arrival)):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.pending:
                continue  # preempted with a token on its way: admitted once that token is known
            if req.prefetch is not None and not req.prefetch.done() and now < req.prefetch_until:
                continue  # its L3 blocks are still on their way: no need to look it up again yet
            if req.refused_at_room is not None and self.running and self.cache.l1_room() <= req.refused_at_room:
                break  # refused at this room, which has not grown since: a lookup would find the same
            plan = self._plan(req, budget)
            if plan.fetch is not None and req.prefetch is None:
                # bring the L3 part up into L2 in the background; others run meanwhile
                req.prefetch = self.cache.prefetch(plan.match, plan.fetch_deadline_s, priority=req.priority,
                                                   blocks=plan.fetch)
                req.prefetch_until = now + plan.fetch_deadline_s
                if not req.prefetch.done():
                    continue
                plan = self._plan(req, budget)  # what landed already is loaded from L2
            if not plan.fits:
                if not self.running and not step.requests:
                    self._give_up(req)  # nothing holds L1 and it still does not fit: it never will
                    continue
                req.refused_at_room = self.cache.l1_room() if plan.room_decides else None
                if plan.room_decides:  # (never a streamed plan: that reserves a chunk)
                    # its L2 blocks load into the room there is while others run: once one ends,
                    # it loads the rest only, instead of all of them while the batch is one short
                    # (a slice a step: where the room holds more, it is looked at again next step)
                    if self._warm(plan) >= LOAD_SLICE_BLOCKS:
                        req.refused_at_room = None
                break  # first come first served: nobody overtakes a request that does not fit yet
            if step.requests and self._warm_a_slice(req, plan):
                break  # its next blocks load while the others compute; admitted once the rest is a slice
            try:
                req.seq = self.cache.allocate(None, req.salt, priority=req.priority, match=plan.match,
                                              stream=plan.stream, reserve=plan.reserve)
            except CacheFullError:
                break  # starting its fetch freed L2 room by dropping blocks of its own match: next step
            if plan.tail is not None:
                # recompute the start of the L3 part while its end is read into L2 in the background
                req.tail = self.cache.prefetch(plan.match, plan.tail_deadline_s, priority=req.priority,
                                               blocks=plan.tail)
                req.adopt_at, req.tail_tokens = plan.adopt_at, plan.tail_tokens
            self.waiting.remove(req)
            req.status = Status.RUNNING
            req.prefetch = None
            req.num_computed = req.seq.num_cached_tokens
            if req.cached_tokens is None:
                req.cached_tokens = req.seq.num_cached_tokens
                req.cached_by_tier = dict(req.seq.cached_by_tier)
                req.admitted = now
            self.running.append(req)
            if _loading(req) and (step.requests or loading or not self._layer_by_layer(req)):
                # others compute (or load) meanwhile; it joins once its blocks landed
                loading.append(req)
                if not step.requests and _loading(loading[0]):
                    # no step can run before the first load lands: meanwhile the next one's loads
                    # queue behind these (once it landed, this returns, and it runs next call)
                    continue
                # The next waiting one is looked at next step: admitting one costs the host a few
                # ms (its lookup, its slots, launching its loads), and the step launches only after
                # this returns (16 arrivals at once kept a running request's next step waiting
                # ~75 ms, H200 profile of bench_rounds at b964e45). One a step still issues loads
                # faster than PCIe lands them (an 8K-token Llama-8B history: ~20 ms, a step ~7 ms).
                break
            # a streamed request reserved one chunk; one with an L3 tail stops where the tail starts
            n = min(req.seq.num_tokens - req.num_computed, budget, self._until_adopt(req))
            step.requests.append(req)
            step.num_new.append(n)
            budget -= n

    def _warm_a_slice(self, req: Request, plan) -> bool:
        """Whether a slice of `req`'s L2 blocks started loading into L1 instead of `req` being
        admitted now: where more than LOAD_SLICE_BLOCKS of them are to load (those warm can bring;
        allocate loads the rest), and the last slice made progress (others' room may evict warmed
        blocks again: then it is admitted at once rather than warmed forever). Not for a streamed
        plan, whose L2 blocks stay in L2."""
        left = plan.l2_tokens
        if plan.stream or left <= LOAD_SLICE_BLOCKS * self.cache.block_size:
            return False
        if req.l2_left is not None and left >= req.l2_left:
            return False  # no nearer than after the last slice
        req.l2_left = left
        return self._warm(plan) > 0

    def _warm(self, plan) -> int:
        """Start one slice of `plan`'s L2 blocks loading into L1, leaving a block of room for each
        running request's next token; returns how many started."""
        return self.cache.warm(plan.match, keep=len(self.running), limit=LOAD_SLICE_BLOCKS)

    def _plan(self, req: Request, budget: int):
        return self.cache.plan(req.all_ids, req.salt, budget=budget, prefix_caching=self.prefix_caching,
                               recompute_seconds_per_token=self.recompute_seconds_per_token,
                               deadline_s=self.prefetch_deadline_s)

    # ------------------------------------------------------------------ after the step

    def computed(self, req: Request, n: int) -> None:
        """`n` more tokens of `req` have their KV written (or being written, in order, on the GPU)."""
        req.num_computed += n
        self.commit(req)
        if req.forks and req.num_computed == req.num_tokens:
            self._fork(req)

    def _fork(self, req: Request) -> None:
        """`req` has computed its prompt, and the other choices of its request sampled their first
        tokens from its last logits in the same step (see ModelRunner.run): they take its prompt's
        blocks and run on their own from here. Those that L1 (a partial block each) or the batch
        cannot take now wait as if preempted: admitted later, they match or recompute the prompt."""
        forks, req.forks = req.forks, []
        seats = max(0, self.max_num_seqs - len(self.running))
        seqs = self.cache.fork(req.seq, min(len(forks), seats), len(req.prompt_ids))
        for child, seq in zip(forks, seqs):
            child.seq, child.status = seq, Status.RUNNING
            child.num_computed = len(child.prompt_ids)
            child.cached_tokens, child.cached_by_tier = req.cached_tokens, req.cached_by_tier
            self.running.append(child)
        self.waiting += forks[len(seqs) :]

    def commit(self, req: Request) -> None:
        """Share `req`'s newly full blocks. A block is hashed by its token ids, so one holding a
        token still on its way is committed once that token is known (the engine calls again)."""
        if not self.prefix_caching or req.seq is None:
            return
        ready = min(req.num_computed, req.num_known)
        if ready // self.cache.block_size > req.seq.committed:
            self.cache.commit(req.seq, req.tokens(0, ready))

    def preempt(self, req: Request) -> None:
        """Give `req`'s blocks back (its full ones stay cached, demoting to L2 under pressure)
        and put it back in the queue; it resumes from whatever the cache still holds."""
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.tail, req.adopt_at = None, None  # what of its tail landed, its next admission finds
        req.refused_at_room = req.l2_left = None
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
        """End a request whose tokens outgrew all of L1 (finish reason "length"), with the choices
        still waiting for its prompt."""
        for r in (req, *req.forks):
            self.finish(r, "length")
            self.given_up.append(r)
        req.forks = []

    def _release(self, req: Request) -> None:
        if req.seq is not None:
            self.cache.free(req.seq)
            req.seq = None
        if req in self.running:
            self.running.remove(req)


def _loading(req: Request) -> bool:
    """Whether L2 -> L1 loads into `req`'s blocks are still in flight (an event query, no host sync)."""
    return not req.seq.loaded()
