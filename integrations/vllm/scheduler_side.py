"""The scheduler's half of the connector: the one decider. It holds a TieredKVCache (L2 in
shared memory, L3 on its threads) with vLLM's blocks as an engine-owned L1, one per vLLM
KV-cache group (one without vLLM's hybrid manager), answers vLLM's lookups from tierkv's
indexes (the hit every group holds), allocates each request's sequences over vLLM's block ids,
commits the blocks each step fills, and hands the copies tierkv records to the workers (StepWork).

Runs in vLLM's EngineCore process. Never touches vLLM's KV tensors: the workers copy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tierkv.cache import TieredKVCache
from tierkv.events import BlockEvents
from tierkv.plan import Match
from tierkv.sequence import SequenceBlocks
from tierkv.prefetch import Prefetch

from . import options
from .events import VllmHashes, vllm_events
from .records import CopiesDone, StepWork
from .stats import StatsReporter, TierKVStats

log = logging.getLogger(__name__)

L3_DEADLINE_S = 5.0  # how long an L3 read may take before what has not arrived is recomputed
RESET_WAIT_S = 10.0  # how long a reset waits for L3 writes to release the L2 blocks they read


@dataclass
class Tracked:
    """What the connector knows of one vLLM request between its lookup and its end. Per KV-cache
    group (one without vLLM's hybrid manager): its match, its sequence, its L3 read."""

    request: object  # vllm.v1.request.Request (live: its tokens grow as it decodes)
    salt: str | None
    matches: list[Match] | None = None  # the lookup answered to vLLM, each cut to the hit all hold
    local: int = 0  # tokens vLLM's own prefix cache had at the lookup
    promised: int = 0  # tokens told to vLLM that tierkv loads
    from_l3: int = 0  # of those, the tokens read from L3 first
    seqs: list[SequenceBlocks] | None = None
    fetches: list[Prefetch | None] | None = None  # an asynchronous load: each group's L3 read into L2
    fetch_ids: list[list[int]] = field(default_factory=list)  # vLLM's block ids waiting for it
    fetch_end: float = 0.0


class SchedulerSide:
    def __init__(self, groups: list[options.ConnectorOptions], events: bool) -> None:
        """`groups`: each vLLM KV-cache group's options (options.per_group), a cache each.
        `events`: record block events for vLLM to publish (--kv-events-config)."""
        opts = self.options = groups[0]
        self.block_size = opts.layout.block_size
        self.caches: list[TieredKVCache] = []
        try:
            for o in groups:
                self.caches.append(TieredKVCache(o.whole, o.cache, model=o.model, engine_blocks=o.engine_blocks,
                                                 kv_format=o.kv_format))
        except BaseException:
            for c in self.caches:
                c.close()
            raise
        # the lead group: a full-attention one, which loads every block of a hit. Its counters give
        # the hit tokens and its blocks the events (every group serves the same hit).
        self.lead = next((i for i, o in enumerate(groups) if o.window is None), 0)
        self.cache = self.caches[self.lead]
        self.requests: dict[str, Tracked] = {}
        self.load_errors: list[int] = []  # block ids of this step's loads that cannot be served
        self.l2_unlinked = False  # the shared L2's file name, removed once every worker mapped it
        # beyond the cache's own counters: preemptions seen, and the tokens loaded back for them
        self.preemptions = self.resumed_hit_tokens = 0
        self.stats = StatsReporter([self.cache.counters] + [c.counters for c in self.caches if c is not self.cache])
        # hits from L3 count as vLLM's DISK where the first store (where reads go first) is a file://
        self.l3_is_local_disk = bool(opts.cache.l3) and opts.cache.l3[0].startswith("file://")
        self.events = BlockEvents() if events else None
        self.hashes = VllmHashes()
        self.cache.listen(self.events)
        log.info("TierKVConnector: L2 %.2f GiB in %s, L3 %s, model %s, blocks of %d tokens, %d KV-cache group(s)",
                 sum(o.cache.l2 for o in groups) / 2**30, opts.cache.l2_file, opts.cache.l3 or "none", opts.model,
                 self.block_size, len(groups))

    @property
    def grouped(self) -> bool:
        """Whether vLLM has several KV-cache groups (its hybrid manager on a hybrid model)."""
        return len(self.caches) > 1

    # ------------------------------------------------------------------ lookups and allocation

    def matched_tokens(self, request, num_computed: int) -> tuple[int, bool]:
        """get_num_new_matched_tokens: tokens past `num_computed` tierkv can load, and whether the
        load is asynchronous (some come from L3). No side effects but the lookup counters."""
        t = self._track(request)
        if not options.cacheable(request) or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        tokens = request.all_token_ids
        ms = t.matches
        # kept while they hold (an L3 lookup is a round trip): looked up again once the tokens
        # grew or a block left an index since
        if ms is None or any(len(m.token_bytes) != 4 * len(tokens) or m.removals != c.index.removals
                             for c, m in zip(self.caches, ms)):
            ms = [c.match(list(tokens), t.salt) for c in self.caches]
            hit = min(m.tokens for m in ms)
            # each group's match cut to the hit every group holds (looked up again where one holds more)
            ms = t.matches = [m if m.tokens == hit else c.match(list(tokens), t.salt, limit=hit)
                              for c, m in zip(self.caches, ms)]
        hit = min(m.tokens for m in ms)
        extra = max(0, hit - num_computed)
        t.local, t.promised = num_computed, extra
        t.from_l3 = min(extra, max(m.by_tier["l3"] for m in ms))
        in_l2 = min(len(m.blocks) for m in ms) * self.block_size
        # asynchronous when some of it is read from L3 first (an L3 part past vLLM's own hit); with
        # several KV-cache groups always: vLLM takes no block ids of failed loads then, only whole
        # requests that waited for theirs (failed_recving)
        return extra, bool(extra and (self.grouped or hit > max(num_computed, in_l2)))

    def allocated(self, request, block_ids: tuple[list[int], ...], num_external: int) -> None:
        """update_state_after_alloc: vLLM gave the request its blocks (a list per KV-cache group).
        Loads from L2 are recorded now (run before this step's forward); an L3 part is read into
        L2 first, and every load is, with several groups (asynchronous)."""
        t = self._track(request)
        if num_external == 0 or t.matches is None:
            return
        if t.seqs is not None:  # asked again after a preemption: the blocks are new
            self._free(t)
        ids = [engine_slots(g) for g in block_ids]
        end = t.local + num_external
        from_l3 = [bool(m.by_tier["l3"]) and len(m.blocks) * self.block_size < end for m in t.matches]
        if self.grouped or any(from_l3):
            t.fetches = [c.prefetch(m, L3_DEADLINE_S) if f else None
                         for c, m, f in zip(self.caches, t.matches, from_l3)]
            t.fetch_ids, t.fetch_end = ids, time.monotonic() + L3_DEADLINE_S
            return
        # promised blocks gone since the lookup are reported with this step's work: vLLM then
        # recomputes them instead of reading whatever its blocks held
        self.load_errors += self._allocate(t, ids)

    def _allocate(self, t: Tracked, ids: list[list[int]]) -> list[int]:
        """The request's sequences over each group's block ids `ids`, loading what tierkv holds past
        vLLM's own hit; returns the block ids promised to vLLM that could not be loaded (evicted,
        or not read from L3, since the lookup): vLLM recomputes from the first of them."""
        want = (t.local + t.promised) // self.block_size
        t.seqs, missing = [], []
        for g, (cache, m, slots) in enumerate(zip(self.caches, t.matches, ids)):
            seq = cache.allocate(None, t.salt, match=m, slots=slots, computed=t.local)
            got = max(seq.num_cached_tokens, t.local) // self.block_size
            # blocks L3 was thought to hold but did not deliver are written there again once computed
            seq.in_l3 = (seq.in_l3[0], min(seq.in_l3[1], got))
            missing += [b for b in slots[got:want] if b >= 0]  # (-1: a block the group does not read)
            t.seqs.append(seq)
            if g == self.lead and self.events is not None:
                self.hashes.learn(seq.hashes, t.request, 0, got)
        if t.request.num_preemptions > 0:
            self.resumed_hit_tokens += sum(t.seqs[self.lead].cached_by_tier.values())
        t.matches, t.promised = None, 0
        return missing

    # ------------------------------------------------------------------ each step

    def step(self, so) -> StepWork:
        """build_connector_meta: finish the L3 reads that landed, extend and commit every scheduled
        request's sequences by the tokens this step computes, and hand the copies to the workers."""
        work = StepWork(load_errors=self.load_errors)
        self.load_errors = []
        for rid in so.preempted_req_ids or ():
            self.preemptions += 1
            self._forget(rid, keep_request=True)
        for rid in so.finished_req_ids:
            self._forget(rid)
        now = time.monotonic()
        for rid, t in self.requests.items():
            if t.fetches is not None and (all(f is None or f.done() for f in t.fetches) or now >= t.fetch_end):
                missing = self._allocate(t, t.fetch_ids)
                work.loaded_async.append(rid)
                t.fetches, t.fetch_ids = None, []
                if self.grouped and missing:  # vLLM recomputes the request whole and looks it up again
                    work.failed_async.append(rid)
                    self._free(t)
                else:
                    work.load_errors += missing
        state = so.kv_connector_block_state
        for rid, n in so.num_scheduled_tokens.items():
            t = self.requests.get(rid)
            if t is None or state is None or not options.cacheable(t.request):
                continue
            self._extend(t, [engine_slots(g) for g in state.get_block_ids(rid)], t.request.num_computed_tokens + n)
        # every cache takes a batch each step, so their batch numbers go in step: one number for all
        batches = [c.take_moves() for c in self.caches]
        work.batch, work.moves = batches[0][0], [moves for _, moves in batches]
        return work

    def _extend(self, t: Tracked, ids: list[list[int]], computed: int) -> None:
        """The sequences cover each group's block ids `ids` and hold the KV of their first
        `computed` tokens after this step: commit the blocks that fills (copied after the forward)."""
        tokens = t.request.all_token_ids
        computed = min(computed, len(tokens))
        if t.seqs is None:  # nothing loaded for it: vLLM computes it all
            t.seqs = [self._fresh(t, c, block_ids) for c, block_ids in zip(self.caches, ids)]
        for g, (cache, seq, block_ids) in enumerate(zip(self.caches, t.seqs, ids)):
            new_ids = block_ids[len(seq.slots) :]
            if new_ids or computed > seq.num_tokens:
                cache.append(seq, max(0, computed - seq.num_tokens), slots=new_ids)
            if computed // self.block_size > seq.committed:
                first = seq.committed
                cache.commit(seq, list(tokens[:computed]))
                if g == self.lead and self.events is not None:
                    self.hashes.learn(seq.hashes, t.request, first, seq.committed)

    def _fresh(self, t: Tracked, cache: TieredKVCache, block_ids: list[int]) -> SequenceBlocks:
        """A sequence for a request tierkv loads nothing into: over vLLM's blocks, computed by vLLM."""
        tokens = list(t.request.all_token_ids[: len(block_ids) * self.block_size])
        m = cache.match(tokens, t.salt, limit=0)  # hashes nothing: commit hashes as blocks fill
        return cache.allocate(None, t.salt, match=m, slots=block_ids, computed=len(tokens))

    def copies_done(self, report: CopiesDone | None) -> None:
        """update_connector_output: the workers ran every batch up to report.batch."""
        if report is not None and report.batch >= 0:
            for cache in self.caches:
                cache.moves_done(report.batch)
            if not self.l2_unlinked:  # every worker has mapped L2 by its first report
                for cache in self.caches:
                    cache.l2.unlink()
                self.l2_unlinked = True

    # ------------------------------------------------------------------ ends

    def _track(self, request) -> Tracked:
        t = self.requests.get(request.request_id)
        if t is None:
            t = self.requests[request.request_id] = Tracked(request, options.request_salt(request))
        return t

    def _forget(self, rid: str, keep_request: bool = False) -> None:
        t = self.requests.get(rid)
        if t is None:
            return
        self._free(t)
        t.matches, t.fetches, t.fetch_ids = None, None, []
        if not keep_request:
            del self.requests[rid]

    def _free(self, t: Tracked) -> None:
        for cache, seq in zip(self.caches, t.seqs or ()):
            cache.free(seq)
        t.seqs = None

    def finished(self, request) -> None:
        """request_finished: its sequence is freed (the copies of its last step ran in that step)."""
        self._forget(request.request_id)

    def reset(self) -> bool:
        """reset_cache: drop L2 (L3 is shared with other processes and stays). L2 blocks that L3
        writes still read are held until written: wait for those (up to RESET_WAIT_S) rather than
        refuse. False while a request's copies hold blocks, as vLLM's own reset refuses then."""
        if all([c.clear() for c in self.caches]):  # (every cache tries)
            return True
        for c in self.caches:
            c.flush(RESET_WAIT_S)
        return all([c.clear() for c in self.caches])

    def hit_sources(self, request, num_external: int) -> tuple[int, int]:
        """Of the `num_external` tokens vLLM takes from the connector: (from L2, from L3)."""
        t = self.requests.get(request.request_id)
        from_l3 = min(num_external, t.from_l3) if t is not None else 0
        return num_external - from_l3, from_l3

    def take_events(self) -> list:
        """vLLM KV events for the blocks that entered or left L2 and L3 since the last call."""
        if self.events is None:
            return []
        return vllm_events(self.events.take(), self.hashes, self.block_size)

    def take_stats(self) -> TierKVStats | None:
        return self.stats.take()

    def close(self) -> None:
        for c in self.caches:
            c.close()


def engine_slots(block_ids) -> list[int]:
    """vLLM's block ids of one KV-cache group as the cache takes them: its null block (a position a
    sliding window has left, with no memory) is -1, where nothing is loaded or saved."""
    return [-1 if b == options.NULL_BLOCK else b for b in block_ids]
