"""Eviction policies: which evictable block of a tier goes next.

A policy orders the blocks resident in one tier, keyed by block hash. Pinned blocks (ref count
> 0) are resident but never candidates, so a pin takes the key out of the eviction order in
O(1) and an unpin puts it back; the policy never scans. Policies know nothing of tensors, slots
or tiers: the index tells them what happened and asks for a victim.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable

from .config import EVICTION_POLICIES
from .errors import ConfigError

Key = Hashable


class EvictionPolicy(ABC):
    """The interface every policy implements. All operations are O(1), amortised; LFU and priority
    pay O(log distinct levels) when a key opens a new level and on evict (see BucketQueue)."""

    @abstractmethod
    def insert(self, key: Key, *, priority: int = 0, pinned: bool = False) -> None:
        """`key` entered the tier."""

    @abstractmethod
    def pin(self, key: Key) -> None:
        """`key` is in use: keep it resident and out of the eviction order."""

    @abstractmethod
    def unpin(self, key: Key) -> None:
        """`key` is no longer in use and may be evicted again."""

    @abstractmethod
    def touch(self, key: Key, *, priority: int = 0) -> None:
        """`key` was hit (it may be pinned or not)."""

    @abstractmethod
    def evict(self) -> Key | None:
        """Remove and return the next victim, or None if nothing is evictable."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """`key` left the tier by other means than `evict` (pinned or not); forget it."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable (resident, unpinned) keys."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first. An unpin counts as a use: the block was just read by a request."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # evictable keys, oldest first

    def insert(self, key, *, priority=0, pinned=False):
        if not pinned:
            self._order[key] = None

    def pin(self, key):
        self._order.pop(key, None)

    def unpin(self, key):
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key, *, priority=0):
        if key in self._order:
            self._order.move_to_end(key)

    def evict(self):
        return self._order.popitem(last=False)[0] if self._order else None

    def remove(self, key):
        self._order.pop(key, None)

    def __len__(self):
        return len(self._order)


class BucketQueue:
    """Keys grouped by an integer level; the oldest key of the lowest level comes out first.

    The one mechanism behind LFU (level = hit count) and priority (level = priority). Every tracked
    key has a level; only queued keys sit in a bucket (an insertion-ordered dict per level), so a
    held (pinned) key keeps its level while out of the order. A heap of levels finds the lowest
    bucket without scanning them all: adding to an existing level is O(1), opening a new level
    O(log levels), `pop_min` O(log levels) amortised.
    """

    def __init__(self) -> None:
        self._level: dict[Key, int] = {}  # every tracked key, queued or held
        self._buckets: dict[int, OrderedDict[Key, None]] = {}  # level -> queued keys, oldest first
        # Levels that have a bucket, plus stale ones whose bucket has since emptied: those are
        # skipped when they reach the top, rather than searched for and deleted.
        self._heap: list[int] = []
        self._queued = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._level

    def __len__(self) -> int:
        """Number of queued keys (held ones not counted)."""
        return self._queued

    def level(self, key: Key) -> int:
        return self._level[key]

    def add(self, key: Key, level: int, *, queued: bool = True) -> None:
        """Track `key` at `level`, replacing any earlier entry for it; a queued key goes last in its level."""
        self.discard(key)
        self._level[key] = level
        if queued:
            self._enqueue(key)

    def set_level(self, key: Key, level: int) -> None:
        """Move a tracked `key` to `level`. A queued key goes last there, even if the level is unchanged."""
        queued = self._dequeue(key)
        self._level[key] = level
        if queued:
            self._enqueue(key)

    def hold(self, key: Key) -> None:
        """Take `key` out of the order, keeping its level. No-op if absent or already held."""
        self._dequeue(key)

    def release(self, key: Key) -> None:
        """Put a tracked `key` back in the order, last in its level (also if it was queued already)."""
        if key in self._level:
            self._dequeue(key)
            self._enqueue(key)

    def discard(self, key: Key) -> None:
        """Forget `key`, queued or held. No-op if absent."""
        self._dequeue(key)
        self._level.pop(key, None)

    def pop_min(self) -> Key | None:
        """Remove and return the oldest queued key of the lowest level, or None if none is queued."""
        while self._heap and self._heap[0] not in self._buckets:
            heapq.heappop(self._heap)
        if not self._heap:
            return None
        level = self._heap[0]
        bucket = self._buckets[level]
        key, _ = bucket.popitem(last=False)
        if not bucket:
            del self._buckets[level]  # its heap entry goes stale and is dropped on a later pop
        self._queued -= 1
        del self._level[key]
        return key

    def _enqueue(self, key: Key) -> None:
        level = self._level[key]
        bucket = self._buckets.get(level)
        if bucket is None:
            bucket = self._buckets[level] = OrderedDict()
            heapq.heappush(self._heap, level)
            # Levels that open and close away from the top (LFU counts climbing) would pile up as
            # stale entries; rebuilding once they outnumber the live ones keeps the heap O(levels).
            if len(self._heap) > 2 * len(self._buckets) + 8:
                self._heap = sorted(self._buckets)
        bucket[key] = None
        self._queued += 1

    def _dequeue(self, key: Key) -> bool:
        """Take `key` out of its bucket; False if it was not queued."""
        level = self._level.get(key)
        bucket = self._buckets.get(level) if level is not None else None
        if bucket is None or key not in bucket:
            return False
        del bucket[key]
        if not bucket:
            del self._buckets[level]
        self._queued -= 1
        return True


class _LevelPolicy(EvictionPolicy):
    """A policy that evicts the lowest level first and the least recently used within a level.

    Subclasses say only how a key's level starts and how a hit changes it. An unpin counts as a
    use (last in its level), as a touch of an evictable key does even when its level stays.
    """

    def __init__(self) -> None:
        self._queue = BucketQueue()

    @abstractmethod
    def _first_level(self, priority: int) -> int:
        """The level of a key that enters the tier with `priority`."""

    @abstractmethod
    def _hit_level(self, level: int, priority: int) -> int:
        """The level of a key at `level` after a hit from a request with `priority`."""

    def insert(self, key, *, priority=0, pinned=False):
        self._queue.add(key, self._first_level(priority), queued=not pinned)

    def pin(self, key):
        self._queue.hold(key)

    def unpin(self, key):
        self._queue.release(key)

    def touch(self, key, *, priority=0):
        if key in self._queue:
            self._queue.set_level(key, self._hit_level(self._queue.level(key), priority))

    def evict(self):
        return self._queue.pop_min()

    def remove(self, key):
        self._queue.discard(key)

    def __len__(self):
        return len(self._queue)


class LFUPolicy(_LevelPolicy):
    """Least frequently used first, least recently used among equals. Hits while pinned count too."""

    def _first_level(self, priority):
        return 1

    def _hit_level(self, level, priority):
        return level + 1


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO and a ghost list.

    New keys enter the small queue; a key evicted from it without a hit since it entered is
    dropped (one-hit wonders never reach main), a key that was hit moves to main. Main is a
    FIFO with lazy promotion: a key with hits left is reinserted with one hit less. Keys
    recently dropped from small are remembered (no data) in the ghost list and go straight to
    main when they come back. Resistant to scans and one-hit traffic.
    """

    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self) -> None:
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}  # every resident key
        self._in_main: dict[Key, bool] = {}  # every resident key: which queue it belongs to
        self._pinned: set[Key] = set()

    def _queue(self, key: Key) -> OrderedDict:
        return self._main if self._in_main[key] else self._small

    def insert(self, key, *, priority=0, pinned=False):
        self.remove(key)
        to_main = self._ghost.pop(key, 0) is None
        self._freq[key] = 0
        self._in_main[key] = to_main
        if pinned:
            self._pinned.add(key)
        else:
            self._queue(key)[key] = None

    def pin(self, key):
        if key in self._freq and key not in self._pinned:
            self._queue(key).pop(key, None)
            self._pinned.add(key)

    def unpin(self, key):
        if key in self._pinned:
            self._pinned.discard(key)
            self._queue(key)[key] = None

    def touch(self, key, *, priority=0):
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def evict(self):
        resident = len(self._freq)
        while self._small or self._main:
            if self._small and (len(self._small) >= self.SMALL_FRACTION * resident or not self._main):
                key, _ = self._small.popitem(last=False)
                if self._freq[key] > 0:  # hit while on probation: promote
                    self._freq[key] = 0
                    self._in_main[key] = True
                    self._main[key] = None
                    continue
                self._ghost[key] = None
                while len(self._ghost) > max(resident, 1):
                    self._ghost.popitem(last=False)
                return self._forget(key)
            key, _ = self._main.popitem(last=False)
            if self._freq[key] > 0:  # lazy promotion: another round with one hit less
                self._freq[key] -= 1
                self._main[key] = None
                continue
            return self._forget(key)
        return None

    def _forget(self, key: Key) -> Key:
        del self._freq[key]
        del self._in_main[key]
        return key

    def remove(self, key):
        if key not in self._freq:
            return
        if key in self._pinned:
            self._pinned.discard(key)
        else:
            self._queue(key).pop(key, None)
        self._forget(key)

    def __len__(self):
        return len(self._small) + len(self._main)


class ARCPolicy(EvictionPolicy):
    """ARC (Megiddo & Modha, FAST 2003): a recency list T1 and a frequency list T2, sized adaptively.

    A block enters T1; a hit moves it to T2. Evicted keys are remembered (no data) in ghost lists
    B1 (evicted from T1) and B2 (from T2). A miss on a B1 ghost means T1 was too small, one on B2
    that T2 was: the target size `p` of T1 moves accordingly and the returning block enters T2.
    So the split between new blocks and reused ones is learned from the traffic, not set by hand,
    and a burst of one-time blocks only cycles through T1. Pinned blocks stay on their list's count
    but out of its eviction order.
    """

    # Reuse distances of serving traffic (a user's next turn comes minutes later) are longer than
    # the cache: ghosts cost one key each, so remember several cache-fulls of them to recognise
    # blocks that return after eviction.
    GHOST_FACTOR = 4

    def __init__(self) -> None:
        self._t1: OrderedDict[Key, None] = OrderedDict()  # evictable keys seen once, oldest first
        self._t2: OrderedDict[Key, None] = OrderedDict()  # evictable keys hit since they entered
        self._b1: OrderedDict[Key, None] = OrderedDict()  # ghosts of keys evicted from T1
        self._b2: OrderedDict[Key, None] = OrderedDict()  # ghosts of keys evicted from T2
        self._in_t2: dict[Key, bool] = {}  # every resident key: which list it belongs to
        self._pinned: set[Key] = set()
        self._n1 = 0  # resident keys on T1, pinned or not
        self._p = 0.0  # target number of resident keys on T1

    def _list(self, key: Key) -> OrderedDict:
        return self._t2 if self._in_t2[key] else self._t1

    def insert(self, key, *, priority=0, pinned=False):
        self.remove(key)
        c = len(self._in_t2) + 1
        to_t2 = True
        if key in self._b1:  # T1 was too small to keep it until its reuse
            self._p = min(float(c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
        elif key in self._b2:  # T2 was too small
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
        else:
            to_t2 = False
            self._n1 += 1
        self._in_t2[key] = to_t2
        if pinned:
            self._pinned.add(key)
        else:
            self._list(key)[key] = None

    def pin(self, key):
        if key in self._in_t2 and key not in self._pinned:
            self._list(key).pop(key, None)
            self._pinned.add(key)

    def unpin(self, key):
        if key in self._pinned:
            self._pinned.discard(key)
            self._list(key)[key] = None  # an unpin counts as a use: most recent on its list

    def touch(self, key, *, priority=0):
        if key not in self._in_t2:
            return
        evictable = key not in self._pinned
        if evictable:
            self._list(key).pop(key)
        if not self._in_t2[key]:
            self._in_t2[key] = True
            self._n1 -= 1
        if evictable:
            self._t2[key] = None

    def evict(self):
        if self._t1 and (self._n1 > self._p or not self._t2):
            key, _ = self._t1.popitem(last=False)
            self._b1[key] = None
        elif self._t2:
            key, _ = self._t2.popitem(last=False)
            self._b2[key] = None
        else:
            return None
        self._forget(key)
        limit = self.GHOST_FACTOR * max(len(self._in_t2), 1)
        while len(self._b1) + len(self._b2) > limit:
            (self._b1 if len(self._b1) >= len(self._b2) else self._b2).popitem(last=False)
        return key

    def _forget(self, key: Key) -> None:
        if not self._in_t2.pop(key):
            self._n1 -= 1

    def remove(self, key):
        if key not in self._in_t2:
            return
        if key in self._pinned:
            self._pinned.discard(key)
        else:
            self._list(key).pop(key, None)
        self._forget(key)

    def __len__(self):
        return len(self._t1) + len(self._t2)


class PriorityPolicy(_LevelPolicy):
    """Lowest priority value first, least recently used within a priority.

    A block's priority is the highest priority of the requests that stored or hit it.
    """

    def _first_level(self, priority):
        return priority

    def _hit_level(self, level, priority):
        return max(level, priority)


_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "s3fifo": S3FIFOPolicy,
    "priority": PriorityPolicy,
    "arc": ARCPolicy,
}
assert tuple(_POLICIES) == EVICTION_POLICIES


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its config name (see EVICTION_POLICIES)."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; accepted: {', '.join(_POLICIES)}") from None
