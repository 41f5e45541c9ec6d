"""L3 under tensor parallelism: rank 0 does all the I/O, the other ranks lend and take their KV heads.

L3 objects hold whole-model blocks (tierkv/heads.py), the bytes a single-GPU engine stores, so a
store written at one TP size serves every other. Rank 0 keeps every L3 decision and all the I/O
(tiering.py, transfer.L3Mover); another rank only hands over, or takes in, its heads of L2 slots:

    write: rank 0's writer thread broadcasts (ticket, slots) on the `put` group. Each rank, once
           it has repeated `ticket` moves (they filled the slots), sends its pieces (a gather);
           rank 0 joins them into whole blocks and writes those.
    read:  rank 0's reader thread reads whole blocks, broadcasts (ticket, number, slots) on the
           `get` group and scatters each rank its pieces (in rounds of ROUND_BYTES; the last
           carries the number). A rank writes them into its slots once
           it has repeated `ticket` moves (the last to read the slots' old blocks), then counts
           read `number` done. Rank 0 records L3_LANDED(number) among the moves when it takes the
           read in; a rank repeating the moves waits there until it counted that read.

The moves a ticket names are sent before the job starts (Tiering._l3_ticket), so a rank always
gets them. One gloo group each way, used by one thread on each rank, so a group's collectives
meet in the same order everywhere (rank 0's L3Mover has one writer and one reader thread). The
data threads wait only for the main thread's moves, and the main thread only for the read
thread's count, whose waits lie before the point it waits at: no cycle. Headers are int64
tensors and pieces raw bytes: nothing is pickled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..heads import HeadSplit
from ..tiering import L3_LANDED, Tiering

log = logging.getLogger(__name__)

ROUND_BYTES = 64 * 2**20  # whole-model bytes per collective round: bounds the pieces held at once


class HeadExchange:
    """Rank 0's side, called by L3Mover's writer and reader threads (and `push` by Tiering)."""

    def __init__(self, split: HeadSplit, send_moves: Callable[[list], int], put_group, get_group) -> None:
        self.split, self._send_moves = split, send_moves
        self._put_group, self._get_group = put_group, get_group
        self._per_round = max(1, ROUND_BYTES // split.whole.bytes_per_block)

    def push(self, moves: list) -> int:
        """Send `moves` to the other ranks now; returns how many moves they have been sent in all."""
        return self._send_moves(moves)

    def gather(self, own: torch.Tensor, slots: list[int], ticket: int) -> torch.Tensor:
        """This rank's pieces own [n, part bytes] of L2 `slots` -> whole blocks [n, whole bytes]."""
        out = []
        for i in range(0, len(slots), self._per_round):
            part = own[i : i + self._per_round].contiguous()
            _send_header([ticket, 0, *slots[i : i + self._per_round]], self._put_group)
            pieces = [torch.empty_like(part) for _ in range(self.split.size)]
            dist.gather(part, pieces, dst=0, group=self._put_group)
            out.append(self.split.join(pieces))
        return torch.cat(out)

    def scatter(self, blocks: torch.Tensor, slots: list[int], ticket: int, number: int) -> torch.Tensor:
        """Whole blocks [n, whole bytes] read for L2 `slots`: every other rank gets its pieces;
        returns this rank's [n, part bytes]."""
        own = []
        for i in range(0, len(slots), self._per_round):
            whole = blocks[i : i + self._per_round]
            last = i + self._per_round >= len(slots)  # a rank counts the read done after its last round
            _send_header([ticket, number if last else 0, *slots[i : i + self._per_round]], self._get_group)
            pieces = [self.split.split(whole, r) for r in range(self.split.size)]
            dist.scatter(torch.empty_like(pieces[0]), pieces, src=0, group=self._get_group)
            own.append(pieces[0])
        return torch.cat(own)


class HeadFollower:
    """Another rank's side: repeats rank 0's moves (`replay`) and serves the L3 jobs on two threads."""

    def __init__(self, tiering: Tiering, put_group, get_group) -> None:
        self.tiering = tiering
        self.replayed = 0  # moves repeated so far
        self.landed = 0  # the number of the last read whose pieces are in L2
        self._changed = threading.Condition()
        for name, serve, group in (("put", self._serve_puts, put_group), ("get", self._serve_gets, get_group)):
            threading.Thread(target=self._run, args=(serve, group), daemon=True, name=f"tierkv-tp-l3-{name}").start()

    def replay(self, moves: list) -> None:
        """Repeat rank 0's moves in order, waiting at each L3_LANDED until that read's pieces landed."""
        start = 0
        for i, (kind, src, _) in enumerate(moves):
            if kind == L3_LANDED:
                self._replay(moves[start : i + 1])
                self._wait(lambda n=src[0]: self.landed >= n)
                start = i + 1
        self._replay(moves[start:])

    def _replay(self, moves: list) -> None:
        if moves:
            self.tiering.replay(moves)
        with self._changed:
            self.replayed += len(moves)
            self._changed.notify_all()

    def _wait(self, ready: Callable[[], bool]) -> None:
        with self._changed:
            self._changed.wait_for(ready)

    def _caught_up(self, ticket: int) -> None:
        """Return once this rank repeated `ticket` moves and their copies are done."""
        self._wait(lambda: self.replayed >= ticket)
        if self.tiering.mover is not None:
            self.tiering.mover.last.synchronize()

    def _run(self, serve, group) -> None:
        try:
            while True:
                serve(group)
        except Exception as e:  # rank 0 is gone: the main thread fails too and the rank exits
            log.debug("tensor-parallel L3 thread stops: %s", e)

    def _serve_puts(self, group) -> None:
        ticket, _, slots = _recv_header(group)
        self._caught_up(ticket)
        dist.gather(self.tiering.l2.rows[torch.tensor(slots)], None, dst=0, group=group)

    def _serve_gets(self, group) -> None:
        ticket, number, slots = _recv_header(group)
        piece = torch.empty((len(slots), self.tiering.l2.layout.bytes_per_block), dtype=torch.uint8)
        dist.scatter(piece, None, src=0, group=group)
        self._caught_up(ticket)
        self.tiering.l2.rows[torch.tensor(slots)] = piece
        if number:  # the read's last round
            with self._changed:
                self.landed = number
                self._changed.notify_all()


def _send_header(values: list[int], group) -> None:
    """[ticket, number, slots...] to every rank: its length, then the values."""
    data = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0, group=group)
    dist.broadcast(data, 0, group=group)


def _recv_header(group) -> tuple[int, int, list[int]]:
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, 0, group=group)
    data = torch.empty(int(n), dtype=torch.int64)
    dist.broadcast(data, 0, group=group)
    ticket, number, *slots = data.tolist()
    return ticket, number, slots
