"""Smoke tests: each example runs as its own process on the CPU and prints what it promises.

The bundled SmolLM2 is converted once per test run (models.bundled_cache_dir) and passed as
--model, so the examples never write into the user's cache dir; short outputs keep them quick.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from models import bundled_cache_dir
from services import unavailable

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir() -> str:
    from tierkv.engine.loader import bundled_model_dir

    return str(bundled_model_dir(bundled_cache_dir()))


def run_example(name: str, *args: str, timeout: float = 150) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=env, check=False,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def ints(pattern: str, text: str) -> list[int]:
    return [int(x) for x in re.findall(pattern, text)]


def test_custom_engine(model_dir):
    out = run_example("custom_engine.py", "--model", model_dir, "--max-new-tokens", "4")
    assert out.count("A: ") == 2
    # the first prompt computes everything; the second finds the shared system prompt's blocks
    assert ints(r"cached tokens (\d+)", out)[0] == 0
    assert ints(r"cached tokens (\d+)", out)[1] >= 48
    prompt, cached, computed = (ints(p, out)[1] for p in (r"prompt (\d+)", r"cached tokens (\d+)", r"computed (\d+)"))
    assert cached + computed == prompt


def test_transformers_offload(model_dir):
    out = run_example("transformers_offload.py", "--model", model_dir, "--max-new-tokens", "4", "--sections", "8")
    assert out.count("same tokens: True") == 2
    assert ints(r"cached tokens (\d+)", out)[0] == 0
    assert ints(r"cached tokens (\d+)", out)[1] >= 224  # the 8-section document, in full 16-token blocks
    assert len(re.findall(r"[\d.]+ tokens/s with tierkv", out)) == 2
    assert ints(r"cache hits: (\d+) tokens", out)[0] == ints(r"cached tokens (\d+)", out)[1]


def test_shared_cache_two_processes(model_dir):
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not installed", "apt-get install -y redis-server")
    out = run_example("shared_cache_two_processes.py", "--model", model_dir, "--max-new-tokens", "3")
    pids = re.findall(r"\[(a|b)\] pid (\d+)", out)
    assert [p[0] for p in pids] == ["a", "b"] and pids[0][1] != pids[1][1]
    assert ints(r"\[a\] first request: .*cached tokens (\d+)", out) == [0]
    # b's very first lookup, before it computes anything, finds the manual in Redis
    found = ints(r"\[b\] first request: .*'l3': (\d+)\}, cached", out)[0]
    assert found >= 96
    assert ints(r"from L3: (\d+)", out)[1] == found


def test_shared_prefix_batch(model_dir):
    out = run_example("shared_prefix_batch.py", "--model", model_dir, "--questions", "3")
    off = re.search(r"prefix caching off: .*cached (\d+) of (\d+) prompt tokens", out)
    on = re.search(r"prefix caching on : .*cached (\d+) of (\d+) prompt tokens", out)
    assert int(off.group(1)) == 0
    # with caching on, every question (the warm-up stored the template) reuses the whole template
    assert int(on.group(1)) >= 3 * 160 and on.group(2) == off.group(2)  # ~500 template tokens each
    assert "same answers: True" in out


def test_long_document_qa_survives_a_restart(model_dir, tmp_path):
    args = ("--model", model_dir, "--disk", str(tmp_path / "disk"), "--max-tokens", "2")
    first = run_example("long_document_qa.py", *args)
    assert ints(r"cached (\d+) \(", first)[0] == 0  # a cold start computes the document
    assert min(ints(r"cached (\d+) \(", first)[1:]) >= 1024  # later questions reuse it from L1
    second = run_example("long_document_qa.py", *args)  # a new process: only the disk remembers
    assert ints(r"l3 (\d+)\)", second)[0] >= 1024
    assert ints(r"cached (\d+) \(", second)[0] >= 1024
