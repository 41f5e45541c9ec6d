"""bench_step_graphs --smoke on a CPU: every step is built, launched and timed eagerly, nothing
is graphed (CUDA graphs need a GPU), and the JSON says so step by step."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_step_graphs  # noqa: E402


def test_smoke_times_every_step_eagerly(tmp_path):
    figures = bench_step_graphs.main(["--smoke", "--iters", "2", "--out", str(tmp_path)])
    rows = figures["steps"]
    assert [(r["decodes"], tuple(r["chunks"])) for r in rows] == list(bench_step_graphs.STEPS)
    assert [r["tokens"] for r in rows] == [d + sum(c) for d, c in bench_step_graphs.STEPS]
    assert all(r["eager"]["host_s"] > 0 and r["eager"]["gpu_s"] is None and "graph" not in r for r in rows)
    assert figures["decode_graphs"] == figures["mixed_graphs"] == 0
    written = json.loads(next(tmp_path.glob("bench_step_graphs-*.json")).read_text())
    assert written["steps"] == rows and written["environment"]["python"]
