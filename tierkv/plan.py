"""How one prompt enters the cache: what a lookup found, the admission plan, and the
load-or-recompute arithmetic behind it.

`Match` is the longest cached prefix a lookup found (TieredKVCache.match). `AdmissionPlan` is
everything a scheduler needs to admit a request, decided in one place (TieredKVCache.plan): the
match (what each tier serves, cut where recomputing beats loading), whether the sequence streams,
how much L1 it reserves now, which L3 blocks to fetch first or to read in the background, their
deadlines, and whether L1 can take it now. The functions below are arithmetic over the tiers'
load-time estimates (Tiering.load_seconds, which count the L3 reads queued already) and the
engine's cost of recomputing a block: `worth_loading` for L1/L2 hits, `split_l3` for an L3 run.
Nothing here moves a byte or changes the index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .index import BlockEntry
from .tiering import Tiering

# L3 blocks loaded anyway while L3's read speed is unmeasured and recomputing looks cheaper: a
# cheap probe, so that load-or-recompute learns the real speed instead of never reading.
L3_PROBE_BLOCKS = 16


@dataclass(slots=True)
class Match:
    """The longest cached prefix of a prompt. `tokens` is a multiple of the block size."""

    tokens: int
    by_tier: dict[str, int]  # tokens served by each tier: {"l1": .., "l2": .., "l3": ..}
    ns: bytes = field(repr=False)
    token_bytes: bytes = field(repr=False)
    hashes: list[int] = field(repr=False)  # chained hashes of every full block of the prompt
    blocks: list[BlockEntry] = field(repr=False)  # the matched blocks, in order
    removals: int = field(default=0, repr=False)  # the index's removal count when they were found
    # Blocks [j, m) of the prompt that L3 holds but that are cheaper to load in the background
    # while blocks up to j are recomputed than to load first or to recompute (see `match`).
    tail: tuple[int, int] | None = None
    owner: object = field(default=None, repr=False)  # the cache that made it
    query_tokens: int = field(default=0, repr=False)  # tokens the lookup could have hit (its limit)
    # Blocks [first, end) of the prompt that the lookup found in L3, whether or not load-or-recompute
    # takes them: a sequence that recomputes them knows L3 has them already (SequenceBlocks.in_l3)
    in_l3: tuple[int, int] = (0, 0)
    # made for `allocate` where every layer slides (`match(window_hits=True)`): blocks before the
    # last window may be None, held by no tier (no layer reads them)
    window_hits: bool = False


@dataclass(slots=True)
class AdmissionPlan:
    """How to admit one prompt now. Made by `TieredKVCache.plan`; a scheduler applies it with
    `prefetch` (fetch, tail) and `allocate` (match, stream, reserve), deciding nothing itself."""

    match: Match  # the cached prefix worth taking, per tier; match.tokens is where recomputing starts
    stream: bool  # larger than L1: its leading L2 blocks stay in L2 and attention streams them
    reserve: int | None  # tokens to take L1 room for now (None: the whole prompt)
    fits: bool  # whether L1 can make that room now
    # Blocks [first, end) of the prompt to read from L3 into L2 before admission (None: nothing),
    # and how long to wait for them; what has not arrived by then is recomputed.
    fetch: tuple[int, int] | None
    fetch_deadline_s: float
    # Blocks [first, end) of an L3 hit to read in the background while the blocks before them are
    # recomputed, taken (`adopt`) once the computation reaches them; with their deadline. Where
    # every layer slides, only the last window's blocks of that end are read (`window_reads`).
    tail: tuple[int, int] | None
    tail_deadline_s: float
    adopt_at: int | None  # prompt position where the computation stops to take the tail
    tail_tokens: int = 0  # the tokens taking the tail saves computing: from adopt_at to its end

    @property
    def room_decides(self) -> bool:
        """Whether L1's room alone decides `fits`: the whole prompt is reserved, not a chunk sized
        by the step's budget (so a plan refused at some room is refused again until it grows)."""
        return self.reserve is None

    @property
    def l2_tokens(self) -> int:
        """Prompt tokens whose blocks admission loads from L2 (`allocate`, or `warm` before it)."""
        return self.match.by_tier["l2"]


def worth_loading(tiers: Tiering, blocks: list[BlockEntry], usable: int, per_block: float) -> list[BlockEntry]:
    """The leading `blocks` (L1/L2 hits, in order, out of `usable` blocks of the prompt) worth
    loading: the k that minimises load time of the first k plus recompute time of the rest."""
    kinds = [e.tier() if e is not None else "l1" for e in blocks]  # (None: before a window, nothing to load)
    # Loads of one tier travel together, and each tier's estimate is affine in the block count
    # (a round trip, then bytes over bandwidth): cost of the first k = sum over the tiers used of
    # (fixed + per_block * count). Both parts are read once, so a 100K-token prompt's scan is
    # plain arithmetic, not thousands of estimate calls.
    per, fixed = {"l1": 0.0}, {"l1": 0.0}
    for t in {k for k in kinds if k != "l1"}:
        per[t] = tiers.load_seconds(t, 2) - tiers.load_seconds(t, 1)
        fixed[t] = tiers.load_seconds(t, 1) - per[t]
    started = {"l1": False, "l2": False}
    load = 0.0
    best_k, best = 0, usable * per_block
    for k, tier in enumerate(kinds, start=1):
        if not started[tier]:
            started[tier] = True
            load += fixed[tier]
        load += per[tier]
        cost = load + (usable - k) * per_block
        if cost < best:
            best_k, best = k, cost
    return blocks[:best_k]


def split_l3(tiers: Tiering, first: int, end: int, per_block: float) -> int:
    """Where to split an L3 run [first, end) of a prompt: blocks [first, j) are recomputed while
    [j, end) is read (the end's KV does not depend on the start), and the computation takes the
    read once it reaches j. Returns the smallest j whose read is expected to land before the
    computation reaches it, counting the reads queued ahead of it on the one reader thread
    (Tiering.load_seconds): reads for other requests push the split toward recomputing. `end`
    means the run is recomputed whole and nothing is read (no read would come in time);
    `first` that it is read whole before anything is computed (recomputing even one block takes
    longer than reading all of it)."""
    if tiers.load_seconds("l3", end - first) <= per_block:
        return first

    def in_time(j: int) -> bool:  # the read of [j, end) lands before the computation reaches j
        return tiers.load_seconds("l3", end - j) <= (j - first) * per_block

    lo, hi = first + 1, end  # reading less lands sooner while computing more takes longer: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        if in_time(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
