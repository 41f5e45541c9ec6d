"""IndexRing's bookkeeping on a CPU: which staged copies it forgets (the copies themselves, on a
GPU's stream, are in test_transfer_gpu.py)."""

from collections import deque

import pytest

from tierkv.index_ring import IndexRing


class Ran:
    """A stand-in for a CUDA event: query() says whether its copy ran, and counts the asking."""

    asked = 0

    def __init__(self, ran: bool) -> None:
        self.ran = ran

    def query(self) -> bool:
        Ran.asked += 1
        return self.ran


def ring_with(ran: list[bool]) -> IndexRing:
    ring = IndexRing.__new__(IndexRing)  # no pinned buffer: only the bookkeeping is under test
    ring.pending = deque((8 * i, 8 * i + 8, Ran(r)) for i, r in enumerate(ran))
    return ring


@pytest.mark.parametrize("done", [0, 1, 2, 255, 256, 500])
def test_the_copies_that_ran_are_forgotten_and_the_rest_kept_in_order(done):
    # copies on one stream run in order: the first `done` of 500 ran
    ring = ring_with([True] * done + [False] * (500 - done))
    Ran.asked = 0
    ring._forget_done()
    assert [s for s, _, _ in ring.pending] == [8 * i for i in range(done, 500)]
    assert Ran.asked <= 10  # by bisection: ~log2(500) questions, not one a copy
