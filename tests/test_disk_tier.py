"""tierkv/tiers/disk.py: round trips, chunk objects, warm restart, budget, and faults (damaged
files, read-only, SIGKILL). Tests about single objects use chunk=16 (one block per object)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from services import block_chain, get_and_check, empty_like_blocks, same_bytes

from tierkv.layout import KVLayout
from tierkv.tiers import service
from tierkv.tiers.codec import byte_view, encode_header, key_hex, payload_offset
from tierkv.tiers.open import open_store

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)  # 16 KiB
TESTS = Path(__file__).parent


def _store(path, size="64MiB", **opts):
    extra = "".join(f"&{k}={v}" for k, v in opts.items())
    return open_store(f"file://{path}?size={size}{extra}", LAYOUT)


def _file(root, h, chunk_blocks=1) -> Path:
    """The file of the chunk object whose last block has hash `h`."""
    hx = key_hex(h)
    return Path(root) / hx[:2] / f"{hx}.c{chunk_blocks}.kv"


def _check(store, ids, pays) -> list[bool]:
    """get_many, asserting that every hit is byte-identical to what was stored."""
    return get_and_check(store, LAYOUT, ids, pays)


@pytest.mark.parametrize("chunk", [0, 256])  # one block per object (the default), or 16-block chunks
def test_roundtrip_and_lookup(tmp_path, chunk):
    ids, pays = block_chain(LAYOUT, 12)
    s = _store(tmp_path, chunk=chunk)
    assert s.contains_many([b.hash for b in ids]) == [False] * 12
    assert s.put_many(ids, pays) == [True] * 12
    assert s.contains_many([b.hash for b in ids] + [12345]) == [True] * 12 + [False]
    assert _check(s, ids, pays) == [True] * 12
    st = s.stats()
    assert st["hits"] == 12 and st["bytes_read"] == 12 * LAYOUT.bytes_per_block and st["blocks"] == 12
    if chunk:  # one partial chunk of 12 blocks, named after its last block
        assert st["objects"] == 1 and [p.name for p in tmp_path.rglob("*.kv")] == [_file(tmp_path, ids[11].hash, 16).name]
    else:
        assert st["objects"] == 12
        assert sorted(p.name for p in tmp_path.rglob("*.kv")) == sorted(_file(tmp_path, b.hash).name for b in ids)
    assert s.estimate_load_seconds(10) > 0
    with pytest.raises(ValueError):
        s.get_many(ids[:1], [torch.empty(3)])
    s.close()


def test_warm_restart_finds_blocks_without_reading_payloads(tmp_path):
    ids, pays = block_chain(LAYOUT, 8)
    s = _store(tmp_path)
    s.put_many(ids, pays)
    s.close()
    s2 = _store(tmp_path)
    assert s2.stats()["blocks"] == 8 and s2.stats()["bytes_read"] == 0
    assert _check(s2, ids, pays) == [True] * 8
    s2.close()


def test_truncated_and_flipped_files_are_counted_misses_and_dropped(tmp_path):
    ids, pays = block_chain(LAYOUT, 4)
    s = _store(tmp_path, chunk=16)
    s.put_many(ids, pays)
    f0, f1, f2 = (_file(tmp_path, b.hash) for b in ids[:3])
    os.truncate(f0, f0.stat().st_size - 100)
    data = bytearray(f1.read_bytes())
    data[-5] ^= 0x10  # inside the payload
    f1.write_bytes(bytes(data))
    data = bytearray(f2.read_bytes())
    data[40] ^= 0x10  # inside the msgpack header
    f2.write_bytes(bytes(data))
    assert _check(s, ids, pays) == [False, False, False, True]
    err = s.stats()["errors"]
    assert err["truncated"] == 1 and err["checksum"] == 1 and err["mismatch"] + err["garbage"] + err["layout"] == 1
    assert not f0.exists() and not f1.exists() and not f2.exists()
    assert s.contains_many([b.hash for b in ids]) == [False, False, False, True]
    s.close()


def test_foreign_files_are_ignored_and_left_alone(tmp_path):
    ids, pays = block_chain(LAYOUT, 3)
    s = _store(tmp_path, chunk=16)
    s.put_many(ids[:2], pays[:2])
    s.close()
    (tmp_path / "README").write_text("not a block")
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / "notes.txt").write_text("mine")
    impostor = _file(tmp_path, ids[2].hash)  # a block's name holding something else
    impostor.parent.mkdir(exist_ok=True)
    impostor.write_bytes(os.urandom(LAYOUT.bytes_per_block + 4096))
    s2 = _store(tmp_path, chunk=16)
    assert _check(s2, ids, pays) == [True, True, False]
    assert s2.stats()["errors"]["garbage"] == 1
    assert (tmp_path / "README").exists() and (tmp_path / "ab" / "notes.txt").exists()
    s2.close()


def test_budget_evicts_least_recently_used_and_never_grows(tmp_path):
    s = _store(tmp_path, size="1KiB", chunk=16)
    size = s.record_size
    s.close()
    s = _store(tmp_path, size=str(5 * size), chunk=16)
    ids, pays = block_chain(LAYOUT, 20)
    s.put_many(ids[:5], pays[:5])
    assert _check(s, ids[:1], pays[:1]) == [True]  # block 0 becomes the most recent
    for i in range(5, 20):
        assert s.put_many([ids[i]], [pays[i]]) == [True]
        on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kv"))
        assert on_disk <= 5 * size and s.stats()["used_bytes"] <= 5 * size
    present = s.contains_many([b.hash for b in ids])
    assert present[15:] == [True] * 5 and sum(present) == 5
    assert s.stats()["evictions"] == 15
    s.close()
    # A block larger than the whole budget is refused, not written.
    tiny = _store(tmp_path / "tiny", size="4KiB", chunk=16)
    assert tiny.put_many(ids[:1], pays[:1]) == [False]
    assert tiny.stats()["errors"]["too_large"] == 1 and not list((tmp_path / "tiny").rglob("*.kv"))
    tiny.close()


def test_a_lookup_hit_is_a_use_that_the_next_write_does_not_evict(tmp_path):
    # The cache looks a prefix up, then makes room in L2 for it (demoting L2 blocks, which under
    # write-back writes them here) and only then reads it: a full disk must not evict the very
    # block that was just found (the cache's state machine found match() != retrieve() this way).
    probe = _store(tmp_path / "probe", size="1KiB", chunk=16)
    size = probe.record_size
    probe.close()
    s = _store(tmp_path, size=str(3 * size), chunk=16)
    ids, pays = block_chain(LAYOUT, 4)
    for i in range(3):  # one at a time, so the LRU order is 0, 1, 2
        assert s.put_many([ids[i]], [pays[i]]) == [True]
    assert s.contains_many([ids[0].hash]) == [True]  # the oldest, now found
    assert s.put_many([ids[3]], [pays[3]]) == [True]  # the disk is full: one goes
    assert _check(s, ids[:1], pays[:1]) == [True]
    assert s.contains_many([b.hash for b in ids]) == [True, False, True, True]  # block 1 went instead
    s.close()


def test_restart_rebuilds_lru_order_from_mtimes(tmp_path):
    s = _store(tmp_path, chunk=16)
    size = s.record_size
    ids, pays = block_chain(LAYOUT, 4)
    for i in range(3):
        s.put_many([ids[i]], [pays[i]])
        os.utime(_file(tmp_path, ids[i].hash), (1000 + i, 1000 + i))
    _check(s, ids[:1], pays[:1])  # a read refreshes block 0's mtime: it is now the newest
    s.close()
    s2 = _store(tmp_path, size=str(3 * size), chunk=16)
    s2.put_many([ids[3]], [pays[3]])
    assert s2.contains_many([b.hash for b in ids]) == [True, False, True, True]
    s2.close()


def test_past_deadline_reads_nothing(tmp_path):
    ids, pays = block_chain(LAYOUT, 6)
    s = _store(tmp_path, threads=1)
    s.put_many(ids, pays)
    assert s.get_many(ids, empty_like_blocks(LAYOUT, 6), deadline=time.monotonic() - 1) == [False] * 6
    s.close()


def test_two_live_stores_on_one_directory_see_each_others_blocks(tmp_path):
    ids, pays = block_chain(LAYOUT, 3)
    a, b = _store(tmp_path), _store(tmp_path)
    a.put_many(ids, pays)
    assert b.contains_many([x.hash for x in ids]) == [True] * 3
    assert _check(b, ids, pays) == [True] * 3
    a.close()
    b.close()


def test_direct_io_option_roundtrips(tmp_path):
    # Falls back to buffered I/O where the filesystem refuses O_DIRECT (tmpfs); bytes must match either way.
    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, block_size=16)  # 32 KiB
    ids, pays = block_chain(big, 4)
    s = open_store(f"file://{tmp_path}?size=16MiB&direct=1", big)
    assert s.put_many(ids, pays) == [True] * 4
    outs = empty_like_blocks(big, 4)
    assert s.get_many(ids, outs) == [True] * 4
    assert all(same_bytes(o, p) for o, p in zip(outs, pays))
    s.close()


def test_partial_chunk_then_a_longer_write_completes_it(tmp_path):
    ids, pays = block_chain(LAYOUT, 20)
    s = _store(tmp_path, chunk=64)  # 4 blocks a chunk
    assert s.put_many(ids[:6], pays[:6]) == [True] * 6  # one full chunk and a partial one (blocks 4, 5)
    assert s.contains_many([b.hash for b in ids[:8]]) == [True] * 6 + [False] * 2
    assert s.contains_many([b.hash for b in ids[5:8]], first_pos=5) == [True, False, False]
    assert _check(s, ids[:6], pays[:6]) == [True] * 6
    # blocks 6..9 extend the partial chunk from its parent's object, then start the next chunk
    assert s.put_many(ids[6:10], pays[6:10]) == [True] * 4
    names = sorted(p.name for p in tmp_path.rglob("*.kv"))
    assert names == sorted(_file(tmp_path, ids[i].hash, 4).name for i in (3, 7, 9))
    assert s.contains_many([b.hash for b in ids]) == [True] * 10 + [False] * 10
    assert _check(s, ids, pays) == [True] * 10 + [False] * 10
    # a run that starts inside a chunk whose head is in no object is refused, never mislabeled
    assert s.put_many(ids[13:15], pays[13:15]) == [False, False]
    assert s.stats()["orphans"] == 2
    # a second store on the directory reads the part of a chunk it asks for, up to the chunk's end
    s2 = _store(tmp_path, chunk=64)
    assert _check(s2, ids[5:8], pays[5:8]) == [True] * 3
    assert _check(s2, ids[0:4], pays[0:4]) == [True] * 4
    # the trade of naming a chunk after its last block: a chain that ends inside a chunk finds no
    # longer object (blocks 4..7 are stored as one); at most chunk-1 blocks are recomputed
    assert _check(s2, ids[4:6], pays[4:6]) == [False, False]
    assert sum(s.stats()["errors"].values()) + sum(s2.stats()["errors"].values()) == 0
    s.close()
    s2.close()


def test_corrupt_byte_in_block_k_of_a_chunk_is_a_miss_from_k_on(tmp_path):
    ids, pays = block_chain(LAYOUT, 8)
    s = _store(tmp_path, chunk=256)
    s.put_many(ids, pays)
    f = _file(tmp_path, ids[7].hash, 16)
    data = bytearray(f.read_bytes())
    k = 5
    data[k * s.record_size + payload_offset(LAYOUT, 4096) + 123] ^= 0x01  # inside block 5's payload
    f.write_bytes(bytes(data))
    assert _check(s, ids, pays) == [True] * k + [False] * (8 - k)
    assert s.stats()["errors"]["checksum"] == 1
    s.close()


def test_two_chains_sharing_a_prefix_keep_their_own_chunks(tmp_path):
    a_ids, a_pays = block_chain(LAYOUT, 6, seed=1)
    b_ids, b_pays = block_chain(LAYOUT, 6, seed=2)
    s = _store(tmp_path, chunk=64)
    assert s.put_many(a_ids, a_pays) == [True] * 6
    assert s.put_many(b_ids, b_pays) == [True] * 6
    assert _check(s, a_ids, a_pays) == [True] * 6 and _check(s, b_ids, b_pays) == [True] * 6
    s.close()


def test_old_single_block_files_are_not_read_and_evicted_first(tmp_path, caplog):
    ids, pays = block_chain(LAYOUT, 3)
    old = _file(tmp_path, ids[0].hash).with_name(f"{key_hex(ids[0].hash)}.kv")  # format 1 name
    old.parent.mkdir()
    payload = byte_view(pays[0])
    head = encode_header(LAYOUT, ids[0], payload, 4096).replace(b"\xa1v\x02", b"\xa1v\x01", 1)  # "v": 1
    old.write_bytes(head + bytes(payload))
    s = _store(tmp_path)
    assert "old one-block format" in caplog.text
    assert s.contains_many([ids[0].hash]) == [False] and _check(s, ids[:1], pays[:1]) == [False]
    s.close()
    size = payload_offset(LAYOUT, 4096) + LAYOUT.bytes_per_block
    s = _store(tmp_path, size=str(size + 2 * _store(tmp_path).record_size))
    assert s.put_many(ids, pays) == [True] * 3
    assert not old.exists() and _check(s, ids, pays) == [True] * 3
    s.close()


def _drop_write_override_caps() -> None:
    """Root ignores directory permissions (CAP_DAC_OVERRIDE): drop that power in this process so a
    0555 directory really refuses writes, as it would for any other user."""
    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Hdr(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(hdr), data) == 0
    mask = ~((1 << 1) | (1 << 2) | (1 << 3))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
    data[0].effective &= mask
    data[0].permitted &= mask
    assert libc.capset(ctypes.byref(hdr), data) == 0


def _read_only(root: Path, work):
    """`work(root)`'s result, from a forked child that cannot write to `root` (made read-only with
    its subdirectories, the child's root powers over permissions dropped)."""
    dirs = [root, *(p for p in root.iterdir() if p.is_dir())]
    for d in dirs:
        d.chmod(0o555)
    try:
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_read_only_child, args=(str(root), work, child))
        proc.start()
        assert parent.poll(60), "the child died without an answer (its traceback is above)"
        result = parent.recv()
        proc.join(30)
    finally:
        for d in dirs:
            d.chmod(0o755)
    assert not isinstance(result, str), result
    return result


def _read_only_child(root: str, work, conn) -> None:
    _drop_write_override_caps()
    try:
        open(os.path.join(root, "probe"), "w")
        conn.send("fault not real: a write succeeded")
        return
    except PermissionError:
        pass
    conn.send(work(root))


def _puts_and_gets(root: str):
    ids, pays = block_chain(LAYOUT, 6)
    s = _store(root)
    puts = s.put_many(ids[3:], pays[3:])
    gets = _check(s, ids[:3], pays[:3])
    s.close()
    return puts, gets, s.stats()["errors"]["io"], sorted(p.name for p in Path(root).rglob("*"))


def test_read_only_directory_fails_puts_and_still_serves_reads(tmp_path):
    ids, pays = block_chain(LAYOUT, 6)
    s = _store(tmp_path)
    s.put_many(ids[:3], pays[:3])
    s.close()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    puts, gets, io_errors, after = _read_only(tmp_path, _puts_and_gets)
    assert puts == [False] * 3 and gets == [True] * 3 and io_errors >= 1  # blocks 3..5: one chunk object
    assert after == before  # no temp file or half object left behind


def _flood_of_puts(root: str):
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("tierkv").addHandler(handler)
    ids, pays = block_chain(LAYOUT, 60, seed=9)
    s = _store(root)
    puts = [ok for i in range(60) for ok in s.put_many(ids[i : i + 1], pays[i : i + 1])]  # one block a put
    s.close()
    return puts, s.stats()["healthy"], s.stats()["degraded"], lines


def test_a_read_only_directory_logs_a_few_lines_not_one_per_block(tmp_path):
    # A read-only disk logged 129 WARNING lines in 30 s, one per failed put: now the store says once
    # that its writes fail (and is degraded, for /health), and the failures after that are one line
    # per service.WARN_EVERY_S with a count.
    _store(tmp_path).close()
    puts, healthy, degraded, lines = _read_only(tmp_path, _flood_of_puts)
    assert puts == [False] * 60 and not healthy, (puts, healthy)
    assert len(degraded) == 1 and degraded[0].startswith("writes fail (PermissionError"), degraded
    assert len(lines) == 2, lines
    assert "writes fail" in lines[0] and "degraded" in lines[0], lines
    assert "_put_run failed" in lines[1], lines


_WRITER = textwrap.dedent(
    """
    import os, sys, torch
    from services import block_chain
    from tierkv.layout import KVLayout
    from tierkv.tiers.open import open_store
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)
    ids, pays = block_chain(layout, 400, seed=3)
    s = open_store("file://" + sys.argv[1] + "?size=64MiB&threads=4", layout)
    log = open(sys.argv[2], "a")
    for i in range(0, 400, 4):
        ok = s.put_many(ids[i:i + 4], pays[i:i + 4])
        log.write("".join(f"{i + k}\\n" for k, o in enumerate(ok) if o))
        log.flush()
    """
)


def test_sigkill_while_writing_leaves_no_corrupt_block_and_keeps_completed_ones(tmp_path):
    store_dir, done_log = tmp_path / "store", tmp_path / "done.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(store_dir), str(done_log)], env=env)
    end = time.monotonic() + 60
    while time.monotonic() < end and (not done_log.exists() or len(done_log.read_text().split()) < 40):
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    completed = {int(x) for x in done_log.read_text().split()}
    assert 40 <= len(completed) < 400, "the child must be killed mid-run"
    ids, pays = block_chain(LAYOUT, 400, seed=3)
    s = _store(store_dir)
    assert not list(store_dir.rglob("*.tmp")), "temp files of the dead writer must be cleaned at start"
    ok = _check(s, ids, pays)  # asserts every hit is byte-identical
    assert all(ok[i] for i in completed)
    assert sum(s.stats()["errors"].values()) == 0
    s.close()


def _on_disk(root) -> set[str]:
    """The object names (`<32 hex>.c<K>`) of the files under `root`."""
    return {p.name[: -len(".kv")] for p in Path(root).rglob("*.kv")}


def test_a_deleted_directory_is_made_again_and_the_index_forgets_what_went_with_it(tmp_path):
    # An operator's `rm -rf` of the store's directory under a running process: the next writes make
    # the directories again, and the index (the budget, lookups, and the puts it says are done) agrees
    # with what is on disk, not with what was there before.
    root = tmp_path / "store"
    ids, pays = block_chain(LAYOUT, 500, seed=5)
    s = _store(root)
    assert s.put_many(ids[:400], pays[:400]) == [True] * 400
    assert len(_on_disk(root)) == 400
    shutil.rmtree(root)
    # a read that finds the directory gone makes the index forget everything it held there
    assert _check(s, ids[:1], pays[:1]) == [False]
    assert s.stats()["objects"] == 0 and s.contains_many([b.hash for b in ids[:400]]) == [False] * 400
    assert s.put_many(ids[400:], pays[400:]) == [True] * 100
    assert _on_disk(root) == {s.object_name(b.hash) for b in ids[400:]}
    assert _check(s, ids[400:], pays[400:]) == [True] * 100
    st = s.stats()
    assert st["objects"] == 100 and st["used_bytes"] == sum(p.stat().st_size for p in root.rglob("*.kv")), st
    # a put of a block the index knew from before the deletion is written, not taken as done
    assert s.put_many(ids[:1], pays[:1]) == [True]
    assert s.object_name(ids[0].hash) in _on_disk(root) and _check(s, ids[:1], pays[:1]) == [True]
    assert s.stats()["put_failures"] == 0 and s.stats()["errors"]["io"] == 0
    s.close()


def test_a_put_of_an_object_deleted_behind_the_index_is_written_again(tmp_path):
    # One file removed by someone else (another process's eviction, an operator): the index still
    # names it, but a put of its block must write it, not count a block that is not there.
    ids, pays = block_chain(LAYOUT, 3)
    s = _store(tmp_path)
    assert s.put_many(ids, pays) == [True] * 3
    _file(tmp_path, ids[1].hash).unlink()
    assert s.put_many(ids[1:2], pays[1:2]) == [True]
    assert _file(tmp_path, ids[1].hash).exists() and _check(s, ids, pays) == [True] * 3
    assert s.stats()["objects"] == 3
    s.close()


def _store_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("tierkv.tiers") and r.levelno >= logging.WARNING]


def test_misnamed_objects_are_dropped_never_kept_fresh_and_warned_about_at_a_rate(tmp_path, caplog, monkeypatch):
    # An object whose record names another block ("mismatch": a misnamed file, a header byte flipped
    # into another block's token ids) is as useless to every reader as a damaged one: the first read
    # deletes it, so lookups stop finding (and refreshing) it and the next write stores the real block.
    monkeypatch.setattr(service, "WARN_EVERY_S", 0.5)
    n = 40
    ids, pays = block_chain(LAYOUT, n + 1)
    s = _store(tmp_path)
    assert s.put_many(ids, pays) == [True] * (n + 1)
    for b in ids[:n]:
        shutil.copyfile(_file(tmp_path, ids[n].hash), _file(tmp_path, b.hash))  # block n's record, under b's name
    caplog.set_level(logging.WARNING, logger="tierkv")
    for i in range(n):  # one read each: n misses, as many objects dropped, one WARNING line for them all
        assert _check(s, ids[i : i + 1], pays[i : i + 1]) == [False]
    assert s.stats()["errors"]["mismatch"] == n
    assert not any(_file(tmp_path, b.hash).exists() for b in ids[:n])
    assert s.contains_many([b.hash for b in ids]) == [False] * n + [True]
    assert s.stats()["objects"] == 1
    [line] = _store_warnings(caplog)
    assert "header names another block" in line, line
    # once the period is over, the next warning says how many were held back
    time.sleep(0.6)
    shutil.copyfile(_file(tmp_path, ids[n].hash), _file(tmp_path, ids[0].hash))
    assert _check(s, ids[:1], pays[:1]) == [False]
    first, second = _store_warnings(caplog)
    assert f"{n - 1} more" in second, second
    assert s.put_many(ids[:n], pays[:n]) == [True] * n and _check(s, ids, pays) == [True] * (n + 1)
    s.close()
