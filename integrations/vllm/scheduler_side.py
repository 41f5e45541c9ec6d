"""The scheduler's half of the connector: the one decider. It holds the TieredKVCache (L2 in
shared memory, L3 on its threads) with vLLM's blocks as an engine-owned L1, answers vLLM's
lookups from tierkv's index, allocates each request's sequence over vLLM's block ids, commits
the blocks each step fills, and hands the copies tierkv records to the workers (StepWork).

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
from tierkv.tiering import Prefetch

from . import options
from .events import VllmHashes, vllm_events
from .records import CopiesDone, StepWork
from .stats import StatsReporter, TierKVStats

log = logging.getLogger(__name__)

L3_DEADLINE_S = 5.0  # how long an L3 read may take before what has not arrived is recomputed
RESET_WAIT_S = 10.0  # how long a reset waits for L3 writes to release the L2 blocks they read


@dataclass
class Tracked:
    """What the connector knows of one vLLM request between its lookup and its end."""

    request: object  # vllm.v1.request.Request (live: its tokens grow as it decodes)
    salt: str | None
    match: Match | None = None  # the lookup answered to vLLM, kept until allocation
    local: int = 0  # tokens vLLM's own prefix cache had at the lookup
    promised: int = 0  # tokens told to vLLM that tierkv loads
    from_l3: int = 0  # of those, the tokens read from L3 first
    seq: SequenceBlocks | None = None
    fetch: Prefetch | None = None  # an L3 read on its way into L2 (asynchronous load)
    fetch_ids: list[int] = field(default_factory=list)  # vLLM's block ids waiting for it
    fetch_end: float = 0.0


class SchedulerSide:
    def __init__(self, opts: options.ConnectorOptions, events: bool) -> None:
        """`events`: record block events for vLLM to publish (--kv-events-config)."""
        self.options = opts
        self.block_size = opts.layout.block_size
        self.cache = TieredKVCache(opts.whole, opts.cache, model=opts.model, engine_blocks=opts.engine_blocks,
                                   kv_format=opts.kv_format)
        self.requests: dict[str, Tracked] = {}
        self.load_errors: list[int] = []  # block ids of this step's loads that cannot be served
        self.l2_unlinked = False  # the shared L2's file name, removed once every worker mapped it
        # beyond the cache's own counters: preemptions seen, and the tokens loaded back for them
        self.preemptions = self.resumed_hit_tokens = 0
        self.stats = StatsReporter(self.cache.counters)
        # hits from L3 count as vLLM's DISK where the first store (where reads go first) is a file://
        self.l3_is_local_disk = bool(opts.cache.l3) and opts.cache.l3[0].startswith("file://")
        self.events = BlockEvents() if events else None
        self.hashes = VllmHashes()
        self.cache.listen(self.events)
        log.info("TierKVConnector: L2 %.2f GiB in %s, L3 %s, model %s, blocks of %d tokens",
                 opts.cache.l2 / 2**30, opts.cache.l2_file, opts.cache.l3 or "none", opts.model, self.block_size)

    # ------------------------------------------------------------------ lookups and allocation

    def matched_tokens(self, request, num_computed: int) -> tuple[int, bool]:
        """get_num_new_matched_tokens: tokens past `num_computed` tierkv can load, and whether the
        load is asynchronous (some come from L3). No side effects but the lookup counters."""
        t = self._track(request)
        if not options.cacheable(request) or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        tokens = request.all_token_ids
        m = t.match
        # kept while it holds (an L3 lookup is a round trip): looked up again once the tokens
        # grew or a block left the index since
        if m is None or len(m.token_bytes) != 4 * len(tokens) or m.removals != self.cache.index.removals:
            t.match = self.cache.match(list(tokens), t.salt)
        m = t.match
        extra = max(0, m.tokens - num_computed)
        t.local, t.promised = num_computed, extra
        t.from_l3 = min(extra, m.by_tier["l3"])
        # asynchronous when some of it is read from L3 first (an L3 part past vLLM's own hit)
        return extra, bool(extra and m.tokens > max(num_computed, len(m.blocks) * self.block_size))

    def allocated(self, request, block_ids: list[int], num_external: int) -> None:
        """update_state_after_alloc: vLLM gave the request its blocks. Loads from L2 are recorded
        now (run before this step's forward); an L3 part is read into L2 first (asynchronous)."""
        t = self._track(request)
        if num_external == 0 or t.match is None:
            return
        if t.seq is not None:  # asked again after a preemption: the blocks are new
            self.cache.free(t.seq)
            t.seq = None
        m = t.match
        if m.by_tier["l3"] and len(m.blocks) * self.block_size < t.local + num_external:
            t.fetch = self.cache.prefetch(m, L3_DEADLINE_S)
            t.fetch_ids, t.fetch_end = list(block_ids), time.monotonic() + L3_DEADLINE_S
            return
        # promised blocks gone since the lookup are reported with this step's work: vLLM then
        # recomputes them instead of reading whatever its blocks held
        self.load_errors += self._allocate(t, block_ids)

    def _allocate(self, t: Tracked, block_ids: list[int]) -> list[int]:
        """The request's sequence over `block_ids`, loading what tierkv holds past vLLM's own hit;
        returns the block ids promised to vLLM that could not be loaded (evicted, or not read from
        L3, since the lookup): vLLM recomputes from the first of them."""
        want = (t.local + t.promised) // self.block_size
        t.seq = self.cache.allocate(None, t.salt, match=t.match, slots=block_ids, computed=t.local)
        got = max(t.seq.num_cached_tokens, t.local) // self.block_size
        # blocks L3 was thought to hold but did not deliver are written there again once computed
        t.seq.in_l3 = (t.seq.in_l3[0], min(t.seq.in_l3[1], got))
        if self.events is not None:
            self.hashes.learn(t.seq.hashes, t.request, 0, got)
        if t.request.num_preemptions > 0:
            self.resumed_hit_tokens += sum(t.seq.cached_by_tier.values())
        t.match, t.promised = None, 0
        return block_ids[got:want]

    # ------------------------------------------------------------------ each step

    def step(self, so) -> StepWork:
        """build_connector_meta: finish the L3 reads that landed, extend and commit every scheduled
        request's sequence by the tokens this step computes, and hand the copies to the workers."""
        work = StepWork(load_errors=self.load_errors)
        self.load_errors = []
        for rid in so.preempted_req_ids or ():
            self.preemptions += 1
            self._forget(rid, keep_request=True)
        for rid in so.finished_req_ids:
            self._forget(rid)
        now = time.monotonic()
        for rid, t in self.requests.items():
            if t.fetch is not None and (t.fetch.done() or now >= t.fetch_end):
                work.load_errors += self._allocate(t, t.fetch_ids)
                work.loaded_async.append(rid)
                t.fetch, t.fetch_ids = None, []
        state = so.kv_connector_block_state
        for rid, n in so.num_scheduled_tokens.items():
            t = self.requests.get(rid)
            if t is None or state is None or not options.cacheable(t.request):
                continue
            self._extend(t, list(state.get_block_ids(rid)[0]), t.request.num_computed_tokens + n)
        work.batch, work.moves = self.cache.take_moves()
        return work

    def _extend(self, t: Tracked, block_ids: list[int], computed: int) -> None:
        """The sequence covers `block_ids` and holds the KV of its first `computed` tokens after
        this step: commit the blocks that fills (their copies run after the forward)."""
        tokens = t.request.all_token_ids
        computed = min(computed, len(tokens))
        if t.seq is None:  # nothing loaded for it: vLLM computes it all
            t.seq = self._fresh(t, block_ids)
        seq = t.seq
        new_ids = block_ids[len(seq.slots) :]
        if new_ids or computed > seq.num_tokens:
            self.cache.append(seq, max(0, computed - seq.num_tokens), slots=new_ids)
        if computed // self.block_size > seq.committed:
            first = seq.committed
            self.cache.commit(seq, list(tokens[:computed]))
            if self.events is not None:
                self.hashes.learn(seq.hashes, t.request, first, seq.committed)

    def _fresh(self, t: Tracked, block_ids: list[int]) -> SequenceBlocks:
        """A sequence for a request tierkv loads nothing into: over vLLM's blocks, computed by vLLM."""
        tokens = list(t.request.all_token_ids[: len(block_ids) * self.block_size])
        m = self.cache.match(tokens, t.salt, limit=0)  # hashes nothing: commit hashes as blocks fill
        return self.cache.allocate(None, t.salt, match=m, slots=block_ids, computed=len(tokens))

    def copies_done(self, report: CopiesDone | None) -> None:
        """update_connector_output: the workers ran every batch up to report.batch."""
        if report is not None and report.batch >= 0:
            self.cache.moves_done(report.batch)
            if not self.l2_unlinked:  # every worker has mapped L2 by its first report
                self.cache.l2.unlink()
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
        if t.seq is not None:
            self.cache.free(t.seq)
            t.seq = None
        t.match, t.fetch, t.fetch_ids = None, None, []
        if not keep_request:
            del self.requests[rid]

    def finished(self, request) -> None:
        """request_finished: its sequence is freed (the copies of its last step ran in that step)."""
        self._forget(request.request_id)

    def reset(self) -> bool:
        """reset_cache: drop L2 (L3 is shared with other processes and stays). L2 blocks that L3
        writes still read are held until written: wait for those (up to RESET_WAIT_S) rather than
        refuse. False while a request's copies hold blocks, as vLLM's own reset refuses then."""
        if self.cache.clear():
            return True
        self.cache.flush(RESET_WAIT_S)
        return self.cache.clear()

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
        self.cache.close()
