"""The bounds each sweep point is read against, from limits measured in the same run: the pinned
host->device copy (L2 hits cross PCIe), the disk's raw read and write (disk hits, and the blocks
written to the disk tier), and the cold prefill cost
per token and the batch-1 decode step of an isolated cold request (compute). The measuring itself
is benchmarks/limits.py's; this file adds the CPU fallback and the per-request arithmetic, and
never talks to a server.

A point's bound, per request served:
  compute = uncached prompt tokens x cold prefill s/token
            + output tokens x decode step / mean requests decoding (a decode step serves the batch)
  pcie    = bytes L2 gave to L1 (the L2 counter bytes_out) / host->device bandwidth
  disk    = bytes read from the disk (the L3 counter bytes_out) / raw disk read bandwidth
            + bytes written to it (bytes_in) / raw disk write bandwidth (one device does both).
            Beside it, `disk_read_Bps_seen`: the tier's bytes_out over the point's span. Where that
            passes the raw read (an H100 VM at 903fc34: 3.5 GB/s over a point against the probe's
            1.8), the probe is no ceiling for the tier's reads and neither is this term: the
            probe reads one file in 8 MiB requests, the tier many block objects
GPU compute, the copy engine and the disk work side by side, so the request rate cannot pass
1 / max(compute, pcie, disk): that is the bound, and the largest term names what binds.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from limits import disk_bandwidth as raw_disk_bandwidth
from limits import h2d_bandwidth as pinned_h2d_bandwidth

from tierkv.tiers.disk import THREADS as DISK_THREADS

from .presets import GiB

DISK_CHUNK = 8 << 20  # the raw read's request size; the probe reads whole chunks only


def h2d_bandwidth(nbytes: int) -> tuple[float, str]:
    """The L2 -> L1 bound: one pinned host -> GPU copy; on a CPU, a memcpy."""
    import torch

    if torch.cuda.is_available():
        bw = pinned_h2d_bandwidth(nbytes)
        torch.cuda.empty_cache()  # the servers need that device memory more than this process does
        return bw, f"pinned host->device copy of {nbytes / GiB:.2f} GiB"
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * nbytes / (time.perf_counter() - t), f"host memcpy of {nbytes / 2**20:.0f} MiB (no CUDA)"


def disk_bandwidth(directory: Path, nbytes: int) -> tuple[float, float, str]:
    """The disk tier's bound: (read bytes/s, write bytes/s, how) of an nbytes file in `directory`
    (where the L3 lives), written and fsynced, then read from the disk itself (O_DIRECT, or
    buffered after evicting it from the page cache), by as many threads as the tier uses."""
    return raw_disk_bandwidth(directory, nbytes, chunk=DISK_CHUNK, threads=DISK_THREADS)


def point_bound(p: dict, cold: dict, limits: dict) -> dict | None:
    """The bound of one sweep point (module docstring), None where nothing completed or no cold probe."""
    n, cache = p["completed"], p["cache"]
    if not n or not cold.get("s_per_token"):
        return None
    prefill = (p["prompt_tokens"] - p["cached_tokens"]) / n * cold["s_per_token"]
    decode = p["output_tokens"] / n * cold["step_s"] / max(1.0, p["mean_decoding"])
    pcie_bytes = cache["l2"]["bytes_out"] / n if cache else 0.0
    disk_bytes = cache["l3"]["bytes_out"] / n if cache else 0.0
    disk_write_bytes = cache["l3"]["bytes_in"] / n if cache else 0.0
    span = p.get("span_s") or 0.0
    read_seen = cache["l3"]["bytes_out"] / span if cache and span > 0 else 0.0
    read_bps, write_bps = limits["disk_read_bytes_per_s"], limits.get("disk_write_bytes_per_s")
    disk_s = (disk_bytes / read_bps if read_bps else 0.0) + (disk_write_bytes / write_bps if write_bps else 0.0)
    seconds = {"compute": prefill + decode, "pcie": pcie_bytes / limits["h2d_bytes_per_s"], "disk": disk_s}
    binding = max(seconds, key=seconds.get)
    rate = p["throughput"]["requests_per_s"]
    return dict(prefill_s=prefill, decode_s=decode, pcie_bytes=pcie_bytes, disk_bytes=disk_bytes,
                disk_write_bytes=disk_write_bytes, disk_read_Bps_seen=read_seen,
                seconds=seconds, binding=binding,
                requests_per_s=1 / seconds[binding] if seconds[binding] else None,
                served_over_bound=rate * seconds[binding],
                served_over_pcie_bound=rate * seconds["pcie"] if seconds["pcie"] else None)


def recompute_cost(cold: dict, short: dict) -> tuple[float, float] | None:
    """(alpha s/token, beta s/token^2) of a cold prefill of n tokens taking alpha n + beta n^2 / 2
    seconds (the layers' work grows with n, attention's with n^2), from two isolated cold
    probes of different lengths (TTFT and tokens); None where either failed. Noise that makes beta
    negative leaves the longer probe's cost per token, flat."""
    if cold.get("error") or short.get("error") or not cold.get("s_per_token") or not short.get("s_per_token"):
        return None
    (n1, t1), (n2, t2) = sorted(((p["tokens"], p["s_per_token"] * p["tokens"]) for p in (cold, short)))
    beta = 2 * (t2 / n2 - t1 / n1) / (n2 - n1) if n2 > n1 else 0.0
    if beta <= 0:
        return t2 / n2, 0.0
    return t2 / n2 - beta * n2 / 2, beta


def disk_ceiling(tokens: int, alpha: float, beta: float, read_s_per_token: float) -> dict:
    """The most a disk tier can raise goodput over recomputing, where compute binds, for requests
    whose `tokens`-token prefix only the disk holds: read the end of it while the start is
    recomputed, the split where both take the same time (the disk and the GPU work side by side,
    so a request costs the larger of the two), against recomputing all of it. Recomputing the
    start costs C(s) = alpha s + beta s^2 / 2; reading the rest D = read_s_per_token (tokens - s).
    Requests that hit L1 or L2, and the disk's writes, only lower it."""
    n, d = tokens, read_s_per_token

    def cost(m: float) -> float:
        return alpha * m + beta * m * m / 2

    if beta > 0:  # C(s) = D(s): beta/2 s^2 + (alpha + d) s - d n = 0
        s = (math.sqrt((alpha + d) ** 2 + 2 * beta * d * n) - (alpha + d)) / beta
    else:
        s = d * n / (alpha + d)
    return dict(tokens=tokens, recompute_first=s, read_last=n - s, seconds_recompute=cost(n), seconds_split=cost(s),
                goodput_ratio=cost(n) / cost(s), alpha_s_per_token=alpha, beta_s_per_token2=beta,
                read_s_per_token=d)

