"""Where a profiled server's time went: a summary of a torch.profiler Chrome trace (tierkv-serve's
/stop_profile writes one). Per CUDA stream, the share of the traced window its kernels and copies
kept it busy; the whole GPU's busy share (any stream); the kernels and copies that took the most
GPU time; the compute stream's idle time by stretch length and its longest idle stretches, with
what the other streams did meanwhile and the engine's step in flight (its label: the requests it
ran, those loading); the steps' GPU spans by kind (decode or mixed) and by whether a copy ran
beside them (do loads slow the steps they overlap?); and on the
busiest CPU thread (the engine's) the share of the window it spent inside ops and the ops that
took longest (inclusive: an op's time counts in its callers too), and what it did while the
compute stream idled: the CUDA calls it made then (torch's profiler names calls it does not
know "INVALID": cudaMemcpyBatchAsync on torch 2.11) and the time it spent in no traced op or
call (Python: the scheduler, the cache, ctypes); and how long the compute stream's small host->device
copies (a step's inputs) waited to start, apart for those that came while a bulk host->device copy
(an L2 load's DMA) ran on another stream: the copy engines serve them in turn. It reads a
trace file (`keep_trace` copies one out of the server's folder first) and never talks to a server.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter, defaultdict
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
TOP = 12
GAP_MS = 5.0  # a compute-stream idle stretch worth listing: most of a decode step
GAP_BUCKETS_MS = (0.1, 1.0, GAP_MS)  # idle stretches summed by length: launch gaps .. waits for the host
BESIDE = 0.25  # a step ran beside copies when other streams were busy for this share of its GPU span
HOST_GAP_MS = 1.0  # compute-stream idle stretches this long or longer: the host's doings in them
BULK_BYTES = 1 << 20  # a host->device copy this large or larger is a load's DMA, not a step's input
CUDA_CALLS = ("cuda_runtime", "cuda_driver")


def union(intervals) -> list[list[float]]:
    """The union of (start, end) intervals as disjoint [start, end] runs, in order."""
    runs: list[list[float]] = []
    for a, b in sorted(intervals):
        if runs and a <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    return runs


def busy_us(intervals) -> float:
    """Microseconds covered by the union of (start, end) intervals."""
    return sum(b - a for a, b in union(intervals))


def summarize_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    cpu = [e for e in events if e.get("cat") == "cpu_op"]
    if not events:
        return dict(window_ms=0.0)
    start = min(e["ts"] for e in events)
    window = max(e["ts"] + e["dur"] for e in events) - start
    streams: dict[str, list] = defaultdict(list)
    for e in gpu:
        streams[stream_of(e)].append((e["ts"], e["ts"] + e["dur"]))
    by_name: Counter = Counter()
    for e in gpu:
        by_name[e["name"][:100]] += e["dur"]
    threads = Counter(e["tid"] for e in cpu)
    engine_tid = threads.most_common(1)[0][0] if threads else None
    engine = [e for e in cpu if e["tid"] == engine_tid]
    ops: Counter = Counter()
    for e in engine:
        ops[e["name"][:100]] += e["dur"]
    steps = [e for e in events if e.get("name", "").startswith("step: ")]
    compute_name = compute_stream(streams) if streams else None
    compute, others = split_streams(streams, compute_name)
    engine_calls = [e for e in events if e.get("tid") == engine_tid and e.get("cat") in ("cpu_op", *CUDA_CALLS)]
    return dict(
        window_ms=window / 1e3,
        compute_idle_ms=idle_by_length(compute) if compute else {},
        compute_idle_gaps=idle_gaps(compute, others, steps, start) if compute else [],
        step_spans=step_spans(others, steps) if compute else {},
        host_in_compute_gaps=host_in_gaps(compute, engine_calls) if compute else {},
        step_inputs_waits=input_waits(gpu, compute_name) if streams else {},
        gpu_busy_fraction=busy_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) / window,
        stream_busy_fraction={s: busy_us(iv) / window for s, iv in sorted(streams.items())},
        top_gpu_ms={n: d / 1e3 for n, d in by_name.most_common(TOP)},
        # the engine thread inside any op: near 1 with the GPU idle means the host is what binds
        engine_thread_busy_fraction=busy_us([(e["ts"], e["ts"] + e["dur"]) for e in engine]) / window,
        engine_thread_top_cpu_ops_inclusive_ms={n: d / 1e3 for n, d in ops.most_common(TOP)},
    )


def split_streams(streams: dict[str, list], compute: str | None) -> tuple[list[list[float]], list[list[float]]]:
    """(the `compute` stream's busy runs, the other streams' together), each disjoint and in order."""
    if not streams:
        return [], []
    return union(streams[compute]), union(iv for s, ivs in streams.items() if s != compute for iv in ivs)


def stream_of(event: dict) -> str:
    """The CUDA stream a GPU event ran on, as the trace names it (its thread where it names none)."""
    return str(event.get("args", {}).get("stream", event.get("tid")))


def compute_stream(streams: dict[str, list]) -> str:
    """The compute stream: the one with the most kernels (copies launch few, large ones)."""
    return max(streams, key=lambda s: len(streams[s]))


def busy_within(runs: list[list[float]], a: float, b: float) -> float:
    """Microseconds of the disjoint `runs` inside [a, b)."""
    return sum(min(y, b) - max(x, a) for x, y in runs if x < b and y > a)


def idle_by_length(compute: list[list[float]]) -> dict[str, float]:
    """The compute stream's idle time between its first and last kernel (`compute`: its busy runs),
    in milliseconds, summed by stretch length (GAP_BUCKETS_MS): many short gaps are the host
    launching, long ones a wait."""
    edges = (0.0, *GAP_BUCKETS_MS, float("inf"))
    names = [f"<{hi:g}" if lo == 0 else f">={lo:g}" if hi == float("inf") else f"{lo:g}-{hi:g}"
             for lo, hi in zip(edges, edges[1:])]
    out = dict.fromkeys(names, 0.0)
    for (_, b0), (a1, _) in zip(compute, compute[1:]):
        gap_ms = (a1 - b0) / 1e3
        out[next(n for n, hi in zip(names, edges[1:]) if gap_ms < hi)] += gap_ms
    out["total"] = sum(out.values())
    return out


def step_kind(label: str) -> str:
    """'decode' where every request of the step ran one token ('step: run 0a1b2c+1 ...'), else 'mixed'."""
    runs = label.removeprefix("step: run ").split(";")[0].split()
    return "decode" if runs and all(r.endswith("+1") for r in runs) else "mixed"


def step_spans(others: list[list[float]], steps: list[dict]) -> dict[str, dict]:
    """The steps' GPU spans ('step: ...' gpu_user_annotation ranges) by kind, split by whether the
    other streams (`others`: their busy runs; loads, saves) were busy for at least BESIDE of the
    span: count, median and total milliseconds. A decode step slower beside copies than alone is
    one they slow down."""
    groups: dict[str, list[float]] = defaultdict(list)
    for e in steps:
        if e.get("cat") != "gpu_user_annotation":
            continue
        overlap = busy_within(others, e["ts"], e["ts"] + e["dur"])
        beside = "beside copies" if e["dur"] and overlap >= BESIDE * e["dur"] else "alone"
        groups[f"{step_kind(e['name'])}, {beside}"].append(e["dur"] / 1e3)
    return {k: dict(count=len(v), median_ms=sorted(v)[len(v) // 2], total_ms=sum(v))
            for k, v in sorted(groups.items())}


def idle_gaps(compute: list[list[float]], others: list[list[float]], steps: list[dict], start: float,
              min_ms: float = GAP_MS) -> list[dict]:
    """The longest stretches (>= min_ms, at most TOP) between the compute stream's busy runs
    (`compute`): where each began (ms into the window), how long it lasted, how busy the other
    streams (`others`: loads, saves) were meanwhile, and the engine's step label in flight (the
    GPU span of a 'step: ...' range holding the gap's start, as Engine.label_steps names them; the
    last one begun on the host before it otherwise)."""
    gaps = sorted(((b0, a1) for (_, b0), (a1, _) in zip(compute, compute[1:]) if a1 - b0 >= min_ms * 1e3),
                  key=lambda g: g[0] - g[1])[:TOP]
    out = []
    for a, b in gaps:
        holding = [e for e in steps if e["ts"] <= a < e["ts"] + e["dur"] and e.get("cat") == "gpu_user_annotation"]
        begun = [e for e in steps if e["ts"] <= a and e.get("cat") != "gpu_user_annotation"]
        label = holding[-1]["name"] if holding else max(begun, key=lambda e: e["ts"])["name"] if begun else None
        out.append(dict(at_ms=(a - start) / 1e3, gap_ms=(b - a) / 1e3,
                        other_streams_busy_ms=busy_within(others, a, b) / 1e3, step=label))
    return out


def host_in_gaps(compute: list[list[float]], engine: list[dict]) -> dict:
    """What the engine thread (`engine`: its cpu ops and CUDA calls) did while the compute stream
    (`compute`: its busy runs) idled for HOST_GAP_MS or more: those stretches' total, the CUDA
    calls inside them by name (count, milliseconds inside the stretches), and the milliseconds the
    thread spent in no traced op or call (its Python). A host that keeps the GPU waiting shows here."""
    gaps = [(b0, a1) for (_, b0), (a1, _) in zip(compute, compute[1:]) if a1 - b0 >= HOST_GAP_MS * 1e3]
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in engine:
        if e.get("cat") not in CUDA_CALLS:
            continue
        inside = sum(busy_within([[e["ts"], e["ts"] + e["dur"]]], a, b) for a, b in gaps)
        if inside > 0:
            calls[e["name"]][0] += 1
            calls[e["name"]][1] += inside / 1e3
    traced = union((e["ts"], e["ts"] + e["dur"]) for e in engine)
    gap_us = sum(b - a for a, b in gaps)
    longest = sorted(calls.items(), key=lambda kv: -kv[1][1])[:TOP]
    return dict(gaps_ms=gap_us / 1e3,
                untraced_ms=(gap_us - sum(busy_within(traced, a, b) for a, b in gaps)) / 1e3,
                cuda_calls={n: dict(count=c, ms=ms) for n, (c, ms) in longest})


def input_waits(gpu: list[dict], compute: str) -> dict:
    """The `compute` stream's small host->device copies (a step's inputs, under BULK_BYTES): how long
    each waited after the op before it on that stream ended, for those that started while a bulk
    one (a load's DMA) ran on another stream ("beside DMA") and for the rest ("alone"). A copy
    queued behind a DMA on the copy engines starts late, and the step waits with it."""
    def h2d(e):
        return e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]

    def nbytes(e):
        return e.get("args", {}).get("bytes", 0)
    bulk = union((e["ts"], e["ts"] + e["dur"]) for e in gpu if h2d(e) and stream_of(e) != compute
                 and nbytes(e) >= BULK_BYTES)
    ops = sorted((e for e in gpu if stream_of(e) == compute), key=lambda e: e["ts"])
    waits: dict[str, list[float]] = {"beside DMA": [], "alone": []}
    for before, e in zip(ops, ops[1:]):
        if h2d(e) and nbytes(e) < BULK_BYTES:
            beside = any(a <= e["ts"] < b for a, b in bulk)
            waits["beside DMA" if beside else "alone"].append(max(0.0, e["ts"] - before["ts"] - before["dur"]))
    return {k: dict(count=len(v), median_us=sorted(v)[len(v) // 2], mean_us=sum(v) / len(v), total_ms=sum(v) / 1e3)
            for k, v in waits.items() if v}


def keep_trace(trace: Path | str, trace_to: Path) -> dict:
    """What `profile_server` answered, kept: the trace copied to `trace_to` (a server started by
    the benchmark writes where it can read) and its summary; {"error": ...} where none was taken."""
    if isinstance(trace, str):
        return dict(error=trace)
    shutil.copyfile(trace, trace_to)
    return dict(trace=trace_to.name, summary=summarize_trace(trace_to))
