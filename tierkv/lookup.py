"""Lookups: which blocks of a prompt the tiers hold, and bringing L3's part of them up into L2.

`match` walks the chained hashes of a prompt through the index (where every layer slides, up to
the last window only: `_walk`), weighs load-or-recompute (plan.py's arithmetic) and finds the
L3 part; `prefetch` reads that part into L2 in the background. Mixed into Admission, which
decides what a prompt takes from them. Never allocates L1, never changes a sequence, and counts
nothing but lookups' own work (hits are counted when blocks are used: `Admission._count_hits`).
"""

from __future__ import annotations

import time

from .errors import UsageError
from .guard import guarded
from .hashing import hash_blocks, namespace, token_bytes
from .index import BlockEntry, BlockIndex
from .layout import KVLayout
from .plan import L3_PROBE_BLOCKS, Match, split_l3, worth_loading
from .prefetch import Prefetch
from .tiering import Tiering
from .tiers import DevicePool
from .tiers.codec import BlockId


class Lookups:
    """Lookups of prompts in the tiers. Mixed into Admission (TieredKVCache's base), which builds these:"""

    layout: KVLayout
    block_size: int
    model: str
    tp_rank: int
    tiers: Tiering
    l1: DevicePool
    index: BlockIndex
    lets_go: bool  # (Admission's: every layer slides and L1 holds a window beside a chunk)

    def namespace(self, salt: str | None = None) -> bytes:
        # the format L3 stores: an fp8 cache and a bf16 one name their objects apart, and a
        # tensor-parallel engine (which stores every head) names them as a single-GPU one does;
        # blocks of an engine's buffers whose layout their shape cannot confirm are named by the
        # layout declared, so that a cache reading its buffers another way misses them
        return namespace(self.model, self.tiers.l3_layout.fingerprint + self.l1.unconfirmed, self.tp_rank, salt)

    @guarded
    def match(
        self, tokens, salt: str | None = None, *, limit: int | None = None,
        recompute_seconds_per_token: float | None = None, window_hits: bool = False,
    ) -> Match:
        """The longest prefix of `tokens` whose full blocks some tier holds.

        At most `limit` tokens count; by default len(tokens) - 1, because the last token of a
        prompt must be computed to get its logits. Pass limit=len(tokens) to match everything.
        With `recompute_seconds_per_token`, the match stops where loading the rest of the hit
        from its tiers is expected to take longer than recomputing it (load-or-recompute); if it
        stops before an L3 part, `tail` says which end of that part is worth reading while the
        start is recomputed (the two overlap: the end's KV does not depend on the start).
        `match.tokens` counts what the tiers hold, L3 included: what a sequence allocated from it
        starts with is `seq.num_cached_tokens` (`admit` brings the L3 part in first).
        `window_hits` (for `allocate`, where a sequence `lets_go`): a prefix whose last window's
        blocks are cached is a hit even where no tier holds the blocks before that window, which
        no layer reads; their entries in `match.blocks` are None.
        """
        self.tiers.reap()
        tb = token_bytes(tokens)
        n = len(tb) // 4
        limit = max(n - 1, 0) if limit is None else max(0, min(limit, n))
        ns = self.namespace(salt)
        # limit=0 is how an engine with prefix caching off allocates: nothing to hash or look up
        hashes = hash_blocks(tb, self.block_size, ns) if limit else []
        usable = hashes[: limit // self.block_size]
        window_hits = window_hits and self.lets_go
        blocks = self._walk(usable, ns, tb, window_hits)
        l3_blocks = (self.tiers.l3_present(hashes[len(blocks) :], len(blocks), len(usable) - len(blocks))
                     if len(blocks) < len(usable) else 0)
        tail, in_l3 = None, (len(blocks), len(blocks) + l3_blocks)
        if recompute_seconds_per_token is not None:
            per_block = recompute_seconds_per_token * self.block_size
            found, found_l3 = len(blocks), l3_blocks
            blocks = self._whole_windows(worth_loading(self.tiers, blocks, len(usable), per_block))
            l3_blocks = 0
            if found_l3 and len(blocks) == found:  # the L3 run follows what is taken: split it
                end = found + found_l3
                j = split_l3(self.tiers, found, end, per_block)
                if j == found:
                    l3_blocks = found_l3  # read whole first
                elif not self.tiers.l3.read_measured:
                    l3_blocks = min(L3_PROBE_BLOCKS, found_l3)  # a probe, read first: the speed is a guess
                elif j < end:
                    tail = (j, end)
        by_tier = {"l1": 0, "l2": 0, "l3": l3_blocks * self.block_size}
        for e in blocks:  # (None, before a window: nothing to load, counted with L1)
            by_tier["l1" if e is None else e.tier()] += self.block_size
        matched = (len(blocks) + l3_blocks) * self.block_size
        return Match(matched, by_tier, ns, tb, hashes, blocks, self.index.removals, tail, owner=self,
                     query_tokens=limit, in_l3=in_l3, window_hits=window_hits)

    def _walk(self, hashes: list[int], ns: bytes, tb: bytes, window_hits: bool) -> list[BlockEntry | None]:
        """Entries of the longest prefix of `hashes` the tiers hold. With `window_hits` (every
        layer windowed), of the longest prefix whose blocks from its window's start on are held:
        None for the blocks before that which no tier holds (no layer reads them)."""
        blocks: list[BlockEntry | None] = self.index.walk(hashes, ns, tb, self.block_size)
        k, stride = len(hashes), 4 * self.block_size
        while window_hits and k > len(blocks):
            start = self.layout.first_block_read(k * self.block_size)
            window = []
            for i in range(k - 1, start - 1, -1):  # from the end: the last miss rules out every end past it
                entry, _ = self.index.lookup(hashes[i], hashes[i - 1] if i else 0, ns, tb[i * stride : (i + 1) * stride])
                if entry is None:
                    k = i
                    break
                window.append(entry)
            else:
                return blocks[:start] + [None] * (start - len(blocks)) + window[::-1]
        return blocks

    def _whole_windows(self, blocks: list[BlockEntry | None]) -> list[BlockEntry | None]:
        """The longest prefix of `blocks` whose window holds no None (a cut of a window hit,
        by load-or-recompute, must leave every block its next query reads)."""
        k = len(blocks)
        while k and None in blocks[self.layout.first_block_read(k * self.block_size) : k]:
            k -= 1
        return blocks[:k]

    @guarded
    def prefetch(
        self, match: Match, deadline_s: float | None = None, *, priority: int = 0,
        blocks: tuple[int, int] | None = None,
    ) -> Prefetch:
        """Start bringing the match's L3 blocks into L2, in the background.

        Returns at once; once `done()`, `match`/`allocate` find the blocks that arrived in L2.
        What has not arrived `deadline_s` seconds from now is not read: the engine recomputes it.
        `blocks=(j, m)` reads blocks j..m-1 of the prompt instead (`match.tail`), which a running
        sequence takes with `adopt` once it has computed the blocks before them.
        """
        self._check_match(match)
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        return self.tiers.prefetch(self._l3_ids(match, *(blocks or self._l3_part(match))), deadline, priority)

    def _l3_part(self, match: Match) -> tuple[int, int]:
        """Blocks [first, end) of the match's prompt that it found in L3 (after its L1/L2 blocks)."""
        return len(match.blocks), match.tokens // self.block_size

    def _l3_ids(self, match: Match, first: int, end: int) -> list[BlockId]:
        """BlockIds of blocks first..end-1 of the match's prompt, in chain order."""
        stride = 4 * self.block_size
        # (a match limited to no tokens hashed none: a layer group's, following a first group
        # that recomputes from the start while it reads the end)
        hashes = match.hashes if len(match.hashes) >= end else \
            hash_blocks(match.token_bytes[: end * stride], self.block_size, match.ns)
        return [
            BlockId(hashes[i], hashes[i - 1] if i else 0, match.ns, match.token_bytes[i * stride : (i + 1) * stride], i)
            for i in range(first, end)
        ]

    def _check_match(self, match: Match, tokens=None, salt: str | None = None, *, salted: bool = False) -> None:
        """A match handed back to the cache must be one of its own, for `tokens` and `salt` when given."""
        if not isinstance(match, Match) or match.owner is not self:
            raise UsageError("the match was not made by this cache's match() or plan(); look the tokens up here")
        if salted and match.ns != self.namespace(salt):
            raise UsageError("the match was made for another salt (cache_salt) than the one given; "
                             "pass the salt it was made with, or match the tokens under this salt")
        if tokens is not None and token_bytes(tokens) != match.token_bytes:
            raise UsageError("the match was made for other tokens than the ones given; pass the tokens it "
                             "was made for (or tokens=None), or match these tokens")
