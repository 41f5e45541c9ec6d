"""Load or recompute: how much of a cached prefix is worth bringing up, given measured speeds.

Arithmetic only, over the tiers' load-time estimates (Tiering.load_seconds) and the engine's
cost of recomputing a block: it never moves a byte and never changes the index. Used by
TieredKVCache.match.
"""

from __future__ import annotations

from .index import BlockEntry
from .tiering import Tiering

# L3 blocks loaded anyway while L3's read speed is unmeasured and recomputing looks cheaper: a
# cheap probe, so that load-or-recompute learns the real speed instead of never reading.
L3_PROBE_BLOCKS = 16


def worth_loading(
    tiers: Tiering, blocks: list[BlockEntry], l3_blocks: int, usable: int, per_block: float
) -> tuple[list[BlockEntry], int]:
    """The cached prefix worth loading: `blocks` (L1/L2 hits, in order) followed by `l3_blocks`
    L3 hits, out of `usable` blocks of the prompt. Returns the leading blocks and L3 count of
    the k that minimises load time of the first k plus recompute time of the rest."""
    kinds = [e.tier() for e in blocks] + ["l3"] * l3_blocks
    # Loads of one tier travel together: cost of the first k = sum over tiers of load_seconds(count).
    counts = {"l1": 0, "l2": 0, "l3": 0}
    best_k, best = 0, usable * per_block
    for k, tier in enumerate(kinds, start=1):
        counts[tier] += 1
        cost = sum(tiers.load_seconds(t, c) for t, c in counts.items()) + (usable - k) * per_block
        if cost < best:
            best_k, best = k, cost
    if best_k >= len(blocks) and l3_blocks and not tiers.l3.read_measured:
        best_k = min(best_k + L3_PROBE_BLOCKS, len(kinds))
    return blocks[:best_k], max(0, best_k - len(blocks))


def tail_to_read(tiers: Tiering, first: int, end: int, per_block: float) -> tuple[int, int] | None:
    """Blocks [j, end) of an L3 run [first, end) to read while [first, j) is recomputed (the end's
    KV does not depend on the start): the j where both take as long, if that beats recomputing
    the whole run; None otherwise."""

    def compute(j: int) -> float:
        return (j - first) * per_block

    def read(j: int) -> float:
        return tiers.load_seconds("l3", end - j)

    lo, hi = first, end  # compute time grows with j and read time shrinks: bisect the crossing
    while lo < hi:
        mid = (lo + hi) // 2
        if compute(mid) < read(mid):
            lo = mid + 1
        else:
            hi = mid
    candidates = [j for j in (lo - 1, lo) if first < j < end]
    if not candidates:
        return None
    j = min(candidates, key=lambda j: max(compute(j), read(j)))
    return (j, end) if max(compute(j), read(j)) < compute(end) else None
