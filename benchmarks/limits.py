"""Physical limits that benchmarks divide by, measured in the same run: pinned host -> device
bandwidth (PCIe, the floor of an L2 hit) and a disk's raw read and write speeds, sequential or by
several threads (the floor of a disk hit, and what writing to the disk tier takes from it). Each
function measures one thing and returns bytes/second; none touches tierkv.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
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


def disk_read_bandwidth(directory: Path, nbytes: int = 2**31, chunk: int = 8 << 20,
                        threads: int = 1) -> tuple[float, str]:
    """(bytes/s, how) of reading an `nbytes` file in `directory`: disk_bandwidth's read."""
    read_bps, _, how = disk_bandwidth(directory, nbytes, chunk, threads)
    return read_bps, how


def disk_bandwidth(directory: Path, nbytes: int = 2**31, chunk: int = 8 << 20,
                   threads: int = 1) -> tuple[float, float, str]:
    """(read bytes/s, write bytes/s, how) of an `nbytes` file in `directory`, by `threads` threads
    side by side, each on every threads-th `chunk` (an SSD serves several requests at once: a
    store that reads with 8 threads gets several times what one sequential reader gets): written
    and fsynced (the write's speed, until the data is on the disk), then read with O_DIRECT into
    page-aligned memory (the disk itself, as the disk tier's ?direct=1 reads it), or where the
    filesystem refuses O_DIRECT, buffered after evicting the file from the page cache (fadvise
    DONTNEED)."""
    path = Path(directory) / "tierkv-raw-read.bin"
    chunks, threads = max(1, nbytes // chunk), max(1, threads)
    block = os.urandom(chunk)

    def each(work) -> None:  # work(i) for every chunk i, `threads` at a time; a failed one raises here
        with ThreadPoolExecutor(threads) as pool:
            for done in [pool.submit(lambda part=part: [work(i) for i in range(part, chunks, threads)])
                         for part in range(threads)]:
                done.result()

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t = time.perf_counter()
        each(lambda i: os.pwrite(fd, block, i * chunk))
        os.fsync(fd)
        write_bps = chunks * chunk / (time.perf_counter() - t)
    finally:
        os.close(fd)
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page-aligned, as O_DIRECT needs; one a thread
    try:
        fd, how = _open_uncached(path, bufs[0])
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            read = [0] * chunks
            t = time.perf_counter()
            each(lambda i: read.__setitem__(i, os.preadv(fd, [bufs[i % threads]], i * chunk)))
            seconds = time.perf_counter() - t
            total = sum(read)
        finally:
            os.close(fd)
    finally:
        for buf in bufs:
            buf.close()
        path.unlink()
    if total != chunks * chunk:
        raise OSError(f"the disk probe read {total} of the {chunks * chunk} bytes it wrote to {path}")
    return total / seconds, write_bps, f"{how} read of {total >> 20} MiB by {threads} thread(s) after its fsynced write"


def _open_uncached(path: Path, buf: mmap.mmap) -> tuple[int, str]:
    """(fd, how) to read `path` from the disk itself: with O_DIRECT, or where the filesystem refuses
    it (EINVAL at the open or at the first read into the page-aligned `buf`), buffered."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            os.preadv(fd, [buf], 0)
            return fd, "O_DIRECT"
        except OSError:
            os.close(fd)
    except OSError:
        pass
    return os.open(path, os.O_RDONLY), "buffered after fadvise(DONTNEED)"
