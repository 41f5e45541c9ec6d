"""benchmarks/limits.py's disk probe: a file written and read back by one thread or several, each
byte read once, every chunk counted, and nothing left behind; a short read is an error, not a
faster disk. (The device bounds, PCIe and the GPU, are measured on the GPU only.)"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import limits  # noqa: E402
from serving.bounds import disk_bandwidth  # noqa: E402

from tierkv.tiers.disk import THREADS as DISK_THREADS  # noqa: E402

CHUNK = 1 << 20


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_the_disk_probe_reads_every_chunk_by_its_threads(tmp_path, threads, monkeypatch):
    offsets = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: offsets.append(at) or preadv(fd, bufs, at))
    read_bps, write_bps, how = limits.disk_bandwidth(tmp_path, 10 * CHUNK, CHUNK, threads)
    assert read_bps > 0 and write_bps > 0
    assert f"read of 10 MiB by {threads} thread(s)" in how
    # the O_DIRECT check reads chunk 0 once more; then each chunk once
    assert sorted(offsets[1:]) == [i * CHUNK for i in range(10)]
    assert list(tmp_path.iterdir()) == []


def test_a_short_read_is_an_error(tmp_path, monkeypatch):
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: 0 if at == 5 * CHUNK else preadv(fd, bufs, at))
    with pytest.raises(OSError, match=f"read {9 * CHUNK} of the {10 * CHUNK} bytes"):
        limits.disk_bandwidth(tmp_path, 10 * CHUNK, CHUNK, 4)
    assert list(tmp_path.iterdir()) == []


def test_a_filesystem_refusing_o_direct_is_read_buffered_and_no_descriptor_is_left_open(tmp_path, monkeypatch):
    preadv, refused = os.preadv, []

    def first_refused(fd, bufs, at):
        if not refused:
            refused.append(fd)
            raise OSError(22, "Invalid argument")  # what the O_DIRECT check meets on such a filesystem
        return preadv(fd, bufs, at)

    monkeypatch.setattr(os, "preadv", first_refused)
    open_before = len(os.listdir("/proc/self/fd"))
    how = limits.disk_bandwidth(tmp_path, 4 * CHUNK, CHUNK, 2)[2]
    assert how.startswith("buffered after fadvise(DONTNEED) read of 4 MiB")
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_the_serving_bound_reads_with_the_disk_tiers_threads(tmp_path):
    assert f"by {DISK_THREADS} thread(s)" in disk_bandwidth(tmp_path, 64 << 20)[2]
