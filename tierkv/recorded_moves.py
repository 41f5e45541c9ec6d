"""Recorded moves: the kinds of L1/L2 byte moves, and the recorder of a cache whose L1 the engine owns.

Tensor-parallel rank 0 records its moves for the other ranks (Tiering.moves); a cache whose L1 is
an engine's (engine_blocks=: vLLM's workers, perhaps in other processes) records all of them in
numbered batches with EngineMover, which stands where BlockMover would. The engine runs a batch
on its own buffers (`run_moves`, on a BlockMover over them) and reports it; the batch's Transfer
completes then, and the callbacks waiting on it run. This file moves no bytes itself and never
touches the index.
"""

from __future__ import annotations

import threading

from .transfer import DONE, BlockMover, Transfer


# The kinds of L1/L2 byte moves an EngineMover records (and Tiering.moves, for tensor parallel
# ranks): source and destination slot lists. L3_LANDED marks where rank 0 took in an L3 read
# (src = [its number]): past it, the other ranks' slots must hold their heads of its blocks.
# L2_TO_L1_FULL loads the full-attention layers of blocks alone (KVLayout.full_layers): blocks
# of a hit that every sliding window has left behind.
L1_TO_L2, L2_TO_L1, COPY_L1, FENCE, L3_LANDED, L2_TO_L1_FULL = 0, 1, 2, 3, 4, 5
COPIES = (L1_TO_L2, L2_TO_L1, L2_TO_L1_FULL)  # the kinds that move bytes between L1 and L2


class Reported(Transfer):
    """Copies the engine runs itself: complete once the engine reports them (EngineMover.reported).
    The engine orders its own streams, so `wait` and `wait_layer` have nothing to do here."""

    __slots__ = ("_done",)

    def __init__(self) -> None:
        super().__init__()
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        pass

    def wait_layer(self, layer: int, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        self._done.wait()  # an L3 write of a block the engine is still copying into L2


class EngineMover:
    """The moves of a cache whose L1 the engine owns: recorded in numbered batches that the engine
    takes (`take`), runs on its own buffers, and reports (`reported`). A batch's moves all share
    its Transfer; `after(fn)` runs fn once the open batch is reported (under the cache's guard:
    the cache calls `reported`). Batches are run and reported in order."""

    def __init__(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block
        self.l2_planes = None  # nothing here copies layer by layer: save_layer has nothing to do
        self.bandwidth = 5e9  # bytes/s assumed for load-or-recompute (the engine's copies are not timed here)
        self._number = 0  # the open batch
        self._moves: list[tuple[int, list[int], list[int]]] = []
        self._done: dict[int, tuple[Reported, list]] = {0: (Reported(), [])}  # batches not reported yet
        self.last: Transfer = DONE

    def _record(self, kind: int, src: list[int], dst: list[int]) -> Transfer:
        if not src:
            return DONE
        self._moves.append((kind, list(src), list(dst)))
        self.last = self._done[self._number][0]
        return self.last

    def l1_to_l2(self, l1_slots: list[int], l2_slots: list[int], layers: range | None = None) -> Transfer:
        assert layers is None, "an engine-owned L1 is saved whole blocks at a time"
        return self._record(L1_TO_L2, l1_slots, l2_slots)

    loads_layers = False  # the engine loads whole blocks

    def l2_to_l1(self, l2_slots: list[int], l1_slots: list[int], layers=None) -> Transfer:
        return self._record(L2_TO_L1, l2_slots, l1_slots)

    def fence(self) -> None:
        pass  # the engine runs a batch's moves before it reports it, in order

    def estimate_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.bytes_per_block / self.bandwidth

    def after(self, fn) -> None:
        """Run `fn()` once the open batch is reported."""
        self._done[self._number][1].append(fn)

    def take(self) -> tuple[int, list[tuple[int, list[int], list[int]]]]:
        """The open batch (its number and moves, in order) for the engine to run; a new one opens.
        A batch with no moves is reported at once."""
        number, moves = self._number, self._moves
        self._number, self._moves = number + 1, []
        self._done[self._number] = (Reported(), [])
        if not moves:
            self.reported(number)
        return number, moves

    def reported(self, number: int) -> None:
        """The engine ran every batch up to `number`: complete them, oldest first."""
        for n in sorted(k for k in self._done if k <= number and k != self._number):
            transfer, callbacks = self._done.pop(n)
            transfer._done.set()
            for fn in callbacks:
                fn()

    def abandon(self) -> None:
        """The engine is gone (the cache closes): nothing will report the batches taken, so
        complete them (an L3 write waiting on one may then write stale bytes: none is left to
        wait, since close() reaps no write after this)."""
        for transfer, _ in self._done.values():
            transfer._done.set()


def copy(mover: BlockMover | EngineMover, kind: int, src: list[int], dst: list[int]) -> Transfer:
    """One recorded L1<->L2 copy (one of COPIES) on `mover`'s pools."""
    if kind == L1_TO_L2:
        return mover.l1_to_l2(src, dst)
    if kind == L2_TO_L1:
        return mover.l2_to_l1(src, dst)
    if kind == L2_TO_L1_FULL:
        return mover.l2_to_l1(src, dst, mover.l1.layout.full_layers)
    raise ValueError(f"move kind {kind} is not an L1/L2 copy")


def run_moves(mover: BlockMover, moves: list[tuple[int, list[int], list[int]]], kinds=COPIES) -> Transfer:
    """Run a batch of recorded moves of `kinds` (in order) on `mover`'s pools: the engine side of
    an EngineMover. Returns the last move's Transfer (all are complete when it is)."""
    last = DONE
    for kind, src, dst in moves:
        if kind in kinds:
            last = copy(mover, kind, src, dst)
    return last
