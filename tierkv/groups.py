"""KVGroups: one TieredKVCache per group of layers, behind the one cache's API, for tierkv's engine.

A model whose layers read different parts of the prefix (full-attention layers beside sliding
windows: gpt-oss, Gemma 3) keeps each group's KV (`KVLayout.groups`) in a cache of its own, with
its own L1 slots, L2 share and L3 objects (named apart by `group_tag`). A window group's cache
holds windowed layers only, so its sequences let go of the blocks their window has left
(`PagedCache.let_go`) while the full group keeps the whole prefix: L1 then holds about a window
per sequence of the window layers, not the whole context. This is how vLLM's hybrid KV-cache
manager keeps a block table per group, and how the vLLM connector maps it (integrations/vllm).

The first group decides (the full-attention one where there is one): its plan says where the hit
ends (load-or-recompute weighs its loads, the largest), whether a sequence streams and what L3
part to read; every other group follows, cut to the same hit. Where it splits an L3 part (its
start recomputed while its end is read), a window group reads only its last window's blocks of
that end, and the groups take what landed at the same block (`adopt`). A `GroupedSequence` is one
SequenceBlocks per group. Only the first group streams: a window group's L1 holds its window
beside a chunk of new tokens (`group_l1_blocks` sizes it so), so it never needs to.

Under tensor parallelism every rank builds the same caches from rank 0's split of L1
(`l1_split`, engine/workers.py); rank 0 records each cache's moves apart and the other ranks
repeat them cache by cache, so a group's slots mean the same on every rank.

Never runs a model and never touches tensors; each cache does its own moves.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from .cache import CLOSE_FLUSH_TIMEOUT_S, TieredKVCache
from .config import CacheConfig
from .errors import CacheFullError, ConfigError
from .events import BlockEvents
from .layout import KVLayout, group_tag, stored_layout
from .plan import AdmissionPlan, Match
from .prefetch import Prefetch
from .sequence import SequenceBlocks
from .tiering import default_l1_bytes
from .transfer import Transfer

log = logging.getLogger(__name__)


def group_l1_blocks(layout: KVLayout, l1_bytes: int, *, max_num_seqs: int, max_num_batched_tokens: int) -> list[int] | None:
    """L1 blocks of each of `layout.groups`' caches out of `l1_bytes`; None where the groups had
    better share one cache (a single group, or too little L1 for a window group to work alone).

    A window group gets room for the windows of `max_num_seqs` running sequences (W tokens and
    the block a window starts inside, each) plus two steps of new tokens, never more than its
    share of the layers (what one cache would give it) and never less than `_fewest_blocks`. The
    first group (full attention) takes the rest: the room the windows leave is what it gains.
    """
    groups = layout.groups
    if len(groups) < 2:
        return None
    per_layer = layout.bytes_per_block // layout.num_layers  # one layer's part of a block
    share = l1_bytes // layout.bytes_per_block  # the blocks one cache of every layer would have
    steps = 2 * -(-max_num_batched_tokens // layout.block_size)
    blocks, left = [], l1_bytes
    for g in groups[1:]:  # (sorted: only the first may attend fully)
        fewest = _fewest_blocks(g.window, layout.block_size)
        n = min(share, max(fewest, max_num_seqs * (-(-g.window // layout.block_size) + 1) + steps))
        if n < fewest:
            return None
        blocks.append(n)
        left -= n * per_layer * len(g.layers)
    first = left // (per_layer * len(groups[0].layers))
    if first < (_fewest_blocks(groups[0].window, layout.block_size) if groups[0].window else 1):
        return None
    return [first, *blocks]


def _fewest_blocks(window: int, block_size: int) -> int:
    """The fewest L1 blocks a window group's cache works with: a sequence's window (and the block
    it starts inside) beside a chunk of half of L1 (`Admission.lets_go`), so it never streams."""
    return 2 * (-(-window // block_size) + 1) + 1


@dataclass(slots=True, eq=False)
class GroupedSequence:
    """A running sequence's blocks in every group's cache: `parts[g]` is group g's SequenceBlocks.
    The engine reads it as one sequence; the first group's part is the one that may stream."""

    parts: list[SequenceBlocks]

    @property
    def offloaded(self) -> int:
        return self.parts[0].offloaded

    @property
    def pending(self) -> list[Transfer]:
        return [t for p in self.parts for t in p.pending]

    @property
    def cached_by_tier(self) -> dict[str, int]:
        return self.parts[0].cached_by_tier

    @property
    def num_tokens(self) -> int:
        return min(p.num_tokens for p in self.parts)

    @property
    def num_cached_tokens(self) -> int:
        return min(p.num_cached_tokens for p in self.parts)

    @property
    def committed(self) -> int:
        return min(p.committed for p in self.parts)

    def loaded(self) -> bool:
        return all(p.loaded() for p in self.parts)

    def wait(self) -> None:
        for p in self.parts:
            p.wait()


@dataclass(slots=True)
class GroupedPlan:
    """Every group's AdmissionPlan for one prompt, all cut to the same hit. The scheduler reads
    it as one AdmissionPlan and hands its `match`, `reserve` and `tail` back to `KVGroups`."""

    plans: list[AdmissionPlan]
    # the end of the L3 part that each group reads while the start is recomputed (the first
    # group's split; a window group's last window of it), None without one
    tail: list[tuple[int, int] | None] | None = None

    @property
    def tail_deadline_s(self) -> float:
        return self.plans[0].tail_deadline_s

    @property
    def adopt_at(self) -> int | None:
        return self.plans[0].adopt_at

    @property
    def tail_tokens(self) -> int:
        return self.plans[0].tail_tokens

    @property
    def match(self) -> list[Match]:
        return [p.match for p in self.plans]

    @property
    def stream(self) -> bool:
        return self.plans[0].stream

    @property
    def reserve(self) -> list[int | None]:
        return [p.reserve for p in self.plans]

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.plans)

    @property
    def room_decides(self) -> bool:
        return all(p.room_decides for p in self.plans)

    @property
    def l2_tokens(self) -> int:
        return sum(p.l2_tokens for p in self.plans)

    @property
    def fetch(self) -> list[tuple[int, int] | None] | None:
        fetches = [p.fetch for p in self.plans]
        return None if all(f is None for f in fetches) else fetches

    @property
    def fetch_deadline_s(self) -> float:
        return min(p.fetch_deadline_s for p in self.plans if p.fetch is not None)


@dataclass(slots=True)
class GroupedPrefetch:
    """Every group's L3 read for one prompt, as one Prefetch: done once each group's is, and
    expected when the last is."""

    parts: list[Prefetch | None]
    # set by a caller that waits for it (Prefetch's): since when, when it stops, and when it did
    reached_at: float | None = None
    give_up_at: float | None = None
    abandoned_at: float | None = None

    def done(self) -> bool:
        return all(p is None or p.done() for p in self.parts)

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        return all([p is None or p.wait(None if end is None else max(0.0, end - time.monotonic()))
                    for p in self.parts])

    def expected_by(self, now: float) -> float:
        return max((p.expected_by(now) for p in self.parts if p is not None), default=0.0)

    def abandon(self) -> None:
        for p in self.parts:
            if p is not None:
                p.abandon()


@dataclass(frozen=True, slots=True)
class GroupPools:
    """One tier's pools of every group, as the reports that count blocks see them: the blocks of
    all groups (of different sizes: `capacity_bytes` in stats says the bytes), pinned or not."""

    num_blocks: int
    pinned: bool
    kv: list[torch.Tensor] | None = field(default=None, repr=False)  # L1: each model layer's pool, in layer order


class KVGroups:
    """The caches of a model's layer groups, with the part of TieredKVCache's API that tierkv's
    engine speaks (scheduler, runner, server). Build it with `KVGroups.build`."""

    def __init__(self, layout: KVLayout, caches: list[TieredKVCache]) -> None:
        self.layout, self.caches = layout, caches
        self.groups = layout.groups
        self.lead = caches[0]  # the group that decides: full attention where there is one
        self.block_size = layout.block_size
        # model layer -> its group, its place among that group's layers, and its L1 pool
        self.group_of, self.local = [0] * layout.num_layers, [0] * layout.num_layers
        kv = [None] * layout.num_layers
        for g, (group, cache) in enumerate(zip(self.groups, caches)):
            for j, layer in enumerate(group.layers):
                self.group_of[layer], self.local[layer] = g, j
                kv[layer] = cache.l1.kv[j] if cache.l1.kv is not None else None
        self.l1 = GroupPools(sum(c.l1.num_blocks for c in caches), False, kv)
        l2s = [c.l2 for c in caches if c.l2 is not None]
        self.l2 = GroupPools(sum(p.num_blocks for p in l2s), all(p.pinned for p in l2s)) if l2s else None

    @classmethod
    def build(cls, layout: KVLayout, config: CacheConfig, blocks: list[int], *, device: torch.device,
              model: str, exchanges: list | None = None, tp_rank: int = 0) -> KVGroups:
        """A cache per group of `layout`, group g with `blocks[g]` L1 blocks (group_l1_blocks) and
        a share of `config.l2` by its layers; each names its blocks `<model>-<group_tag>`.
        Tensor parallel: `exchanges[g]` is group g's way to the other ranks' heads (rank 0, with
        an L3), `tp_rank` this rank."""
        subs = [layout.of_group(g) for g in layout.groups]
        shares = [config.l2 * sub.num_layers // layout.num_layers for sub in subs]  # L2 by layers
        stored = [stored_layout(sub, config.kv_offload_dtype).bytes_per_block for sub in subs]  # an L2 block's bytes
        if config.l2 and any(share < b for share, b in zip(shares, stored)):
            least = max(-(-b * layout.num_layers // sub.num_layers) for sub, b in zip(subs, stored))
            raise ConfigError(f"l2 = {config.l2} bytes is shared among this model's layer groups by their layers, "
                              f"and some group's share holds no block of its own: raise l2 to at least {least} "
                              "bytes, or set it to 0 for no L2")
        exchanges = exchanges or [None] * len(subs)
        caches: list[TieredKVCache] = []
        try:
            for i, (group, sub, n, share) in enumerate(zip(layout.groups, subs, blocks, shares)):
                tag = group_tag(i, group.window)
                cfg = replace(config, l1=n * sub.bytes_per_block, l2=share,
                              l2_file=f"{config.l2_file}-{tag}" if config.l2_file else None)
                caches.append(TieredKVCache(sub, cfg, device=device, model=f"{model}-{tag}" if model else "",
                                            exchange=exchanges[i], tp_rank=tp_rank))
        except BaseException:
            for c in caches:
                c.close()
            raise
        return cls(layout, caches)

    # ------------------------------------------------------------------ sizes

    def blocks_needed(self, num_tokens: int) -> int:
        return self.lead.blocks_needed(num_tokens)

    @property
    def stream_window(self) -> int:
        return self.lead.stream_window

    @property
    def lets_go(self) -> bool:
        return all(c.lets_go for c in self.caches)

    def l1_room(self) -> int:
        """Every group's L1 slots to be had now, together (they free together: a sequence holds
        blocks in each)."""
        return sum(c.l1_room() for c in self.caches)

    def step_tokens(self, streams: bool = False) -> int:
        """The fewest any group lets a sequence compute in a step (a window group: its chunk)."""
        return min(c.step_tokens(streams and c is self.lead) for c in self.caches)

    def must_stream(self, num_tokens: int) -> bool:
        return self.lead.must_stream(num_tokens)

    def load_seconds(self, seq: GroupedSequence) -> float:
        """Every group's loads into `seq`, one after another on the copy stream."""
        return sum(c.load_seconds(part) for c, part in zip(self.caches, seq.parts))

    def max_tokens(self) -> int:
        return min(c.max_tokens() for c in self.caches)

    # ------------------------------------------------------------------ admission

    def plan(self, tokens, salt: str | None = None, *, budget: int, prefix_caching: bool = True,
             recompute_seconds_per_token: float | None = None, deadline_s: float = 1.0) -> GroupedPlan:
        """Each group's plan, cut to the hit every group holds. The first group weighs
        load-or-recompute; where it splits off an L3 tail, each group reads its part (`_tails`)."""
        lead = self.lead.plan(tokens, salt, budget=budget, prefix_caching=prefix_caching,
                              recompute_seconds_per_token=recompute_seconds_per_token, deadline_s=deadline_s)
        hit = lead.match.tokens
        while True:
            plans = [lead] + [c.plan(tokens, salt, budget=budget, prefix_caching=prefix_caching, deadline_s=deadline_s,
                                     limit=hit) for c in self.caches[1:]]
            least = min(p.match.tokens for p in plans)
            if least == hit:
                return GroupedPlan(plans, self._tails(plans[0]))
            hit = least  # a group holds less: every group stops there
            lead = self.lead.plan(tokens, salt, budget=budget, prefix_caching=prefix_caching, deadline_s=deadline_s,
                                  limit=hit)

    def _tails(self, lead: AdmissionPlan) -> list[tuple[int, int] | None] | None:
        """The L3 blocks each group reads while the first recomputes up to its split: the first
        group's tail, and of that part a window group's last window (`window_reads`: no query
        past the tail reads the window layers' keys before it)."""
        if lead.tail is None:
            return None
        first, end = lead.adopt_at // self.block_size, lead.tail[1]
        return [lead.tail] + [c.window_reads(first, end) for c in self.caches[1:]]

    def prefetch(self, matches: list[Match], deadline_s: float | None = None, *, priority: int = 0,
                 blocks: list[tuple[int, int] | None] | None = None) -> GroupedPrefetch:
        blocks = blocks or [None] * len(self.caches)
        return GroupedPrefetch([c.prefetch(m, deadline_s, priority=priority, blocks=b) if b is not None else None
                                for c, m, b in zip(self.caches, matches, blocks)])

    def warm(self, matches: list[Match], keep: int = 0, limit: int | None = None) -> int:
        """Each group's `warm` (TieredKVCache.warm), leaving `keep` of its room to others, `limit`
        loads at most."""
        return sum(c.warm(m, keep, limit) for c, m in zip(self.caches, matches))

    def allocate(self, tokens=None, salt: str | None = None, *, priority: int = 0, match: list[Match],
                 stream: bool = False, reserve: list[int | None] | None = None) -> GroupedSequence:
        """Every group's sequence; CacheFullError (holding nothing) when one group has no room."""
        reserve = reserve or [None] * len(self.caches)
        parts: list[SequenceBlocks] = []
        try:
            for c, m, r in zip(self.caches, match, reserve):
                parts.append(c.allocate(tokens, salt, priority=priority, match=m, stream=stream and c is self.lead,
                                        reserve=r))
        except CacheFullError:
            for c, p in zip(self.caches, parts):
                c.free(p)
            raise
        return GroupedSequence(parts)

    # ------------------------------------------------------------------ a running sequence

    def append(self, seq: GroupedSequence, num_tokens: int = 1) -> None:
        """Room for `num_tokens` more tokens past `seq.num_tokens` in every group; CacheFullError,
        changing nothing, when one group cannot make it."""
        end = seq.num_tokens + num_tokens
        # (most steps add a token to blocks every group has already: no group is asked for room)
        short = [(c, p) for c, p in zip(self.caches, seq.parts) if c.blocks_needed(end) > len(p.slots)]
        if not all(c.can_append(p, end - p.num_tokens) for c, p in short):
            raise CacheFullError(f"a sequence of {end} tokens needs more L1 blocks than some layer group can free")
        for c, p in zip(self.caches, seq.parts):
            if end > p.num_tokens:
                c.append(p, end - p.num_tokens)

    def adopt(self, seq: GroupedSequence, tokens) -> int:
        """Take the landed end of an L3 part in every group, up to the furthest block where every
        group holds what it needs (the first group every block from its committed prefix on, a
        window group its last window's), or none: the groups always stand at the same block."""
        ends = self.lead.adoptable(seq.parts[0], tokens)
        for c, p in zip(self.caches[1:], seq.parts[1:]):
            ends = c.adoptable(p, tokens, ends) if ends else []
        if not ends:
            return 0
        for c, p in zip(self.caches[1:], seq.parts[1:]):
            c.adopt(p, tokens, upto=ends[0])
        return self.lead.adopt(seq.parts[0], tokens, upto=ends[0])

    def let_go(self, seq: GroupedSequence, first_query: int, streams: bool = False) -> int:
        """Each window group lets go of the blocks its window has left (they never stream); the
        first group only where it is windowed and `seq` does not stream."""
        return sum(c.let_go(p, first_query, streams and c is self.lead) for c, p in zip(self.caches, seq.parts))

    def commit(self, seq: GroupedSequence, tokens) -> int:
        return min(c.commit(p, tokens) for c, p in zip(self.caches, seq.parts))

    def fork(self, seq: GroupedSequence, n: int, num_tokens: int) -> list[GroupedSequence]:
        """As TieredKVCache.fork, in every group: as many as every group has room for."""
        forks = [c.fork(p, n, num_tokens) for c, p in zip(self.caches, seq.parts)]
        count = min(map(len, forks))
        for c, made in zip(self.caches, forks):
            for extra in made[count:]:
                c.free(extra)
        return [GroupedSequence([made[i] for made in forks]) for i in range(count)]

    def free(self, seq: GroupedSequence) -> None:
        for c, p in zip(self.caches, seq.parts):
            c.free(p)

    def offload(self, seq: GroupedSequence, num_blocks: int) -> int:
        """Only the first group streams: its oldest blocks go to L2 (a window group lets go instead)."""
        return self.lead.offload(seq.parts[0], num_blocks)

    def stream(self, seqs: list[GroupedSequence]):
        """The first group's LayerStream: its layers read streamed sequences' older blocks from L2."""
        return self.lead.stream([s.parts[0] for s in seqs])

    @property
    def streamer(self):
        """The first group's LayerStreamer (None without L2): the one that streams."""
        return self.lead.streamer

    def wait_for_layer(self, layer: int, seqs: list[GroupedSequence]) -> None:
        g = self.group_of[layer]
        self.caches[g].wait_for_layer(self.local[layer], [s.parts[g] for s in seqs])

    def live_sequences(self) -> list[SequenceBlocks]:
        return [s for c in self.caches for s in c.live_sequences()]

    # ------------------------------------------------------------------ lifecycle, reporting

    def synchronize(self) -> None:
        for c in self.caches:
            c.synchronize()

    def flush(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        return all([c.flush(None if end is None else max(0.0, end - time.monotonic())) for c in self.caches])

    def evict(self, tier: str) -> None:
        for c in self.caches:
            c.evict(tier)

    def clear(self) -> bool:
        return all([c.clear() for c in self.caches])

    def listen(self, events: BlockEvents | None) -> None:
        """KV events name the first group's blocks: every group holds the same prefixes (as the
        vLLM connector reports them)."""
        self.lead.listen(events)

    def close(self, timeout: float = CLOSE_FLUSH_TIMEOUT_S) -> None:
        for c in self.caches:
            c.close(timeout)

    def stats(self) -> dict:
        """The first group's stats (lookups and hit tokens: every group serves the same hit) with
        the blocks and bytes of every group added up, and each group's own under "groups"."""
        each = [c.stats() for c in self.caches]
        out = copy.deepcopy(each[0])
        for s in each[1:]:
            _add_work(out, s)
            for tier, counters in out["tiers"].items():
                _add_work(counters, s["tiers"][tier])
        out["groups"] = [{"group": group_tag(i, g.window), "layers": list(g.layers), **s}
                         for i, (g, s) in enumerate(zip(self.groups, each))]
        return out


# Every group answers the same lookups, so these counters are the first group's; every other
# counter (blocks, bytes, evictions, waits, at the top and per tier) is a group's own work
SHARED_COUNTERS = ("queries", "query_tokens", "hit_tokens")


def _add_work(total: dict, group: dict) -> None:
    """Add a group's counters of its own work (its ints but SHARED_COUNTERS) into `total`."""
    for key, value in group.items():
        if key not in SHARED_COUNTERS and isinstance(value, int) and not isinstance(value, bool):
            total[key] += value


def l1_split(layout: KVLayout, config: CacheConfig, *, device: torch.device, max_num_seqs: int,
             max_num_batched_tokens: int) -> list[int] | None:
    """The L1 blocks of each layer group's cache for tierkv's engine (group_l1_blocks) out of
    `config.l1` (or the default for `device`); None: one cache for every layer. Under tensor
    parallelism rank 0 decides it and the other ranks take its answer (engine/workers.py)."""
    l1 = config.l1 if config.l1 is not None else default_l1_bytes(device)
    return group_l1_blocks(layout, l1, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def make_cache(layout: KVLayout, config: CacheConfig, *, device: torch.device, model: str, blocks: list[int] | None,
               exchanges: list | None = None, tp_rank: int = 0) -> TieredKVCache | KVGroups:
    """The cache of tierkv's engine: a KVGroups with `blocks[g]` L1 blocks for layer group g
    (`l1_split`), or one cache where `blocks` is None. `exchanges`: each cache's L3 exchange
    (tensor parallel rank 0 with an L3); `tp_rank`: this rank."""
    if blocks is not None:
        return KVGroups.build(layout, config, blocks, device=device, model=model, exchanges=exchanges, tp_rank=tp_rank)
    return TieredKVCache(layout, config, device=device, model=model, exchange=exchanges[0] if exchanges else None,
                         tp_rank=tp_rank)


def caches_of(cache: TieredKVCache | KVGroups) -> list[TieredKVCache]:
    """The caches behind an engine's cache, in group order: each moves its own blocks."""
    return cache.caches if isinstance(cache, KVGroups) else [cache]
