"""bench_tiers: L3 stores vs physical limits measured in the same run (CPU only).

Disk: put_many/get_many of N blocks vs raw sequential write(+fsync)/read of the same bytes as one
file, rounds interleaved (raw, tier, raw, tier...) because shared disks drift; the figure is the
median of per-round ratios. The store runs with one block per object (the default) and with chunk
objects of 256 tokens (`?chunk=256`), each also with O_DIRECT. The
page cache is dropped before every read with posix_fadvise(DONTNEED) on each file read (raw file
and every object file), so reads hit the disk.
Redis (one server, and a 3-node Redis Cluster) and S3 (SeaweedFS) run on loopback, started here;
for them GB/s and the latency of one contains_many of a 64-block chain (median of 50): all of it
stored, none of it, and its first 37 blocks (S3 probes for where the run ends). Writes
benchmarks/results/bench_tiers-<h200|cpu>.json (common.machine_tag).
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the same service launchers the tests use
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine_tag  # noqa: E402
from shapes import LLAMA_3_1_8B, SMOLLM2_135M  # noqa: E402

from tierkv.layout import KVLayout  # noqa: E402
from services import RedisClusterNodes, RedisServer, SeaweedFS, block_chain  # noqa: E402

from tierkv.tiers.open import open_store  # noqa: E402

LAYOUTS = {
    "llama3.1-8b": LLAMA_3_1_8B,
    "smollm2-135m": SMOLLM2_135M,
}


def _page_aligned_bytes(n: int) -> torch.Tensor:
    """n bytes of page-aligned memory, like a pinned L2 pool (O_DIRECT needs the alignment)."""
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_round(path: Path, pool: torch.Tensor) -> tuple[float, float]:
    """Seconds to write(+fsync) then read `pool` as one sequential file, in 8 MiB calls."""
    view = memoryview(pool.numpy()).cast("B")
    chunk = 8 << 20
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for off in range(0, len(view), chunk):
        os.write(fd, view[off : off + chunk])
    os.fsync(fd)
    os.close(fd)
    t_write = time.perf_counter() - t0
    _drop_cache(path)
    out = memoryview(bytearray(len(view)))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    for off in range(0, len(view), chunk):
        os.preadv(fd, [out[off : off + chunk]], off)
    os.close(fd)
    t_read = time.perf_counter() - t0
    os.unlink(path)
    return t_write, t_read


def _tier_round(url: str, layout: KVLayout, ids, pool: torch.Tensor, directory: Path | None) -> tuple[float, float, dict]:
    store = open_store(url, layout)
    blocks = list(pool.view(layout.dtype).view(len(ids), *layout.block_shape))
    t0 = time.perf_counter()
    ok = store.put_many(ids, blocks)
    t_write = time.perf_counter() - t0
    assert all(ok), store.stats()
    if directory is not None:
        for f in directory.rglob("*.kv"):
            _drop_cache(f)
    outs = _page_aligned_bytes(pool.numel())
    out_blocks = list(outs.view(layout.dtype).view(len(ids), *layout.block_shape))
    t0 = time.perf_counter()
    ok = store.get_many(ids, out_blocks)
    t_read = time.perf_counter() - t0
    assert all(ok) and torch.equal(outs, pool), store.stats()
    stats = store.stats()
    store.close()
    return t_write, t_read, stats


# (tag, URL options): one block per object (the default) and 256-token chunk objects, each with and
# without O_DIRECT
DISK_VARIANTS = (("tier", ""), ("tier_direct", "&direct=1"), ("chunked", "&chunk=256"),
                 ("chunked_direct", "&chunk=256&direct=1"))


def bench_disk(layout: KVLayout, nbytes: int, rounds: int, scratch: Path) -> dict:
    n = max(4, nbytes // layout.bytes_per_block)
    ids, _ = block_chain(layout, n, seed=1)
    pool = _page_aligned_bytes(n * layout.bytes_per_block)
    pool.copy_(torch.randint(0, 256, (n * layout.bytes_per_block,), dtype=torch.uint8))
    total = n * layout.bytes_per_block
    rows = []
    for r in range(rounds):
        raw_w, raw_r = _raw_round(scratch / "raw.bin", pool)
        row = {"raw_write_GBps": total / raw_w / 1e9, "raw_read_GBps": total / raw_r / 1e9}
        for tag, opt in DISK_VARIANTS:
            d = scratch / f"store{r}{tag}"
            tier_w, tier_r, _ = _tier_round(f"file://{d}?size={2 * total}{opt}", layout, ids, pool, d)
            shutil.rmtree(d)
            row.update({f"{tag}_write_GBps": total / tier_w / 1e9, f"{tag}_read_GBps": total / tier_r / 1e9,
                        f"{tag}_write_ratio": raw_w / tier_w, f"{tag}_read_ratio": raw_r / tier_r})
        rows.append(row)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {"blocks": n, "bytes": total, "rounds": rows, "median": med}


def _lookup_latency(store, ids, repeats: int = 50) -> float:
    chain = [b.hash for b in ids[:64]]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        store.contains_many(chain)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_service(url: str, layout: KVLayout, nbytes: int, rounds: int) -> dict:
    n = max(64, nbytes // layout.bytes_per_block)
    ids, _ = block_chain(layout, n, seed=2)
    pool = _page_aligned_bytes(n * layout.bytes_per_block)
    pool.copy_(torch.randint(0, 256, (n * layout.bytes_per_block,), dtype=torch.uint8))
    total = n * layout.bytes_per_block
    rows = []
    for _ in range(rounds):
        t_w, t_r, stats = _tier_round(url, layout, ids, pool, None)
        rows.append({"write_GBps": total / t_w / 1e9, "read_GBps": total / t_r / 1e9})
    store = open_store(url, layout)
    hit = _lookup_latency(store, ids)
    miss_ids, miss_pays = block_chain(layout, 64, seed=99)
    miss = _lookup_latency(store, miss_ids)
    # a run that ends inside the 64 (S3 probes for its end in more than one round)
    store.put_many(miss_ids[:37], miss_pays[:37])
    partial = _lookup_latency(store, miss_ids)
    store.close()
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {"blocks": n, "bytes": total, "rounds": rows, "median": med,
            "lookup64_hit_ms": hit * 1e3, "lookup64_miss_ms": miss * 1e3, "lookup64_37_ms": partial * 1e3}


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except Exception:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--disk-mib", type=int, default=1024, help="bytes per disk round")
    ap.add_argument("--service-mib", type=int, default=256, help="bytes per Redis/S3 round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scratch", default=None, help="directory on the disk to measure (default: system temp)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--no-services", action="store_true", help="disk only")
    ap.add_argument("--stores", default="disk,redis,redis_cluster,s3",
                    help="comma-separated subset of disk,redis,redis_cluster,s3 to measure")
    args = ap.parse_args()
    stores = set(args.stores.split(",")) - ({"redis", "redis_cluster", "s3"} if args.no_services else set())

    work = Path(tempfile.mkdtemp(prefix="bench_tiers-", dir=args.scratch))
    result: dict = {"disk": {}, "redis": {}, "redis_cluster": {}, "s3": {}, "s3_chunked": {}}
    try:
        for name, layout in LAYOUTS.items():
            if "disk" in stores:
                result["disk"][name] = bench_disk(layout, args.disk_mib << 20, args.rounds, work)
        if "redis" in stores:
            redis = RedisServer(work)
            if redis.binary and redis.start():
                for name, layout in LAYOUTS.items():
                    result["redis"][name] = bench_service(redis.url, layout, args.service_mib << 20, args.rounds)
            redis.kill()
        if "redis_cluster" in stores:
            cluster = RedisClusterNodes(work / "cluster")
            if cluster.binary and cluster.start():
                for name, layout in LAYOUTS.items():
                    result["redis_cluster"][name] = bench_service(cluster.url, layout, args.service_mib << 20,
                                                                  args.rounds)
            cluster.kill()
        if "s3" in stores:
            os.environ.update(AWS_ACCESS_KEY_ID="tierkv-test-key", AWS_SECRET_ACCESS_KEY="tierkv-test-secret")
            sw = SeaweedFS(work / "sw")
            if sw.binary and sw.start():
                for name, layout in LAYOUTS.items():
                    bucket = f"bench-{name.replace('.', '-')}"
                    result["s3"][name] = bench_service(sw.url(bucket), layout, args.service_mib << 20, args.rounds)
                    result["s3_chunked"][name] = bench_service(sw.url(bucket + "-c", chunk="256"), layout,
                                                               args.service_mib << 20, args.rounds)
                sw.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'store':<9} {'layout':<14} {'write GB/s':>10} {'read GB/s':>10} {'raw w':>7} {'raw r':>7} "
          f"{'w ratio':>8} {'r ratio':>8} {'lookup64 hit/miss/37 ms':>24}")
    for name, d in result["disk"].items():
        m = d["median"]
        for tag, _ in DISK_VARIANTS:
            label = {"tier": "disk", "tier_direct": "disk+od", "chunked": "disk-c", "chunked_direct": "disk-c+od"}[tag]
            print(f"{label:<9} {name:<14} {m[tag + '_write_GBps']:>10.3f} {m[tag + '_read_GBps']:>10.3f} "
                  f"{m['raw_write_GBps']:>7.3f} {m['raw_read_GBps']:>7.3f} {m[tag + '_write_ratio']:>8.0%} "
                  f"{m[tag + '_read_ratio']:>8.0%}")
    for store, label in (("redis", "redis"), ("redis_cluster", "cluster"), ("s3", "s3"), ("s3_chunked", "s3-c")):
        for name, d in result[store].items():
            m = d["median"]
            print(f"{label:<9} {name:<14} {m['write_GBps']:>10.3f} {m['read_GBps']:>10.3f} {'':>7} {'':>7} {'':>8} {'':>8} "
                  f"{d['lookup64_hit_ms']:>10.2f}/{d['lookup64_miss_ms']:.2f}/{d['lookup64_37_ms']:.2f}")

    def _package(name: str) -> str:  # --no-services runs where the service clients are not installed
        try:
            return __import__(name).__version__
        except ImportError:
            return "not installed"

    machine = platform.node() or "unknown"
    meta = {
        "machine": machine, "cpus": os.cpu_count(), "platform": platform.platform(),
        "load_average": os.getloadavg(),  # loopback services share the CPUs: others' load shows in the figures
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": os.environ.get("TIERKV_COMMIT") or _version(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "boto3": _package("boto3"),
                     "redis-py": _package("redis"), "redis-server": _version(["redis-server", "--version"]),
                     "seaweedfs": _version(["weed", "version"])},
        "method": "disk: median over interleaved rounds of raw/tier; page cache dropped before reads with "
                  "posix_fadvise(DONTNEED) per file; raw = one file, 8 MiB write() calls + fsync, 8 MiB preadv; "
                  "tier = put_many/get_many of all blocks (one object per block, fdatasync per object file), tier_direct = the same with "
                  "?direct=1 (O_DIRECT), chunked(_direct) = the same with ?chunk=256 (256-token chunk objects); buffers "
                  "page-aligned (mmap) like a pinned L2 pool. Redis/S3 on loopback (s3_chunked: ?chunk=256); "
                  "redis_cluster = 3 primaries, no replicas, on loopback (redis+cluster:// URL). "
                  "lookup64_hit/miss/37_ms: median of 50 contains_many of a 64-block chain, all, none or "
                  "the first 37 blocks stored; services share the machine's CPUs with this process.",
        "layouts": {k: {"fingerprint": v.fingerprint, "bytes_per_block": v.bytes_per_block} for k, v in LAYOUTS.items()},
        "args": vars(args),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_tiers-{machine_tag()}.json"  # h200 on the GPU box, cpu elsewhere
    path.write_text(json.dumps({**meta, **result}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
