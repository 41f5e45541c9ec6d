"""disk: the local-directory L3 store (`file:///path?size=100GiB&threads=8&direct=0&fsync=1`).

One file per block, `<dir>/<2 hex>/<32 hex>.kv` (codec format, payload page-aligned), written
atomically (temp file in the same directory, write, fdatasync, rename) so that a crash never
leaves a half object under a real name. The size budget is enforced with an in-memory LRU that
a restart rebuilds from file names, sizes and mtimes, never by reading payloads. Reads and
writes run in parallel on a thread pool. This file never serves a block it has not verified
and never deletes a file it did not name (foreign files are left alone).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from urllib.parse import unquote, urlsplit

import numpy as np

from ..errors import ConfigError
from ..layout import KVLayout
from .codec import BlockId, DecodeError, check_payload, decode_header, encode_header, key_hex, payload_offset
from .l3 import L3Store, UrlOptions

log = logging.getLogger(__name__)

ALIGN = 4096  # payload offset in a file: page-aligned, which O_DIRECT needs
_BLOCK_RE = re.compile(r"^([0-9a-f]{32})\.kv$")
_TMP_RE = re.compile(r"^\.[0-9a-f]{32}\.(\d+)\.[0-9a-f]+\.tmp$")
_STALE_TMP_S = 3600.0  # a temp file this old is garbage even if its pid number is alive again
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# A read refreshes a file's mtime (the LRU order a restart rebuilds) only when it is older than
# this: a metadata write per read cost measurable read bandwidth, and order within a minute is
# noise for an eviction policy.
_MTIME_REFRESH_S = 60.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _aligned(view: memoryview) -> bool:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN == 0 and len(view) % ALIGN == 0


class DiskStore(L3Store):
    name = "disk"

    def __init__(self, url: str, layout: KVLayout) -> None:
        opts = UrlOptions(url, ("size", "threads", "direct", "fsync"))
        self.root = unquote(urlsplit(url).path)
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError(f"L3 URL {opts.url}: {self.root} exists and is not a directory")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as err:  # e.g. a read-only parent: reads of what is there still work
            log.warning("disk L3 %s: cannot create the directory (%s); puts will fail", self.root, err)
        free = shutil.disk_usage(self.root).free if os.path.isdir(self.root) else 0
        self.capacity = opts.get("size", free // 2, UrlOptions.size)
        self.direct = opts.get("direct", False, UrlOptions.boolean) and _O_DIRECT != 0
        self.fsync = opts.get("fsync", True, UrlOptions.boolean)
        super().__init__(layout, url, opts.get("threads", 8, int))
        self.offset = payload_offset(layout, ALIGN)
        self.object_size = self.offset + layout.bytes_per_block
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> file size, oldest access first
        self._used = 0  # bytes of the files in _lru
        self._reserved = 0  # bytes of writes in flight
        self._evictions = 0
        self._lock = threading.Lock()
        self._subdirs: set[str] = set()
        self._tls = threading.local()  # per-thread page-aligned header buffer
        self._scan()

    # -- start-up ------------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the LRU from what earlier processes left, oldest mtime first; drop dead temp files."""
        t0 = time.monotonic()
        found: list[tuple[float, int, int]] = []
        now = time.time()
        try:
            tops = [e for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False) and re.fullmatch(r"[0-9a-f]{2}", e.name)]
        except OSError as err:
            log.warning("disk L3 %s: cannot list the directory (%s)", self.root, err)
            return
        for top in tops:
            try:
                entries = list(os.scandir(top.path))
            except OSError:
                continue
            for e in entries:
                m = _BLOCK_RE.match(e.name)
                try:
                    if m and e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        # Another size is another layout sharing the directory, or damage: not ours to count.
                        if st.st_size == self.object_size:
                            found.append((st.st_mtime, int(m.group(1), 16), st.st_size))
                    elif (t := _TMP_RE.match(e.name)) and (
                        not _pid_alive(int(t.group(1))) or now - e.stat().st_mtime > _STALE_TMP_S
                    ):
                        os.unlink(e.path)  # a write that died before its rename
                except OSError:
                    continue
        found.sort()
        with self._lock:
            for _, h, size in found:
                self._lru[h] = size
                self._used += size
            victims = self._evict_locked(0)
        self._unlink_all(victims)
        log.info("disk L3 %s: %d blocks (%.2f GiB of %.2f GiB) found in %.2fs", self.root, len(self._lru),
                 self._used / 2**30, self.capacity / 2**30, time.monotonic() - t0)

    # -- paths and budget -----------------------------------------------------------------
    def _path(self, h: int) -> tuple[str, str]:
        hx = key_hex(h)
        sub = os.path.join(self.root, hx[:2])
        return sub, os.path.join(sub, hx + ".kv")

    def _evict_locked(self, need: int) -> list[int]:
        """Pop LRU entries until `need` more bytes fit; the caller unlinks them outside the lock."""
        victims = []
        while self._lru and self._used + self._reserved + need > self.capacity:
            h, size = self._lru.popitem(last=False)
            self._used -= size
            victims.append(h)
        self._evictions += len(victims)
        return victims

    def _unlink_all(self, hashes: list[int]) -> None:
        for h in hashes:
            try:
                os.unlink(self._path(h)[1])
            except OSError:
                pass  # already gone (another process evicted it) or read-only: nothing to free

    def _forget(self, h: int) -> None:
        with self._lock:
            size = self._lru.pop(h, None)
            if size is not None:
                self._used -= size

    def _learn(self, h: int, size: int) -> None:
        """A file another process wrote: count it so the budget covers it."""
        with self._lock:
            if h not in self._lru:
                self._lru[h] = size
                self._used += size

    # -- L3Store ------------------------------------------------------------------------
    def _contains(self, hashes: list[int]) -> list[bool]:
        with self._lock:
            known = [h in self._lru for h in hashes]
        for i, h in enumerate(hashes):
            if not known[i]:
                # Another process sharing the directory may have written it since our scan.
                try:
                    size = os.stat(self._path(h)[1]).st_size
                except OSError:
                    continue
                if size == self.object_size:
                    self._learn(h, size)
                    known[i] = True
        return known

    def _get(self, ids: list[BlockId], outs: list[memoryview], deadline: float | None) -> list[bool]:
        return self._parallel(self._read_one, list(zip(ids, outs)), deadline)

    def _put(self, ids: list[BlockId], payloads: list[memoryview]) -> list[bool]:
        return self._parallel(self._write_one, list(zip(ids, payloads)))

    def _write_one(self, bid: BlockId, payload: memoryview) -> bool:
        # Write, sync and rename one block per worker: with several workers the syncs overlap
        # (measured: as fast as writing all files first and syncing them after, and simpler).
        return self._finish_write(self._begin_write(bid, payload))

    def _head_buffer(self) -> memoryview:
        buf = getattr(self._tls, "head", None)
        if buf is None:
            # mmap memory is page-aligned, so the header part of a read may use O_DIRECT.
            buf = self._tls.head = memoryview(mmap.mmap(-1, self.offset))
        return buf

    def _read_one(self, bid: BlockId, out: memoryview) -> bool:
        h = bid.hash
        path = self._path(h)[1]
        direct = self.direct and _aligned(out)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0))
        except FileNotFoundError:
            self._forget(h)  # evicted by another process, or never there
            return False
        except OSError as err:
            if direct and err.errno == errno.EINVAL:
                self.direct = False
                log.info("disk L3 %s: O_DIRECT not supported here; using buffered I/O", self.root)
                return self._read_one(bid, out)
            self._stats.error("io")
            return False
        try:
            st = os.fstat(fd)
            size = st.st_size
            head = self._head_buffer()
            # One call reads header and payload, the payload straight into the caller's buffer.
            n = os.preadv(fd, [head, out], 0) if size >= self.object_size else os.preadv(fd, [head], 0)
            xxh = decode_header(self.layout, bid, head[: min(n, self.offset)], ALIGN)
            if size < self.object_size or n < self.object_size:
                raise DecodeError("truncated", f"{size} bytes, expected {self.object_size}")
            if size > self.object_size:
                raise DecodeError("garbage", "trailing bytes after the payload")
            check_payload(out, xxh)
        except DecodeError as err:
            log.warning("disk L3 %s: dropping %s (%s)", self.root, key_hex(h), err)
            self._stats.error(err.kind)
            self._forget(h)
            try:
                os.unlink(path)
            except OSError:
                pass
            return False
        except OSError as err:
            log.warning("disk L3 %s: read of %s failed: %s", self.root, key_hex(h), err)
            self._stats.error("io")
            return False
        finally:
            os.close(fd)
        with self._lock:
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = size
                self._used += size
        if time.time() - st.st_mtime > _MTIME_REFRESH_S:
            try:
                os.utime(path)  # mtime = last access, so a restart rebuilds the LRU order
            except OSError:
                pass
        return True

    def _begin_write(self, bid: BlockId, payload: memoryview) -> tuple | bool:
        """Reserve budget and write a temp file (not yet synced); True if the block is already stored."""
        h = bid.hash
        size = self.object_size
        with self._lock:
            if h in self._lru:
                self._lru.move_to_end(h)
                return True
            if size > self.capacity:
                self._stats.error("too_large")
                return False
            victims = self._evict_locked(size)
            self._reserved += size
        self._unlink_all(victims)
        sub, path = self._path(h)
        tmp = os.path.join(sub, f".{key_hex(h)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            if sub not in self._subdirs:
                os.makedirs(sub, exist_ok=True)
                self._subdirs.add(sub)
            fd = self._write_file(tmp, encode_header(self.layout, bid, payload, ALIGN), payload)
        except OSError as err:
            self._write_failed(h, tmp, err)
            return False
        return (h, fd, tmp, path)

    def _finish_write(self, pending: tuple | bool) -> bool:
        """fdatasync, then rename to the real name (atomic: readers see all or nothing)."""
        if isinstance(pending, bool):
            return pending
        h, fd, tmp, path = pending
        try:
            try:
                if self.fsync:
                    os.fdatasync(fd)  # the data is on disk before the name makes it visible
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as err:
            self._write_failed(h, tmp, err)
            return False
        with self._lock:
            self._reserved -= self.object_size
            if h not in self._lru:
                self._lru[h] = self.object_size
                self._used += self.object_size
        return True

    def _write_failed(self, h: int, tmp: str, err: OSError) -> None:
        log.warning("disk L3 %s: write of %s failed: %s", self.root, key_hex(h), err)
        self._stats.error("io")
        with self._lock:
            self._reserved -= self.object_size
        try:
            os.unlink(tmp)
        except OSError:
            pass

    def _write_file(self, tmp: str, header: bytes, payload: memoryview) -> int:
        """Create `tmp` and write header + payload; return the open fd (the caller syncs and closes)."""
        direct = self.direct and _aligned(payload)
        if direct:
            head = self._head_buffer()
            head[:] = header
            parts = [head, payload]
        else:
            parts = [memoryview(header), payload]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags | (_O_DIRECT if direct else 0), 0o644)
        except OSError as err:
            if not (direct and err.errno == errno.EINVAL):
                raise
            self.direct = False
            log.info("disk L3 %s: O_DIRECT not supported here; using buffered I/O", self.root)
            fd = os.open(tmp, flags, 0o644)
            parts = [memoryview(header), payload]
        try:
            while parts:
                n = os.writev(fd, parts)
                # A short write (signal, full disk) leaves the rest to write: drop what was written.
                while parts and n >= len(parts[0]):
                    n -= len(parts[0])
                    parts.pop(0)
                if parts and n:
                    parts[0] = parts[0][n:]
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _extra_stats(self) -> dict:
        with self._lock:
            return {"capacity_bytes": self.capacity, "used_bytes": self._used, "blocks": len(self._lru),
                    "evictions": self._evictions, "direct": self.direct}
