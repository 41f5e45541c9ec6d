"""The thread model of TieredKVCache: one lock around every call, and no call after close().

Every public method of the cache (and a Prefetch's `done`/`wait`) runs under the cache's one
re-entrant lock, so several threads may share a cache: each call finds and leaves the index, the
free lists and the pools consistent, and no thread sees another's half-made change. Waiting for
L3 reads happens outside the lock. The L3 worker threads never take it: they touch only L2 slots
held for them and report back through a queue that the lock holder drains.
This file holds the lock and the closed flag; it never looks at blocks.
"""

from __future__ import annotations

import functools
import threading

from .errors import CacheClosedError


class Guard:
    """The lock every call of one cache holds, and whether the cache is closed."""

    __slots__ = ("lock", "closed")

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: a call may make others (allocate -> match)
        self.closed = False

    def check(self, name: str) -> None:
        if self.closed:
            raise CacheClosedError(f"{name}() on a TieredKVCache that was closed; make a new one")


def guarded(method):
    """Run `method` under its object's `_guard`: one call at a time, none after close()."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        guard = self._guard
        lock = guard.lock
        lock.acquire()  # acquire/release: a third of what `with lock` costs on CPython 3.11
        try:
            if guard.closed:
                guard.check(method.__name__)
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return call
