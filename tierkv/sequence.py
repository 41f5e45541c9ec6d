"""SequenceBlocks: the blocks one running sequence holds, in token order, and where each lives.

A plain record that TieredKVCache makes (`allocate`) and changes (`append`, `commit`, `adopt`,
`offload`, `free`); engines read it for block tables (`fill_block_table`) and slot numbers. It
never allocates, frees or moves anything itself.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from .errors import UsageError
from .index import BlockEntry
from .transfer import DONE, Transfer


@dataclass(slots=True, eq=False)
class SequenceBlocks:
    """The blocks one running sequence holds. Made by `allocate`, released by `free`.

    Normally every block is in L1. A streamed sequence (one larger than L1) keeps its first
    `offloaded` blocks in L2 instead: their L1 slot is -1 and `l2_slots` says where they are. A
    sequence whose every layer is windowed lets go of its first `released` blocks once no query
    reads them (PagedCache.release): their slot is -1 and their entry None.
    """

    ns: bytes
    priority: int
    slots: list[int]  # L1 slot of each block, in token order (-1: offloaded to L2)
    entries: list[BlockEntry | None]  # the index entry of each block; None = private to this sequence
    hashes: list[int]  # chained hashes known so far (at least those of the committed blocks)
    committed: int  # leading blocks already committed to the index
    num_tokens: int  # tokens the slots are reserved for
    num_cached_tokens: int  # prefix tokens that came from the cache at allocation
    pending: list[Transfer]  # loads into these slots still in flight
    # the token ids the sequence is known to hold, little-endian int32 (its prompt, then what
    # commit() entered): commit checks new blocks against them
    token_bytes: bytearray = field(default_factory=bytearray, repr=False)
    # the tier each of the num_cached_tokens came from: shared in L1, loaded from L2, read up from L3
    # (and of what `adopt` took since)
    cached_by_tier: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    l2_slots: list[int] = field(default_factory=list)  # L2 slot of each offloaded leading block
    saving: LayerSave | None = None  # this step's full blocks, copied to L2 layer by layer (save_layer)
    # Blocks [first, end) that L3 held when the sequence was looked up (Match.in_l3): the ones
    # it computes itself are entered as written to L3, so that evicting them writes nothing
    # again (such rewrites were most of a saturated disk's traffic: long-doc QA, H200)
    in_l3: tuple[int, int] = (0, 0)
    released: int = 0  # leading blocks let go of (PagedCache.release): slot -1, entry None
    freed: bool = False
    owner: object = field(default=None, repr=False)  # the cache that made it

    @property
    def offloaded(self) -> int:
        """Leading blocks that live in L2 only; attention streams them."""
        return len(self.l2_slots)

    @property
    def resident(self) -> int:
        """Blocks in L1."""
        return len(self.slots) - len(self.l2_slots)

    def loaded(self) -> bool:
        """Whether every load into this sequence's blocks has landed (an event query, no host sync)."""
        return all(t.done() for t in self.pending)

    def wait(self) -> None:
        """Order the current CUDA stream after the loads into this sequence's blocks (no host sync)."""
        for t in self.pending:
            t.wait()
        self.pending = [t for t in self.pending if not t.done()]

    def slot_of(self, position: int, block_size: int) -> int:
        """The flat slot of token `position` as tierkv's kv_write kernels take it (block * block_size
        + offset). With buffers of your own, the token is at block `slots[position // block_size]`,
        offset `position % block_size`, of each layer's K and V."""
        if not 0 <= position < self.num_tokens:
            raise UsageError(f"slot_of({position}): this sequence has room for positions 0..{self.num_tokens - 1}; "
                             "append() room for more tokens before writing their KV")
        slot = self.slots[position // block_size]
        if slot < 0:
            raise UsageError(f"slot_of({position}): that block is offloaded to L2 (streamed), not in L1")
        return slot * block_size + position % block_size


@dataclass(slots=True)
class LayerSave:
    """A sequence's blocks that the running step fills, copied to L2 a group of layers at a time
    as the forward writes them (TieredKVCache.save_layer); `commit` then enters them in both tiers."""

    blocks: list[int]  # block numbers in the sequence
    l2_slots: list[int]  # the L2 slot each is copied into, taken for it
    layers: int = 0  # layers written and saved so far (0..layers-1)
    copied: int = 0  # of those, the layers whose copy has started (a group at a time)
    moved: Transfer = DONE  # the copy of the latest group: the earlier ones are complete when it is


def fill_block_table(slots: list[list[int]], out: np.ndarray) -> np.ndarray:
    """out [B, width] int32: row b holds the first `width` of slots[b], then -1; returns out.

    Every row goes in one numpy scatter: an assignment per row costs more than the row itself.
    """
    rows, width = out.shape
    out.fill(-1)
    counts = np.fromiter((min(len(s), width) for s in slots), dtype=np.int64, count=rows)  # [B]
    flat = np.fromiter(itertools.chain.from_iterable(s[:width] for s in slots), dtype=out.dtype,
                       count=int(counts.sum()))
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
    out[np.repeat(np.arange(rows), counts), cols] = flat
    return out
