"""disk: the local-directory L3 store (`file:///path?size=100GiB&threads=8&direct=0&fsync=1&chunk=256`).

One file per chunk object (chunks.py), `<dir>/<2 hex>/<32 hex>.c<K>.kv`, its records page-aligned,
written atomically (temp file in the same directory, one writev that O_DSYNC makes durable,
rename) so that a crash never leaves a half object under a real name. A read of a chunk is one
preadv: headers into scratch pages, payloads straight into the caller's buffers. The size budget
is enforced with an in-memory LRU of objects that a restart rebuilds from file names, sizes and
mtimes, never by reading payloads; files of the one-block format 1 (`<32 hex>.kv`) are never read
and are the first evicted. Reads and writes run in parallel on a thread pool; each syscall's
return is a thread asking for the GIL that the engine's thread runs under, so a write makes as
few as it can (no random temp name, no separate fsync). This file never serves a block it has not
verified and never deletes a file it did not name (foreign files are left alone).
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np

from ..errors import ConfigError
from ..layout import KVLayout
from .codec import payload_offset
from .chunks import DEFAULT_CHUNK_TOKENS
from .l3 import COMMON_OPTIONS, L3Store
from .service import UrlOptions, describe

log = logging.getLogger(__name__)

ALIGN = 4096  # records start on page boundaries in a file, which O_DIRECT needs
THREADS = 8  # reads and writes side by side (?threads=): an SSD serves several at once
_OBJECT_RE = re.compile(r"^([0-9a-f]{32}\.c(\d+))\.kv$")
_LEGACY_RE = re.compile(r"^([0-9a-f]{32})\.kv$")  # format 1: one block per file
_TMP_RE = re.compile(r"^\.[0-9a-f]{32}(?:\.c\d+)?\.(\d+)\.[0-9a-f]+\.tmp$")
_STALE_TMP_S = 3600.0  # a temp file this old is garbage even if its pid number is alive again
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# Temp-file names: this process's tag and a counter, so naming a file costs no syscall (a fresh
# random token per file was one more GIL round trip per block). The tag tells apart processes that
# reuse a pid; a forked child gets another pid.
_TMP_TAG = secrets.token_hex(4)
_tmp_ids = itertools.count()
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


def _aligned(view: Any) -> bool:
    view = memoryview(view)
    return len(view) % ALIGN == 0 and np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN == 0


class DiskStore(L3Store):
    name = "disk"
    align = ALIGN

    def __init__(self, url: str, layout: KVLayout) -> None:
        opts = UrlOptions(url, ("size", "threads", "direct", "fsync", "chunk", *COMMON_OPTIONS))
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
        super().__init__(layout, url, opts.get("threads", THREADS, int), opts.get("chunk", DEFAULT_CHUNK_TOKENS, int),
                         opts)
        self._lru: OrderedDict[str, int] = OrderedDict()  # object name -> file size, oldest access first
        self._used = 0  # bytes of the files in _lru
        self._reserved = 0  # bytes of writes in flight
        self._evictions = 0
        self._lock = threading.Lock()
        self._remake = threading.Lock()  # one writer at a time makes a vanished directory again
        self._scan()

    # -- start-up ------------------------------------------------------------------------
    def _valid_size(self, size: int) -> bool:
        return size > 0 and size % self.record_size == 0 and size <= self.chunk_blocks * self.record_size

    def _scan(self) -> None:
        """Rebuild the LRU from what earlier processes left, oldest mtime first (format-1 files
        before everything: they are never read); drop dead temp files."""
        t0 = time.monotonic()
        found: list[tuple[bool, float, str, int]] = []
        legacy_size = payload_offset(self.layout, ALIGN) + self.layout.bytes_per_block
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
                try:
                    if (m := _OBJECT_RE.match(e.name)) and e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        # Another chunk size or record size is another configuration sharing the
                        # directory, or damage: not ours to count.
                        if int(m.group(2)) == self.chunk_blocks and self._valid_size(st.st_size):
                            found.append((True, st.st_mtime, m.group(1), st.st_size))
                    elif (m := _LEGACY_RE.match(e.name)) and e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        if st.st_size == legacy_size:
                            found.append((False, st.st_mtime, m.group(1), st.st_size))
                    elif (t := _TMP_RE.match(e.name)) and (
                        not _pid_alive(int(t.group(1))) or now - e.stat().st_mtime > _STALE_TMP_S
                    ):
                        os.unlink(e.path)  # a write that died before its rename
                except OSError:
                    continue
        found.sort()
        legacy = sum(not current for current, *_ in found)
        if legacy:
            log.warning("disk L3 %s: %d block files of the old one-block format (1) are not read by this "
                        "version; they are evicted first as the budget needs room", self.root, legacy)
        with self._lock:
            for _, _, name, size in found:
                self._lru[name] = size
                self._used += size
            victims = self._evict_locked(0)
        self._unlink_all(victims)
        log.info("disk L3 %s: %d objects (%.2f GiB of %.2f GiB) found in %.2fs", self.root, len(self._lru),
                 self._used / 2**30, self.capacity / 2**30, time.monotonic() - t0)

    # -- paths and budget -----------------------------------------------------------------
    def _path(self, name: str) -> tuple[str, str]:
        sub = os.path.join(self.root, name[:2])
        return sub, os.path.join(sub, name + ".kv")

    def _evict_locked(self, need: int) -> list[str]:
        """Pop LRU entries until `need` more bytes fit; the caller unlinks them outside the lock."""
        victims = []
        while self._lru and self._used + self._reserved + need > self.capacity:
            name, size = self._lru.popitem(last=False)
            self._used -= size
            victims.append(name)
        self._evictions += len(victims)
        return victims

    def _unlink_all(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(self._path(name)[1])
            except OSError:
                pass  # already gone (another process evicted it) or read-only: nothing to free

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._lru.pop(name, None)
            if size is not None:
                self._used -= size

    def _learn(self, name: str, size: int) -> None:
        """An object this process has just seen on disk: count it (most recent) so the budget covers it."""
        with self._lock:
            old = self._lru.pop(name, None)
            self._used += size - (old or 0)
            self._lru[name] = size

    # -- chunked L3Store backend ---------------------------------------------------------
    def _stat(self, names: list[str]) -> list[int | None]:
        with self._lock:
            sizes = [self._lru.get(n) for n in names]
            for name, size in zip(names, sizes):
                if size is not None:
                    # a lookup that finds an object is a use: its read follows, and the writes
                    # that make room for that read (L2 demoting to here) must not evict it first
                    self._lru.move_to_end(name)
        for i, name in enumerate(names):
            if sizes[i] is None:
                # Another process sharing the directory may have written it since our scan.
                try:
                    size = os.stat(self._path(name)[1]).st_size
                except OSError:
                    continue
                if self._valid_size(size):
                    self._learn(name, size)
                    sizes[i] = size
        return sizes

    def _known(self, name: str, size: int) -> bool:
        with self._lock:
            if self._lru.get(name) != size:
                return False
            self._lru.move_to_end(name)
        # One stat, so that a put of a file deleted behind the index (an operator's rm, another
        # process's eviction) writes it again instead of counting a block that is not there.
        try:
            if os.stat(self._path(name)[1]).st_size == size:
                return True
        except OSError:
            pass
        self._forget(name)
        return False

    def _read(self, name: str, offset: int, views: list[memoryview]) -> tuple[int, int] | None:
        path = self._path(name)[1]
        direct = self.direct and offset % ALIGN == 0 and all(_aligned(v) for v in views)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0))
        except FileNotFoundError:
            self._forget(name)  # evicted by another process, or never there
            self._check_dir(self._path(name)[0], make=False)  # or its directory was deleted
            return None
        except OSError as err:
            if direct and err.errno == errno.EINVAL:
                self._no_direct()
                return self._read(name, offset, views)
            raise
        try:
            st = os.fstat(fd)
            # One call reads every record asked for: headers, and payloads straight into the caller's buffers.
            nread = os.preadv(fd, views, offset)
        finally:
            os.close(fd)
        self._learn(name, st.st_size)
        if time.time() - st.st_mtime > _MTIME_REFRESH_S:
            try:
                os.utime(path)  # mtime = last access, so a restart rebuilds the LRU order
            except OSError:
                pass
        return st.st_size, nread

    def _write(self, name: str, parts: list[Any], size: int) -> bool:
        with self._lock:
            if size > self.capacity:
                self._stats.error("too_large")
                return False
            victims = self._evict_locked(size)
            self._reserved += size
        self._unlink_all(victims)
        self._evicted(victims)
        sub, path = self._path(name)
        tmp = os.path.join(sub, f".{name}.{os.getpid()}.{_TMP_TAG}{next(_tmp_ids):x}.tmp")
        try:
            # with fsync, O_DSYNC: the data is on disk when the write returns, before the name
            # makes it visible (as fdatasync would make it, one syscall less)
            try:
                self._write_file(tmp, parts)
            except FileNotFoundError:  # a first write there, or the directory was deleted since
                self._check_dir(sub, make=True)
                self._write_file(tmp, parts)
            os.rename(tmp, path)  # atomic: readers see the old object, the new one or none
        except OSError as err:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self.health.failed("writes", f"fail ({describe(err)})")  # read-only, full, gone: say so on /health
            raise
        finally:
            with self._lock:
                self._reserved -= size
        self._learn(name, size)
        self.health.answered("writes")
        return True

    def _check_dir(self, sub: str, make: bool) -> None:
        """If the object directory `sub` is not there (an operator may delete it, or the whole
        root, under a running store), forget the objects the index holds in it (all of them if
        the root went too), so that the budget, lookups and puts agree with the disk; `make`: make
        it again (with the root), for a write that found it missing. Directories are made on
        demand, never remembered as made."""
        with self._remake:  # the first to find it gone forgets; the others find it made, or forgotten
            if os.path.isdir(sub):
                return
            gone = os.path.basename(sub) if os.path.isdir(self.root) else ""
            with self._lock:
                names = [n for n in self._lru if n.startswith(gone)]
            for n in names:
                self._forget(n)
            if names:
                log.warning("disk L3 %s: %s was deleted with %d objects; the index forgets them, and writes "
                            "make it again", self.root, sub if gone else self.root, len(names))
            if make:
                os.makedirs(sub, exist_ok=True)

    def _delete(self, name: str) -> None:
        self._forget(name)
        try:
            os.unlink(self._path(name)[1])
        except FileNotFoundError:
            pass

    # -- files ---------------------------------------------------------------------------
    def _no_direct(self) -> None:
        self.direct = False
        log.info("disk L3 %s: O_DIRECT not supported here; using buffered I/O", self.root)

    def _direct_parts(self, parts: list[Any]) -> list[Any] | None:
        """`parts` with small unaligned ones (headers, padding) copied to page-aligned memory, or
        None if a payload is unaligned (then the write is buffered)."""
        out = []
        for p in parts:
            if _aligned(p):
                out.append(p)
            elif isinstance(p, bytes) and len(p) % ALIGN == 0:
                buf = mmap.mmap(-1, len(p))
                buf.write(p)
                out.append(buf)
            else:
                return None
        return out

    def _write_file(self, tmp: str, parts: list[Any]) -> None:
        """Create `tmp` and write the parts (durably when fsync is on)."""
        direct = self.direct and (aligned := self._direct_parts(parts)) is not None
        if direct:
            parts = aligned
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DSYNC if self.fsync else 0)
        try:
            fd = os.open(tmp, flags | (_O_DIRECT if direct else 0), 0o644)
        except OSError as err:
            if not (direct and err.errno == errno.EINVAL):
                raise
            self._no_direct()
            fd = os.open(tmp, flags, 0o644)
        views = [memoryview(p) for p in parts]
        try:
            while views:
                n = os.writev(fd, views[:1024])  # IOV_MAX
                # A short write (signal, full disk) leaves the rest to write: drop what was written.
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
        finally:
            os.close(fd)

    def _extra_stats(self) -> dict:
        with self._lock:
            blocks = sum(size // self.record_size for size in self._lru.values())
            return {"capacity_bytes": self.capacity, "used_bytes": self._used, "objects": len(self._lru),
                    "blocks": blocks, "evictions": self._evictions, "direct": self.direct}
