"""Physical limits that benchmarks divide by, measured in the same run: pinned host -> device
bandwidth (PCIe, the floor of an L2 hit) and a disk's raw sequential read and write speeds (the
floor of a disk hit, and what writing to the disk tier takes from it). Each function measures one
thing and returns bytes/second; none touches tierkv.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import torch


def h2d_bandwidth(nbytes: int = 2**30) -> float:
    """Bytes/s of one pinned host -> device copy (copy engine): the PCIe bound of L2 loads."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return 5 * nbytes / (start.elapsed_time(end) / 1e3)


def drop_page_cache() -> bool:
    """Make the next disk read come from the disk, not from the OS page cache (needs root)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def disk_read_bandwidth(directory: Path, nbytes: int = 2**31, chunk: int = 8 << 20) -> tuple[float, str]:
    """(bytes/s, how) of one sequential read of an `nbytes` file in `directory`: disk_bandwidth's read."""
    read_bps, _, how = disk_bandwidth(directory, nbytes, chunk)
    return read_bps, how


def disk_bandwidth(directory: Path, nbytes: int = 2**31, chunk: int = 8 << 20) -> tuple[float, float, str]:
    """(read bytes/s, write bytes/s, how) of an `nbytes` file in `directory`: written sequentially
    and fsynced (the write's speed, until the data is on the disk), then read sequentially with
    O_DIRECT into page-aligned memory (the disk itself, as the disk tier's ?direct=1 reads it), or
    where the filesystem refuses O_DIRECT, buffered after evicting the file from the page cache
    (fadvise DONTNEED)."""
    path = Path(directory) / "tierkv-raw-read.bin"
    block = os.urandom(chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t = time.perf_counter()
        for _ in range(max(1, nbytes // chunk)):
            os.write(fd, block)
        os.fsync(fd)
        write_bps = max(1, nbytes // chunk) * chunk / (time.perf_counter() - t)
    finally:
        os.close(fd)
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    try:
        try:
            fd, how = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), "O_DIRECT"
            os.readv(fd, [buf])  # a filesystem that refuses O_DIRECT says so here (EINVAL)
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError:
            fd, how = os.open(path, os.O_RDONLY), "buffered after fadvise(DONTNEED)"
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            total = 0
            while n := os.readv(fd, [buf]):
                total += n
            seconds = time.perf_counter() - t
        finally:
            os.close(fd)
    finally:
        buf.close()
        path.unlink()
    return total / seconds, write_bps, f"{how} read of {total >> 20} MiB, after its fsynced write"
