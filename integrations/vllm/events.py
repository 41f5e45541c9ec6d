"""tierkv's block records as vLLM's KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared),
published by vLLM with its own GPU events when --kv-events-config is on.

A router must see one identity per block in every medium, so the events carry vLLM's own block
hashes (request.block_hashes), not tierkv's: VllmHashes remembers, for each block tierkv stores
or loads for a request, vLLM's hash of it. L2 blocks are medium "CPU"; L3 blocks "STORAGE", with
the store's locality and ownership. Never changes the cache.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tierkv.events import CLEARED, STORED

MAX_HASHES = 1_000_000  # tierkv -> vLLM hashes remembered (oldest forgotten: ~100 MB at most)


class VllmHashes:
    """tierkv block hash -> vLLM's hash of the same block, for the blocks requests touched."""

    def __init__(self) -> None:
        self._of: OrderedDict[int, bytes | int] = OrderedDict()

    def learn(self, tierkv_hashes: list[int], request, first: int, end: int) -> None:
        """Blocks first..end-1 of `request` have tierkv hashes tierkv_hashes[first:end]."""
        theirs = request.block_hashes
        for i in range(first, min(end, len(theirs), len(tierkv_hashes))):
            self._of[tierkv_hashes[i]] = maybe_convert_block_hash(theirs[i])  # as vLLM's own events send it
            self._of.move_to_end(tierkv_hashes[i])
        while len(self._of) > MAX_HASHES:
            self._of.popitem(last=False)

    def of(self, h: int):
        """vLLM's hash of block `h`, or tierkv's own (masked to 64 bits) for a block no request here touched."""
        return self._of.get(h, h & 0xFFFF_FFFF_FFFF_FFFF)


def vllm_events(records: deque[tuple], hashes: VllmHashes, block_size: int) -> list:
    """The records as vLLM's events: a run of stored blocks that chain in one medium is one
    BlockStored (as vLLM sends one per run), consecutive removals from one medium one BlockRemoved."""
    out: list = []
    run: list[tuple] = []  # records of the open run

    def close() -> None:
        if not run:
            return
        kind, medium = run[0][0], run[0][1]
        where = {k: v for k, v in (("locality", medium.locality), ("ownership", medium.ownership)) if v is not None}
        if kind == STORED:
            tokens = np.frombuffer(b"".join(r[4] for r in run), dtype="<i4").tolist()
            out.append(BlockStored(block_hashes=[hashes.of(r[2]) for r in run],
                                   parent_block_hash=hashes.of(run[0][3]) if run[0][3] else None,
                                   token_ids=tokens, block_size=block_size, lora_id=None, medium=medium.name,
                                   lora_name=None, group_idx=0, **where))
        else:
            out.append(BlockRemoved(block_hashes=[hashes.of(r[2]) for r in run], medium=medium.name, group_idx=0,
                                    **where))
        run.clear()

    for rec in records:
        if rec[0] == CLEARED:
            close()
            out.append(AllBlocksCleared())
            continue
        continues = run and rec[0] == run[-1][0] and rec[1] == run[-1][1] and (rec[0] != STORED or rec[3] == run[-1][2])
        if not continues:
            close()
        run.append(rec)
    close()
    return out
