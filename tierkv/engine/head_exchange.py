"""L3 under tensor parallelism: rank 0 does all the I/O, the other ranks lend and take their KV heads.

L3 objects hold whole-model blocks (tierkv/heads.py), the bytes a single-GPU engine stores, so a
store written at one TP size serves every other. Rank 0 keeps every L3 decision and all the I/O
(tiering_l3.py, l3_mover.L3Mover); another rank only hands over, or takes in, its heads of L2 slots.
The heads travel through a staging buffer per rank and direction in shared memory (/dev/shm), in
rounds of ROUND_BYTES; only small headers and barriers go over gloo:

    write: rank 0's writer thread broadcasts (ticket, slots) on the `put` group. Each rank, once
           it has repeated `ticket` moves (they filled the slots), copies its pieces into its put
           staging and joins a barrier; rank 0 joins them with its own into whole blocks.
    read:  rank 0's reader thread reads whole blocks, writes each rank's pieces into its get
           staging and broadcasts (ticket, number, slots) on the `get` group. A rank copies them
           into its slots once it has repeated `ticket` moves (the last to read the slots' old
           blocks), joins a barrier, and after a read's last round counts read `number` done.
           Rank 0 records L3_LANDED(number) among the moves when it takes the read in; a rank
           repeating the moves waits there until it counted that read.

The moves a ticket names are sent before the job starts (Tiering._l3_ticket), so a rank always
gets them. One gloo group each way, used by one thread on each rank, so a group's collectives
meet in the same order everywhere (rank 0's L3Mover has one writer and one reader thread). A
model with a cache per layer group (tierkv/groups.py) has all of this once per cache: its own
exchange, staging, gloo groups, threads and move count, as the caches move their blocks apart. The
data threads wait only for the main thread's moves, and the main thread only for the read
thread's count, whose waits lie before the point it waits at: no cycle. Headers are int64
tensors and pieces raw bytes: nothing is pickled. Why shared memory: on the H200 host gloo moved
1.4-1.6 GB/s of whole-model blocks, a memcpy 21 GB/s (bench_tp_exchange); the ranks share a host.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..heads import HeadSplit
from ..recorded_moves import L3_LANDED
from ..tiering import Tiering

log = logging.getLogger(__name__)

ROUND_BYTES = 16 * 2**20  # whole-model bytes per round: the staging of all ranks holds one round
SHM_ROOT = "/dev/shm"  # where the staging files live: a RAM file system every rank of the host maps


def staging_dir(init_file: str) -> str:
    """The directory of one engine's staging files, named after its rendezvous directory."""
    return os.path.join(os.environ.get("TIERKV_SHM_DIR", SHM_ROOT), os.path.basename(os.path.dirname(init_file)))


def create_staging(directory: str, split: HeadSplit, cache: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0, before the other ranks open them: a put and a get buffer for each rank 1..N-1, each
    [pieces per round, piece bytes] uint8 in a shared file, for cache `cache` (one per layer
    group). Too little shared memory is a ConfigError saying how much and where to get it (it is
    allocated now, so it cannot fail later)."""
    per = max(1, ROUND_BYTES // split.whole.bytes_per_block)
    nbytes = per * split.part.bytes_per_block
    out = []
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for rank in range(1, split.size):
            pair = []
            for kind in ("put", "get"):
                path = _staging_path(directory, cache, rank, kind)
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)  # tmpfs refuses here, not with SIGBUS on first touch
                finally:
                    os.close(fd)
                pair.append(_map(path, split.part.bytes_per_block))
            out.append(tuple(pair))
    except OSError as e:
        total = 2 * (split.size - 1) * nbytes
        which = f" for cache {cache}" if cache else ""
        raise ConfigError(f"tensor parallelism with an L3 stages the ranks' KV heads in shared memory: "
                          f"{total / 2**20:.0f} MiB{which} under {directory}, which failed ({e}). Give the process "
                          f"more /dev/shm (docker: --shm-size 1g or --ipc=host), or point TIERKV_SHM_DIR at "
                          f"a RAM file system with room") from e
    return out


def open_staging(directory: str, rank: int, piece_bytes: int, cache: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s put and get buffers for cache `cache`, made by rank 0 (create_staging)."""
    return tuple(_map(_staging_path(directory, cache, rank, kind), piece_bytes) for kind in ("put", "get"))


def _staging_path(directory: str, cache: int, rank: int, kind: str) -> str:
    return os.path.join(directory, f"cache{cache}-rank{rank}-{kind}")


def _map(path: str, piece_bytes: int) -> torch.Tensor:
    size = os.path.getsize(path)
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8).view(size // piece_bytes, piece_bytes)


class HeadExchange:
    """Rank 0's side, called by L3Mover's writer and reader threads (and `push` by Tiering).
    `staging[r - 1]`: rank r's (put, get) buffers."""

    def __init__(self, split: HeadSplit, send_moves: Callable[[list], int], put_group, get_group,
                 staging: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.split, self._send_moves = split, send_moves
        self._put_group, self._get_group = put_group, get_group
        self._staging = staging
        self._per_round = staging[0][0].shape[0]

    def push(self, moves: list) -> int:
        """Send `moves` to the other ranks now; returns how many moves they have been sent in all."""
        return self._send_moves(moves)

    def gather(self, own: torch.Tensor, slots: list[int], ticket: int) -> torch.Tensor:
        """This rank's pieces own [n, part bytes] of L2 `slots` -> whole blocks [n, whole bytes]."""
        out = torch.zeros((len(slots), self.split.whole.bytes_per_block), dtype=torch.uint8)
        for i in range(0, len(slots), self._per_round):
            part = own[i : i + self._per_round]
            _send_header([ticket, 0, *slots[i : i + self._per_round]], self._put_group)
            dist.barrier(group=self._put_group)  # every rank's pieces are in its staging
            # the ranks write their staging again only after the next header, sent after this join
            self.split.join([part] + [put[: len(part)] for put, _ in self._staging], out[i : i + len(part)])
        return out

    def scatter(self, blocks: torch.Tensor, slots: list[int], ticket: int, number: int) -> torch.Tensor:
        """Whole blocks [n, whole bytes] read for L2 `slots`: every other rank gets its pieces;
        returns this rank's [n, part bytes]."""
        own = torch.empty((len(slots), self.split.part.bytes_per_block), dtype=torch.uint8)
        for i in range(0, len(slots), self._per_round):
            whole = blocks[i : i + self._per_round]
            for rank, (_, get) in enumerate(self._staging, 1):
                self.split.split(whole, rank, out=get[: len(whole)])
            last = i + self._per_round >= len(slots)  # a rank counts the read done after its last round
            _send_header([ticket, number if last else 0, *slots[i : i + self._per_round]], self._get_group)
            dist.barrier(group=self._get_group)  # every rank took its pieces: the staging is free again
            self.split.split(whole, 0, out=own[i : i + len(whole)])
        return own


class HeadFollower:
    """Another rank's side: repeats rank 0's moves (`replay`) and serves the L3 jobs on two threads."""

    def __init__(self, tiering: Tiering, put_group, get_group, staging: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.tiering = tiering
        self._put, self._get = staging  # [pieces per round, piece bytes] each, shared with rank 0
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
        torch.index_select(self.tiering.l2.rows, 0, torch.tensor(slots), out=self._put[: len(slots)])
        dist.barrier(group=group)

    def _serve_gets(self, group) -> None:
        ticket, number, slots = _recv_header(group)
        self._caught_up(ticket)
        self.tiering.l2.rows[torch.tensor(slots)] = self._get[: len(slots)]
        dist.barrier(group=group)
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
