"""Eviction policies: which evictable block of a tier goes next.

A policy orders the blocks resident in one tier, keyed by block hash. Pinned blocks (ref count
> 0) are resident but never candidates, so a pin takes the key out of the eviction order in
O(1) and an unpin puts it back; the policy never scans. Policies know nothing of tensors, slots
or tiers: the index tells them what happened and asks for a victim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable

from .config import EVICTION_POLICIES
from .errors import ConfigError

Key = Hashable


class EvictionPolicy(ABC):
    """The interface every policy implements. All operations are O(1) (LFU/priority: O(distinct levels))."""

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


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, least recently used among equals."""

    def __init__(self) -> None:
        self._freq: dict[Key, int] = {}  # every resident key, pinned or not
        self._buckets: dict[int, OrderedDict[Key, None]] = {}  # freq -> evictable keys, oldest first
        self._count = 0

    def _add(self, key: Key) -> None:
        self._buckets.setdefault(self._freq[key], OrderedDict())[key] = None
        self._count += 1

    def _drop(self, key: Key) -> bool:
        bucket = self._buckets.get(self._freq.get(key, -1))
        if bucket is None or key not in bucket:
            return False
        del bucket[key]
        if not bucket:
            del self._buckets[self._freq[key]]
        self._count -= 1
        return True

    def insert(self, key, *, priority=0, pinned=False):
        self.remove(key)
        self._freq[key] = 1
        if not pinned:
            self._add(key)

    def pin(self, key):
        self._drop(key)

    def unpin(self, key):
        if key in self._freq:
            self._drop(key)  # an unpin of an evictable key is a no-op, not a double entry
            self._add(key)

    def touch(self, key, *, priority=0):
        if key not in self._freq:
            return
        evictable = self._drop(key)
        self._freq[key] += 1
        if evictable:
            self._add(key)

    def evict(self):
        if not self._buckets:
            return None
        lowest = min(self._buckets)
        key, _ = self._buckets[lowest].popitem(last=False)
        if not self._buckets[lowest]:
            del self._buckets[lowest]
        self._count -= 1
        del self._freq[key]
        return key

    def remove(self, key):
        self._drop(key)
        self._freq.pop(key, None)

    def __len__(self):
        return self._count


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


class PriorityPolicy(EvictionPolicy):
    """Lowest priority value first, least recently used within a priority.

    A block's priority is the highest priority of the requests that stored or hit it.
    """

    def __init__(self) -> None:
        self._priority: dict[Key, int] = {}  # every resident key
        self._levels: dict[int, OrderedDict[Key, None]] = {}  # priority -> evictable keys, oldest first
        self._count = 0

    def _add(self, key: Key) -> None:
        self._levels.setdefault(self._priority[key], OrderedDict())[key] = None
        self._count += 1

    def _drop(self, key: Key) -> bool:
        level = self._levels.get(self._priority.get(key))
        if level is None or key not in level:
            return False
        del level[key]
        if not level:
            del self._levels[self._priority[key]]
        self._count -= 1
        return True

    def insert(self, key, *, priority=0, pinned=False):
        self.remove(key)
        self._priority[key] = priority
        if not pinned:
            self._add(key)

    def pin(self, key):
        self._drop(key)

    def unpin(self, key):
        if key in self._priority:
            self._drop(key)
            self._add(key)

    def touch(self, key, *, priority=0):
        if key not in self._priority:
            return
        evictable = self._drop(key)
        self._priority[key] = max(self._priority[key], priority)
        if evictable:
            self._add(key)

    def evict(self):
        if not self._levels:
            return None
        lowest = min(self._levels)
        key, _ = self._levels[lowest].popitem(last=False)
        if not self._levels[lowest]:
            del self._levels[lowest]
        self._count -= 1
        del self._priority[key]
        return key

    def remove(self, key):
        self._drop(key)
        self._priority.pop(key, None)

    def __len__(self):
        return self._count


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
