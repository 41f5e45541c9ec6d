"""Block events: which blocks enter and leave each tier, recorded for whoever publishes them.

The index records a block placed in or taken out of L1 or L2, the L3 stores a write that landed
or an object they evicted, and a cleared cache records that everything went. A publisher (the
server's kv_events.py) takes the records from its own thread. Recording never blocks the
engine: one short lock around a deque append, and when the deque is full its oldest record goes
and is counted in `dropped`. This file knows nothing of sockets, wire formats or requests.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

DEFAULT_MAX_RECORDS = 100_000  # vLLM's max_queue_size default


@dataclass(frozen=True, slots=True)
class Medium:
    """Where a block lives, in the words of vLLM's KV events."""

    name: str  # "GPU" (L1, whatever its device), "CPU" (L2), "STORAGE" (L3)
    locality: str | None = None  # L3: "LOCAL" (this machine's disk) or "REMOTE" (a network store)
    ownership: str | None = None  # a store other processes share: its name, the same in every one of them


GPU, CPU = Medium("GPU"), Medium("CPU")
TIER_MEDIUM = {"l1": GPU, "l2": CPU}

# record kinds: (STORED, medium, hash, parent, tokens) | (REMOVED, medium, hash) | (CLEARED,)
STORED, REMOVED, CLEARED = 0, 1, 2


def store_medium(shared: bool, name: str) -> Medium:
    """The medium of an L3 store: `shared` by other processes or machines (Redis, S3), named `name`
    (its URL without credentials), or this machine's own disk."""
    if shared:
        return Medium("STORAGE", "REMOTE", name)
    return Medium("STORAGE", "LOCAL")


class BlockEvents:
    """A bounded queue of block records; many threads record, one takes."""

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS) -> None:
        self.max_records = max_records
        self._records: deque[tuple] = deque(maxlen=max_records)
        self._lock = threading.Lock()
        self.dropped = 0  # records pushed out unpublished by newer ones

    def stored(self, medium: Medium, h: int, parent: int, tokens: bytes) -> None:
        """Block `h` (chained after `parent`, 0 for a first block; `tokens` little-endian int32) entered `medium`."""
        self._put((STORED, medium, h, parent, tokens))

    def removed(self, medium: Medium, h: int) -> None:
        self._put((REMOVED, medium, h))

    def cleared(self) -> None:
        """Every block left this process's tiers."""
        self._put((CLEARED,))

    def _put(self, record: tuple) -> None:
        with self._lock:
            if len(self._records) == self.max_records:
                self.dropped += 1  # the append below pushes the oldest out
            self._records.append(record)

    def take(self) -> deque[tuple]:
        """Every record so far, oldest first; the queue starts empty again."""
        with self._lock:
            out, self._records = self._records, deque(maxlen=self.max_records)
        return out
