"""Prefetch: a handle on L3 blocks on their way into L2, for the caller that waits for them.

`Tiering.prefetch` makes one per read (tiering_l3.py). The caller asks whether the blocks landed
(`done`, which takes finished reads in under the cache's lock), waits for them outside any lock
(`wait`), sees when they are expected (`expected_by`) and gives up on the rest (`abandon`). This
file never moves bytes and never touches the index itself.
"""

from __future__ import annotations

from collections.abc import Callable

from .guard import Guard
from .l3_mover import L3Job, L3Mover


class Prefetch:
    """L3 blocks on their way into L2. Once `done()`, match() finds the ones that arrived in L2."""

    def __init__(self, job: L3Job | None = None, l3: L3Mover | None = None, guard: Guard | None = None,
                 reap: Callable[[], None] | None = None) -> None:
        """`job`: the read (None: nothing to read, done at once); `l3`, `guard`, `reap`: the
        Tiering's mover that runs it, the cache's lock, and what takes finished reads in."""
        self._job, self._l3, self._guard, self._reap = job, l3, guard, reap
        # time.monotonic() by which the read is expected to have landed (its queue included)
        self.expected_at = 0.0 if job is None else job.submitted + job.estimate_s
        # set by a caller that waits for it: since when, when it stops waiting, and when it did
        self.reached_at: float | None = None
        self.give_up_at: float | None = None
        self.abandoned_at: float | None = None

    def expected_by(self, now: float) -> float:
        """When the read is expected to land, as seen at `now`: its estimate when it was queued,
        or later where the blocks it has not started on could not be read by then from now (a
        read running late: one stuck behind writes, say, shows it before its estimate ends)."""
        if self._job is None:
            return 0.0
        left = len(self._job.ids) - self._job.tried  # (the reader thread moves `tried` on)
        return max(self.expected_at, now + self._l3.seconds_to_read(left)) if left else self.expected_at

    def abandon(self) -> None:
        """Start no more of the read: the caller recomputes what has not arrived (see L3Mover.abandon)."""
        if self._job is not None and not self._job.finished.is_set():
            self._l3.abandon(self._job)

    def done(self) -> bool:
        if self._job is None:
            return True
        with self._guard.lock:  # reaping changes the index: one caller at a time
            self._guard.check("Prefetch.done")
            self._reap()
            return self._job.landed

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the blocks landed (or `timeout` seconds passed); True if they did. The wait
        itself holds no lock: other threads use the cache meanwhile."""
        if self._job is None:
            return True
        self._job.finished.wait(timeout)
        return self.done()

    @property
    def num_blocks(self) -> int:
        return 0 if self._job is None else len(self._job.ids)
