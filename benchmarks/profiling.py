"""GPU timelines for benchmarks: run a callable under torch.profiler and say where the time went.

`profile_run` writes a gzipped Chrome trace (open it in Perfetto) and returns a small summary:
wall time, time the GPU spent in kernels (their intervals merged, so overlap is counted once),
the busy fraction, kernel launches, and the kernels that took longest. `StepWindow` does the same
for a window of steps inside a longer run (a server-like steady state rather than a short run of
its own). It measures only what it is given; the benchmark decides what that is.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import time
from pathlib import Path

from serving.trace_summary import busy_us


def profile_run(fn, trace_path: Path | None, top: int = 12) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return summarise(prof, wall, trace_path, top)


class StepWindow:
    """Profile `count` steps of a longer run, starting at step `first`: call `step()` after each
    step is launched. The window opens and closes on a synchronised device, so its wall time
    holds exactly those steps' host and GPU work; `summary` is profile_run's, or None if the run
    ended before the window closed."""

    def __init__(self, first: int, count: int, trace_path: Path | None, top: int = 12) -> None:
        self.first, self.count, self.trace_path, self.top = first, count, trace_path, top
        self.seen, self.prof, self.t0, self.summary = 0, None, 0.0, None

    def step(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.seen += 1
        if self.seen == self.first:
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.prof is not None and self.seen == self.first + self.count:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self.summary, self.prof = summarise(self.prof, wall, self.trace_path, self.top), None
            self.summary["steps"] = self.count


def summarise(prof, wall: float, trace_path: Path | None, top: int = 12) -> dict:
    """A finished profiler's kernels over `wall` seconds: busy time (intervals merged), the top
    kernels, and the gzipped Chrome trace written to trace_path."""
    import torch

    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = busy_us((e.time_range.start, e.time_range.end) for e in kernels)  # microseconds, overlap once
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
    return dict(wall_s=wall, gpu_kernel_s=busy / 1e6, gpu_busy_fraction=busy / 1e6 / wall,
                kernel_launches=len(kernels),
                top_kernels=[dict(name=n, ms=t / 1e3, count=c) for n, (t, c) in ranked],
                trace=str(trace_path.name) if trace_path is not None else None)


def print_profile(summary: dict, label: str) -> None:
    print(f"profile of {label}: wall {summary['wall_s'] * 1e3:.1f} ms, GPU kernels {summary['gpu_kernel_s'] * 1e3:.1f} ms "
          f"({summary['gpu_busy_fraction']:.0%} busy), {summary['kernel_launches']} kernels", flush=True)
    for k in summary["top_kernels"]:
        print(f"  {k['ms']:9.2f} ms {k['count']:6d}x  {k['name']}")
