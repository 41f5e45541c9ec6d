"""benchmarks/bench_serving.py: the sweep's search over rates by hand, and the script end to end
on a tiny random Llama whose documents outgrow L1+L2 (so hits come from L1, L2 and the disk),
with a profiled point at the goodput rate. The sweep against an external server is in
test_server.py (it shares that file's server)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_serving  # noqa: E402
from serving.bounds import disk_ceiling, recompute_cost  # noqa: E402
from serving.sweep import next_rate  # noqa: E402
from serving.trace_summary import busy_us, summarize_trace  # noqa: E402


def test_next_rate_doubles_then_bisects_once():
    assert next_rate([], 1.0, bisections=1) == 1.0
    assert next_rate([(1.0, True), (2.0, True)], 1.0, bisections=1) == 4.0
    assert next_rate([(1.0, True), (2.0, True), (4.0, False)], 1.0, bisections=1) == 3.0
    assert next_rate([(1.0, True), (2.0, True), (4.0, False), (3.0, True)], 1.0, bisections=1) is None
    assert next_rate([(1.0, True), (2.0, True), (4.0, False), (3.0, False)], 1.0, bisections=2) == 2.5


def test_next_rate_halves_down_to_a_pass():
    assert next_rate([(4.0, False)], 4.0, bisections=1) == 2.0
    assert next_rate([(4.0, False), (2.0, False)], 4.0, bisections=1) == 1.0
    assert next_rate([(4.0, False), (2.0, False), (1.0, True)], 4.0, bisections=1) == 1.5
    assert next_rate([(4.0, False), (2.0, False), (1.0, True), (1.5, True)], 4.0, bisections=1) is None


def test_busy_time_is_the_union_of_intervals():
    assert busy_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert busy_us([]) == 0


def test_a_trace_summary_lists_the_compute_streams_idle_stretches(tmp_path):
    """A synthetic Chrome trace: the compute stream (stream 7, the most kernels) idles 9 ms while
    the copy stream (13) loads for 8 of them, inside a step whose GPU span says who ran and who
    loaded; a 2 ms idle stretch is too short to list."""
    def ev(name, ts_ms, dur_ms, cat="kernel", stream=7):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3,
                "args": {"stream": stream}}

    label = "step: run 000a+1; loading 000b; waiting 3"
    events = [ev("gemm", 0, 1), ev("gemm", 10, 1), ev("attn", 13, 1), ev("norm", 14, 0.5),
              ev("plane_copy", 1, 8, stream=13), ev(label, 0.5, 12, cat="gpu_user_annotation"),
              ev("step: run 000b+1; loading -; waiting 3", 12.5, 2, cat="user_annotation")]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = summarize_trace(path)
    [gap] = summary["compute_idle_gaps"]
    assert gap["at_ms"] == 1 and gap["gap_ms"] == 9 and gap["other_streams_busy_ms"] == 8
    assert gap["step"] == label
    # idle between kernels: 9 ms (at 1 ms) and 2 ms (at 11 ms), by stretch length
    assert summary["compute_idle_ms"] == {"<0.1": 0.0, "0.1-1": 0.0, "1-5": 2.0, ">=5": 9.0, "total": 11.0}
    # the one GPU step span is a decode step, and copies kept stream 13 busy for 8 of its 12 ms
    assert summary["step_spans"] == {"decode, beside copies": dict(count=1, median_ms=12.0, total_ms=12.0)}


def test_the_hosts_doings_while_the_compute_stream_idles(tmp_path):
    """The compute stream idles 9 ms (1-10) and 0.5 ms (11-11.5); inside the first, the engine
    thread (tid 1) runs an op for 1 ms, a batch copy call and half of a launch; the call in the
    short stretch is not counted; the rest of the 9 ms it is in no traced op or call."""
    def ev(name, ts_ms, dur_ms, cat, **where):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3, **where}

    events = [ev("gemm", t, d, "kernel", args={"stream": 7}) for t, d in ((0, 1), (10, 1), (11.5, 0.5))]
    events += [ev("aten::mm", 2, 1, "cpu_op", tid=1), ev("INVALID", 4, 0.5, "cuda_runtime", tid=1),
               ev("cudaLaunchKernel", 9.5, 1, "cuda_runtime", tid=1),
               ev("cudaEventQuery", 11.1, 0.2, "cuda_runtime", tid=1)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    host = summarize_trace(path)["host_in_compute_gaps"]
    assert host["gaps_ms"] == 9.0 and host["untraced_ms"] == 7.0
    assert host["cuda_calls"] == {"INVALID": dict(count=1, ms=0.5), "cudaLaunchKernel": dict(count=1, ms=0.5)}


def test_a_steps_input_copies_are_timed_apart_beside_a_loads_dma(tmp_path):
    """Stream 7 computes (the most ops); stream 13 runs a 100 MB host->device DMA from 10 to 14 ms.
    The input copy at 2 ms waits 0.5 ms after the kernel before it; the one at 13 ms waits 2 ms
    (queued behind the DMA); a large copy on the compute stream is no step input."""
    def ev(name, ts_ms, dur_ms, cat="kernel", stream=7, nbytes=None):
        args = {"stream": stream} | ({"bytes": nbytes} if nbytes is not None else {})
        return {"ph": "X", "name": name, "cat": cat, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3, "args": args}

    copy = "Memcpy HtoD (Pinned -> Device)"
    events = [ev("gemm", 0, 1.5), ev(copy, 2, 0.01, "gpu_memcpy", nbytes=40), ev("gemm", 3, 8),
              ev(copy, 13, 0.01, "gpu_memcpy", nbytes=40), ev("gemm", 13.5, 1),
              ev(copy, 15, 1, "gpu_memcpy", nbytes=2 << 20), ev("gemm", 16.5, 1),
              ev(copy, 10, 4, "gpu_memcpy", stream=13, nbytes=100 << 20)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    waits = summarize_trace(path)["step_inputs_waits"]
    assert waits.keys() == {"alone", "beside DMA"}
    assert waits["alone"]["count"] == 1 and waits["alone"]["median_us"] == pytest.approx(500)
    assert waits["beside DMA"]["count"] == 1 and waits["beside DMA"]["mean_us"] == pytest.approx(2000)
    assert waits["beside DMA"]["total_ms"] == pytest.approx(2.0)


def test_step_spans_split_decode_from_mixed_and_alone_from_beside_copies(tmp_path):
    def ev(name, ts_ms, dur_ms, cat="gpu_user_annotation", stream=7):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3,
                "args": {"stream": stream}}

    events = [ev("gemm", t, 0.5, cat="kernel") for t in range(0, 40, 1)]
    events += [ev("step: run 0a+1 0b+1; loading -; waiting 0", 0, 9),        # decode, alone
               ev("step: run 0a+1 0b+1; loading 0c; waiting 0", 10, 10),      # decode, copy 4 of 10 ms
               ev("step: run 0a+1 0c+132; loading -; waiting 0", 20, 20),     # mixed, copy 1 of 20 ms
               ev("load", 14, 4, cat="kernel", stream=13), ev("load", 30, 1, cat="kernel", stream=13)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    spans = summarize_trace(path)["step_spans"]
    assert spans == {"decode, alone": dict(count=1, median_ms=9.0, total_ms=9.0),
                     "decode, beside copies": dict(count=1, median_ms=10.0, total_ms=10.0),
                     "mixed, alone": dict(count=1, median_ms=20.0, total_ms=20.0)}


def test_long_doc_sweep_on_l1_l2_disk(tmp_path):
    """One server (l1+l2+disk), two points at rates no CPU misses a 600 s SLO at: every arrival is
    served, the disk and L2 give bytes that the bounds turn into seconds, and the PNG is drawn."""
    [path] = bench_serving.main(["--smoke", "--make-model", "tiny", "--workloads", "long_doc", "--start-rate", "2",
                                 "--point-seconds", "2", "--drain-seconds", "30", "--slo", "600", "--out", str(tmp_path),
                                 "--profile-seconds", "0.5"])
    out = json.loads(path.read_text())
    assert not out["failed_configs"] and list(out["configs"]) == ["l1+l2+disk"]
    assert 3 <= out["sizes"]["kv_over_l1"] <= 5 and out["sizes"]["l2_over_kv"] < 0.5  # documents outgrow L1+L2
    run = out["configs"]["l1+l2+disk"]
    points = run["points"]
    assert [p["offered_rate"] for p in points] == [2.0, 4.0] and run["goodput"]["requests_per_s"] == 4.0
    for p in points:
        assert p["arrivals"] > 0 and p["completed"] == p["arrivals"], p["error_examples"]
    moved = {t: sum(p["cache"][t]["bytes_out"] for p in points) for t in ("l2", "l3")}
    assert moved["l2"] > 0 and moved["l3"] > 0, moved
    assert any(p["bound"]["seconds"]["disk"] > 0 for p in points)
    ceiling = out["ratios"]["disk_ceiling"]  # from this run's two cold probes and disk read bandwidth
    assert ceiling["goodput_ratio"] > 1 and 0 < ceiling["recompute_first"] < ceiling["tokens"]
    assert run["cold_probe_short"]["tokens"] == run["cold_probe"]["tokens"] // 4
    lim = out["limits"]
    assert lim["disk_write_bytes_per_s"] > 0
    for p in points:  # the disk is busy with what the tier writes as well as with what it reads
        l3, n = p["cache"]["l3"], p["completed"]
        assert p["bound"]["seconds"]["disk"] == pytest.approx(
            l3["bytes_out"] / n / lim["disk_read_bytes_per_s"] + l3["bytes_in"] / n / lim["disk_write_bytes_per_s"])
        # and beside it the rate the tier's reads reached over the point (the probe may be no ceiling)
        assert p["bound"]["disk_read_Bps_seen"] == pytest.approx(l3["bytes_out"] / p["span_s"])
    assert any(p["bound"]["disk_read_Bps_seen"] > 0 for p in points)
    assert any(p["cache"]["l3"]["bytes_in"] > 0 for p in points)
    assert all(p["bound"]["seconds"]["pcie"] == p["cache"]["l2"]["bytes_out"] / p["completed"]
               / out["limits"]["h2d_bytes_per_s"] for p in points)
    assert run["prime"]["prompts"] == 8 and run["prime"]["l3_bytes_written"] > 0
    assert path.with_suffix(".png").stat().st_size > 0
    # the profiled point: at the goodput rate, served, its trace next to the JSON and summarised
    prof = run["profile"]
    assert prof["offered_rate"] == 4.0 and prof["point"]["completed"] == prof["point"]["arrivals"] > 0
    assert (tmp_path / prof["trace"]).stat().st_size > 0
    assert prof["summary"]["window_ms"] > 0 and 0 < prof["summary"]["engine_thread_busy_fraction"] <= 1
    assert any(op.startswith("aten::") for op in prof["summary"]["engine_thread_top_cpu_ops_inclusive_ms"])


def test_the_disk_ceiling_balances_the_read_against_the_recompute():
    """Without attention's quadratic term the split gives 1 + alpha / d; with it the start is cheap to
    recompute and the ceiling is the best split a search over every s finds."""
    flat = disk_ceiling(8000, 20e-6, 0.0, 80e-6)
    assert flat["goodput_ratio"] == pytest.approx(1 + 20 / 80)
    assert flat["recompute_first"] == pytest.approx(8000 * 80 / 100)
    alpha, beta, d, n = 21.6e-6, 1.04e-9, 80e-6, 32000
    best = min(max(alpha * s + beta * s * s / 2, d * (n - s)) for s in range(0, n + 1))
    got = disk_ceiling(n, alpha, beta, d)
    assert got["goodput_ratio"] == pytest.approx((alpha * n + beta * n * n / 2) / best, rel=1e-4)
    assert got["seconds_split"] == pytest.approx(d * got["read_last"])  # read and recompute end together


def test_recompute_cost_fits_two_cold_probes():
    alpha, beta = 20e-6, 1e-9

    def probe(n):
        return {"tokens": n, "s_per_token": alpha + beta * n / 2, "error": None}

    assert recompute_cost(probe(32000), probe(8000)) == pytest.approx((alpha, beta))
    # noise that would make attention's share negative leaves a flat cost: the longer probe's
    assert recompute_cost(probe(8000), {"tokens": 2000, "s_per_token": 30e-6, "error": None}) == \
        pytest.approx((probe(8000)["s_per_token"], 0.0))
    assert recompute_cost(probe(8000), {"tokens": 2000, "error": "HTTP 500"}) is None


def test_a_point_lasts_until_its_minimum_of_arrivals_is_expected():
    from serving.session import point_seconds

    a = bench_serving.parse(["--point-seconds", "15", "--min-point-requests", "30"])
    assert point_seconds(a, 0.5) == 60.0  # 30 arrivals at 0.5/s, not the 6 of 15 s
    assert point_seconds(a, 4.0) == 15.0  # 60 arrivals in 15 s already
    assert bench_serving.parse([]).min_point_requests == 30 and bench_serving.parse(["--smoke"]).min_point_requests == 0
    with pytest.raises(SystemExit):
        bench_serving.parse(["--min-point-requests", "-1"])
