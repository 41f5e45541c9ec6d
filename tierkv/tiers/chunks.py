"""chunks: L3 objects that hold the records of a run of blocks, how they are named, looked up,
read and written. ChunkObjects is mixed into L3Store (l3.py), whose layout, URL, stats, warnings
and worker pool (`_parallel`) it uses; a chunked backend (disk, S3) implements its whole-object
hooks (_stat, _read, _write, _delete). This file never opens a store and never talks to a service
but through those hooks.

Chunk objects (disk, S3). One object holds the records (codec.py) of a run of consecutive blocks of
one chain: chunk c covers chain positions [c*K, (c+1)*K), K = `chunk` tokens / block_size (URL
option `chunk`; the default, 0, is one block per object), and the object holding positions c*K..e is
named after the hash of block e, its last block: `<32 hex>.c<K>`. Callers pass chain positions
(BlockId.pos, contains_many's first_pos): the cache and tiering know them (a match walks the chain
from block 0; every index entry records its position).
Why the last block's hash and not a manifest: a name is then a pure function of the chain, so
a lookup of N blocks needs at most one existence check per chunk (and S3 far fewer, see
below), with no manifest to fetch first, to keep in step with its chunks, or to race on between
two writers; and a chunk's name says exactly which blocks it holds, so two branches of one
prefix never overwrite each other. The cost is at the end of a sequence: a partial chunk
c*K..e is named after block e, and
  - a lookup checks the name of each chunk's last block it knows (its chain's last one for the
    final chunk), and for the first chunk that misses, the names of that chunk's other blocks
    (one more parallel round) in case a writer stopped earlier. A match looks up its prompt's
    last blocks too (those it leaves to compute), so a prompt re-sent finds its own last chunk;
  - a later, longer write of the same chain completes the chunk: its first new block's parent
    names the partial object, which is read, extended and rewritten under the new last block,
    and the partial one deleted. A reader whose chain ends where the partial object ended then
    finds nothing past the last whole chunk it covers: at most K-1 blocks to recompute, the
    trade LMCache makes too.
  - worse, a reader that shares only part of a chunk with the writer (a system prompt shorter
    than K, then different questions) cannot name the writer's object at all: it finds none of
    that chunk. So chunks are opt-in (`?chunk=256`, fewer and larger reads: disk and S3 run
    faster) and the default keeps one block per object,
    where every shared block is found. Naming a chunk after its FIRST block, with a small index
    of its block hashes read first, would serve partial sharers too; that is the next step.
Lookups by probing (S3). The cache wants the longest stored prefix, and a match stops at the
first miss, so a store may answer by prefix: S3 sets `probe_lookup` and probe_prefix checks the
first and the last chunk name in one round (a full hit or a full miss: 2 HEADs), then narrows a
run that ends inside in rounds of PROBES = 3 (64 blocks: at most 4 rounds, 11 HEADs; 64 HEADs
before probing). Why 3: on loopback a round (thread hand-offs, waiting for its last answer) and a
HEAD (signing, sending, parsing: s3.py) each cost about the same ~0.5 ms, and for 64 blocks 1, 2
or 3 probes a round all come to ~15 of them (8 a round: 3 rounds + 16 HEADs), 3 with the fewest
rounds; measured, the first 37 of 64 stored: 7.5-8.6 ms with 3, 7.8-11.1 ms with 8. Remote S3,
where a round costs a HEAD's latency, pays one round more than with 8 a round, and only for a run
that ends inside, whose loads take far longer; one a round (binary search: 8 HEADs, 7 rounds)
would make remote lookups round-trip bound. Nothing here assumes more than what a HEAD sees at
that moment: two writers of one chain write the same names and bytes, branches differ in name, a
write is atomic, and a hole (a deleted or evicted object, a writer that died mid-run) is
reported present, then misses on its read and is recomputed (the plan loads what it read, up to
the first block it did not: tests/test_cache_l3.py). Time, never data.
Why not a LIST over chain-ordered names or a manifest per chain: a name must then carry an
anchor earlier in the chain than the blocks a lookup or a write is given (the cache asks from
the first block L1 and L2 lack), a listing under an anchor shared by thousands of branches off
one system prompt grows with them, and a manifest is read-modify-written by racing writers.
Disk keeps one stat per chunk: exact, at microseconds each.
A record is checked on its own (header and checksum), so a damaged block k of a chunk is a
miss from k on and the blocks before it still hit. Objects of format 1 (one object per block,
named `<32 hex>`) are never read: their names differ, and the disk store evicts them first.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError
from ..layout import KVLayout
from .codec import BlockId, DecodeError, check_payload, decode_header, encode_header, key_hex, parse_header

log = logging.getLogger(__name__)

# tokens a chunk object holds (URL option `chunk`); 0 is one block per object (see the docstring
# for why that is the default; LMCache uses 256)
DEFAULT_CHUNK_TOKENS = 0
_WHERE_MAX = 1 << 16  # block hashes whose object name a lookup found, kept for the reads after it

PROBES = 3  # existence checks per round after the first, when a store probes (probe_prefix; why 3: above)


def probe_prefix(n: int, present: Callable[[list[int]], list[bool]], probes: int = PROBES) -> int:
    """How many leading items of `n` are present, taking presence to be prefix-closed (a chain
    is written from its start, and a lookup stops at the first miss anyway). `present(indices)`
    is one round of parallel checks. Round one asks for the first and the last item, so a full
    hit or a full miss costs one round of two; each later round splits what is still unknown
    into `probes` + 1 even parts (64 items, probes=3: at most 4 rounds and 11 checks). A hole
    inside the run is reported present: its read misses and the cache recomputes from there,
    which costs time, never data."""
    if n <= 0:
        return 0
    lo, hi = 0, n  # the answer lies in [lo, hi]: items before lo taken as present, item hi absent (or hi == n)
    ask = sorted({0, n - 1})
    while True:
        for j, ok in zip(ask, present(ask)):
            if not ok:
                hi = j
                break
            lo = j + 1
        span = hi - lo  # unknown items lo..hi-1: span + 1 possible answers
        if span <= 0:
            return lo
        if span <= probes:
            ask = list(range(lo, hi))
        else:
            ask = [lo - 1 + (span + 1) * i // (probes + 1) for i in range(1, probes + 1)]


class ChunkObjects:
    """The chunk objects of a store (module docstring): names, lookups, reads and writes."""

    def _init_chunks(self, layout: KVLayout, url: str, chunk_tokens: int) -> None:
        """Whether this store keeps chunk objects (its backend reads whole objects by name), and
        how many blocks one holds (URL option `chunk`, tokens; 0: one block per object)."""
        self.chunked = type(self)._read is not ChunkObjects._read
        self.chunk_blocks = 1
        if self.chunked:
            chunk_tokens = chunk_tokens or layout.block_size
            if chunk_tokens < layout.block_size or chunk_tokens % layout.block_size:
                raise ConfigError(f"L3 URL {url}: chunk={chunk_tokens} must be a multiple of the block size "
                                  f"{layout.block_size}")
            self.chunk_blocks = chunk_tokens // layout.block_size
        self._where: OrderedDict[int, int] = OrderedDict()  # block hash -> hash naming the object found holding it
        self._where_lock = threading.Lock()
        self._tls = threading.local()  # per-thread scratch for record headers

    # -- chunks: names and lookups ----------------------------------------------------------
    def object_name(self, h: int) -> str:
        """The name of the chunk object whose last block has hash `h`."""
        return f"{key_hex(h)}.c{self.chunk_blocks}"

    def _evicted(self, names: list[str]) -> None:
        """Record that the objects `names` left the store. An object is named after its last block,
        so that is the block recorded: the whole object with one block per object (the default)."""
        if self.events is not None:
            for name in names:
                self.events.removed(self.medium, int(name[:32], 16))

    def _check_positions(self, ids: Sequence[BlockId]) -> None:
        if self.chunked and any(b.pos < 0 for b in ids):
            raise ValueError(f"{self.url}: chunked L3 stores need each BlockId's chain position (pos)")

    def _holds(self, size: int | None, last_pos: int) -> bool:
        """Whether an object of `size` bytes is the chunk object ending at chain position `last_pos`."""
        return size == (last_pos % self.chunk_blocks + 1) * self.record_size

    def _remember(self, hashes: Sequence[int], name_hash: int) -> None:
        with self._where_lock:
            for h in hashes:
                self._where[h] = name_hash
                self._where.move_to_end(h)
            while len(self._where) > _WHERE_MAX:
                self._where.popitem(last=False)

    def _lookup(self, hashes: list[int], first: int) -> list[bool]:
        """contains_many for chunk objects: an existence check of each chunk's name (all at once,
        or by probing when the store sets `probe_lookup`), and for the first chunk that misses,
        one more of its shorter (partial) names."""
        K = self.chunk_blocks
        groups, i = [], 0  # [start, end) in hashes of each chunk touched
        while i < len(hashes):
            end = min(len(hashes), i + K - (first + i) % K)
            groups.append((i, end))
            i = end

        def present(js: list[int]) -> list[bool]:
            sizes = self._stat([self.object_name(hashes[groups[j][1] - 1]) for j in js])
            return [self._holds(size, first + groups[j][1] - 1) for j, size in zip(js, sizes)]

        if self.probe_lookup:
            n = probe_prefix(len(groups), present)
            held = [j < n for j in range(len(groups))]
        else:
            held = present(list(range(len(groups))))
        found = [False] * len(hashes)
        missed = None
        for (s, e), ok in zip(groups, held):
            if ok:
                found[s:e] = [True] * (e - s)
                self._remember(hashes[s:e], hashes[e - 1])
            elif missed is None:
                missed = (s, e)
        if missed is not None and missed[1] - missed[0] > 1:
            s, e = missed
            sizes = self._stat([self.object_name(h) for h in hashes[s : e - 1]])
            for j in reversed(range(len(sizes))):
                if self._holds(sizes[j], first + s + j):
                    found[s : s + j + 1] = [True] * (j + 1)
                    self._remember(hashes[s : s + j + 1], hashes[s + j])
                    break
        return found

    # -- chunks: reads ----------------------------------------------------------------------
    def _scratch(self, n_heads: int) -> tuple[list[memoryview], memoryview]:
        """Per-thread page-aligned buffers: `n_heads` header areas and one payload+padding area
        that records nobody asked for are read into (mmap memory suits O_DIRECT)."""
        t = self._tls
        if getattr(t, "heads", None) is None:
            t.heads = memoryview(mmap.mmap(-1, self.chunk_blocks * self._offset))
            t.spare = memoryview(mmap.mmap(-1, self.record_size - self._offset))
        return [t.heads[j * self._offset : (j + 1) * self._offset] for j in range(n_heads)], t.spare

    def _get_chunks(self, ids: list[BlockId], outs: list[memoryview], deadline: float | None) -> list[bool]:
        """Reads by chunk: each chunk's wanted records come in one ranged read of its object."""
        ok = [False] * len(ids)
        groups: list[list[int]] = []  # indices of ids, one chunk each, increasing positions
        for i, b in enumerate(ids):
            g = groups[-1] if groups else None
            if g and ids[g[-1]].pos < b.pos and ids[g[-1]].pos // self.chunk_blocks == b.pos // self.chunk_blocks:
                g.append(i)
            else:
                groups.append([i])
        self._parallel(self._get_group, [(g, ids, outs, ok) for g in groups], deadline)
        return ok

    def _get_group(self, group: list[int], ids: list[BlockId], outs: list[memoryview], ok: list[bool]) -> bool:
        last = ids[group[-1]]
        with self._where_lock:
            named = self._where.get(last.hash)
        for h in dict.fromkeys(x for x in (named, last.hash) if x is not None):
            if self._read_group(self.object_name(h), group, ids, outs, ok):
                return True
        # No object ends at (or past) the last block asked for: the chunk may be a shorter partial
        # one (a writer that stopped earlier); read what the longest one holds.
        sizes = self._stat([self.object_name(ids[i].hash) for i in group[:-1]])
        for j in reversed(range(len(sizes))):
            if self._holds(sizes[j], ids[group[j]].pos):
                self._read_group(self.object_name(ids[group[j]].hash), group[: j + 1], ids, outs, ok)
                break
        return True

    def _read_group(self, name: str, group: list[int], ids: list[BlockId], outs: list[memoryview], ok: list[bool]) -> bool:
        """Read the records of `group` (one chunk, increasing positions) from object `name` with
        one ranged read and check them in order; False if the object does not exist."""
        K, rs, off, bpb = self.chunk_blocks, self.record_size, self._offset, self.layout.bytes_per_block
        first, last = ids[group[0]].pos % K, ids[group[-1]].pos % K
        heads, spare = self._scratch(last - first + 1)
        wanted = {ids[i].pos % K: i for i in group}
        views: list[memoryview] = []
        for r in range(first, last + 1):
            i = wanted.get(r)
            views.append(heads[r - first])
            if i is None:
                views.append(spare)  # a block the caller does not ask for: read past it
            else:
                views.append(outs[i])
                if rs - off > bpb:
                    views.append(spare[bpb:])
        found = self._read(name, first * rs, views)
        if found is None:
            return False
        size, nread = found
        r = first
        try:
            if size > K * rs:
                raise DecodeError("garbage", f"object of {size} bytes, more than {K} records")
            for r in range(first, last + 1):
                i = wanted.get(r)
                if i is None:
                    continue
                start = (r - first) * rs  # where record r begins among the bytes read
                xxh = decode_header(self.layout, ids[i], heads[r - first][: max(0, min(off, nread - start))], self.align)
                if nread < start + off + bpb:
                    raise DecodeError("truncated", f"{size} bytes: record {r} is cut short")
                check_payload(outs[i], xxh)
                ok[i] = True
        except DecodeError as err:
            # Records are checked one by one: those before this one stay hits, this and later miss.
            # The object is dropped whatever the kind: a name is a pure function of the chain, so a
            # record that is not the block its name says (mismatch) fails every reader as damage
            # does, and kept, each lookup would find it again and keep it from being evicted.
            self._warn("%s: dropping %s, record %d: %s", self.url, name, r, err)
            self._stats.error(err.kind)
            self._delete_quietly(name)
        return True

    def _delete_quietly(self, name: str) -> None:
        try:
            self._delete(name)
        except Exception as err:
            log.debug("%s: delete of %s failed: %s", self.url, name, err)

    # -- chunks: writes ---------------------------------------------------------------------
    def _runs(self, ids: list[BlockId]) -> list[list[int]]:
        """The batch as runs of consecutive blocks of one chain within one chunk, in chain order."""
        K = self.chunk_blocks
        by_hash = {b.hash: i for i, b in enumerate(ids)}
        child = {}
        for i, b in enumerate(ids):
            p = by_hash.get(b.parent)
            if p is not None and ids[p].pos == b.pos - 1 and b.pos % K:
                child.setdefault(p, i)
        linked = set(child.values())
        runs = []
        for i in range(len(ids)):
            if i in linked:
                continue
            run = [i]
            while run[-1] in child:
                run.append(child[run[-1]])
            runs.append(run)
        return runs

    def _put_chunks(self, ids: list[BlockId], payloads: list[memoryview]) -> list[bool]:
        ok = [False] * len(ids)
        self._parallel(self._put_run, [(run, ids, payloads, ok) for run in self._runs(ids)])
        return ok

    def _put_run(self, run: list[int], ids: list[BlockId], payloads: list[memoryview], ok: list[bool]) -> bool:
        K, rs = self.chunk_blocks, self.record_size
        head, last = ids[run[0]], ids[run[-1]]
        name = self.object_name(last.hash)
        size = (last.pos % K + 1) * rs
        if self._known(name, size):
            return self._took(run, ids, ok)
        parts: list[Any] = []
        before = None
        if head.pos % K:
            # The chunk's earlier blocks are in the object named after this run's parent: extend it.
            before = self.object_name(head.parent)
            prefix = self._read_prefix(before, head)
            if prefix is None:
                if self._holds(self._stat([name])[0], last.pos):  # another writer stored the whole run already
                    return self._took(run, ids, ok)
                self._stats.add(orphans=len(run))
                return False
            parts.append(prefix)
        pad = bytes(rs - self._offset - self.layout.bytes_per_block)
        for i in run:
            parts += [encode_header(self.layout, ids[i], payloads[i], self.align), payloads[i]]
            if pad:
                parts.append(pad)
        if not self._write(name, parts, size):
            return False
        self._remember([ids[i].hash for i in run], last.hash)
        if before is not None:
            self._delete_quietly(before)  # the longer object holds all of it now
        return self._took(run, ids, ok)

    def _took(self, run: list[int], ids: list[BlockId], ok: list[bool]) -> bool:
        """The blocks `run` of `ids` are in the store: say so in `ok`, and record them now, before
        a later write of this put can evict them (recorded after it, the removal would come first)."""
        for i in run:
            ok[i] = True
        self._record_stored([ids[i] for i in run])
        return True

    def _read_prefix(self, name: str, head: BlockId) -> memoryview | None:
        """The records of chain positions chunk start .. head.pos-1 from object `name`, checked
        (headers, chain links, checksums), or None if they are not there whole."""
        n = head.pos % self.chunk_blocks
        buf = memoryview(mmap.mmap(-1, n * self.record_size))
        found = self._read(name, 0, [buf])
        if found is None:
            return None
        size, nread = found
        try:
            if size != len(buf) or nread != len(buf):
                raise DecodeError("truncated", f"{size} bytes, expected {len(buf)}")
            parent = None
            for j in range(n):
                rec = buf[j * self.record_size : (j + 1) * self.record_size]
                bid, xxh = parse_header(self.layout, rec, self.align)
                if bid.pos != head.pos - n + j or (parent is not None and bid.parent != parent) or bid.ns != head.ns:
                    raise DecodeError("mismatch", f"record {j} is not block {head.pos - n + j} of this chain")
                check_payload(rec[self._offset : self._offset + self.layout.bytes_per_block], xxh)
                parent = bid.hash
            if parent != head.parent:
                raise DecodeError("mismatch", "object does not end at this block's parent")
        except DecodeError as err:
            self._warn("%s: cannot extend %s, dropping it: %s", self.url, name, err)
            self._stats.error(err.kind)
            self._delete_quietly(name)  # as a read drops it (_read_group): it fails every writer too
            return None
        return buf

    # Chunked backends: whole objects by name. They may raise on service errors.
    def _stat(self, names: list[str]) -> list[int | None]:
        """Each object's size in bytes, None where it does not exist (one round trip for all)."""
        raise NotImplementedError

    def _read(self, name: str, offset: int, views: list[memoryview]) -> tuple[int, int] | None:
        """Fill `views`, in order, with the object's bytes from `offset` on (as far as it goes);
        (object size, bytes read) or None when it does not exist."""
        raise NotImplementedError

    def _write(self, name: str, parts: list[Any], size: int) -> bool:
        """Store the concatenation of `parts` (`size` bytes) as the object `name`, atomically
        (a reader sees the old object, the new one or none); False if refused (counted)."""
        raise NotImplementedError

    def _delete(self, name: str) -> None:
        raise NotImplementedError

    def _known(self, name: str, size: int) -> bool:
        """Whether the object is known, without a round trip, to be stored with `size` bytes."""
        return False
