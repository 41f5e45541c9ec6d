"""GPU timelines for benchmarks: run a callable under torch.profiler and say where the time went.

`profile_run` writes a gzipped Chrome trace (open it in Perfetto) and returns a small summary:
wall time, time the GPU spent in kernels (their intervals merged, so overlap is counted once),
the busy fraction, kernel launches, and the kernels that took longest. It measures only what it
is given; the benchmark decides what that is.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import time
from pathlib import Path


def profile_run(fn, trace_path: Path | None, top: int = 12) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)  # microseconds
    busy, end = 0.0, float("-inf")
    for s, e in spans:  # union of intervals
        if e > end:
            busy += e - max(s, end)
            end = e
    totals: dict[str, list[float]] = {}
    for e in kernels:
        t = totals.setdefault(e.name[:90], [0.0, 0])
        t[0] += e.time_range.end - e.time_range.start
        t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    if trace_path is not None:
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return dict(wall_s=wall, gpu_kernel_s=busy / 1e6, gpu_busy_fraction=busy / 1e6 / wall, kernel_launches=len(kernels),
                top_kernels=[dict(name=n, ms=t / 1e3, count=c) for n, (t, c) in ranked],
                trace=str(trace_path.name) if trace_path is not None else None)


def print_profile(summary: dict, label: str) -> None:
    print(f"profile of {label}: wall {summary['wall_s'] * 1e3:.1f} ms, GPU kernels {summary['gpu_kernel_s'] * 1e3:.1f} ms "
          f"({summary['gpu_busy_fraction']:.0%} busy), {summary['kernel_launches']} kernels", flush=True)
    for k in summary["top_kernels"]:
        print(f"  {k['ms']:9.2f} ms {k['count']:6d}x  {k['name']}")
