"""tierkv-serve --profile-dir: POST /start_profile and /stop_profile trace the engine's steps.

A real server (the bundled model) with a profile directory: stopping before starting and starting
twice are refused (409, saying what to call); a request served while profiling leaves a gzipped
Chrome trace whose events include the engine thread's forward and each step as a named range (the
requests it ran, those loading); a directory the server cannot write to is refused before the
model loads; the vllm shim maps VLLM_TORCH_PROFILER_DIR onto the flag. (Without --profile-dir the
routes do not exist: test_server_worker.py.)
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import httpx
import pytest
from server_helpers import serving

from tierkv.server import vllm_shim
from tierkv.server.cli import load_options


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    with serving(["--profile-dir", str(root / "traces"), "--l1", "64MiB"], root / "server.log") as srv:
        yield srv, root / "traces"


def post(server, path: str) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120)


def test_a_profile_of_a_request_is_a_chrome_trace_of_the_engine_steps(profiled):
    server, traces = profiled
    r = post(server, "/stop_profile")
    assert r.status_code == 409 and "POST /start_profile first" in r.json()["error"]["message"]
    assert post(server, "/start_profile").status_code == 200
    again = post(server, "/start_profile")
    assert again.status_code == 409 and "POST /stop_profile first" in again.json()["error"]["message"]
    done = httpx.post(server.url + "/v1/completions", timeout=120,
                      json={"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "prompt": "The cache", "max_tokens": 4})
    assert done.status_code == 200, done.text
    r = post(server, "/stop_profile")
    assert r.status_code == 200, r.text
    trace = Path(r.json()["trace"])
    assert trace.parent == traces and trace.name.endswith(".pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)  # the forward's ops, recorded on the engine thread
    # each step a named range: the request it ran with its new tokens (the prompt, then one), and none loading
    steps = [n for n in names if n.startswith("step: run ")]
    assert steps and all(n.endswith("; loading -; waiting 0") for n in steps), steps
    new_tokens = {int(m) for n in steps for m in re.findall(r"\+(\d+);", n)}
    assert 1 in new_tokens and max(new_tokens) > 1, steps  # decodes, and the prompt's step
    assert post(server, "/start_profile").status_code == 200  # a new session after a stop
    assert post(server, "/stop_profile").status_code == 200
    assert len(list(traces.glob("*.pt.trace.json.gz"))) == 2


def test_the_flag_is_checked_before_the_model_loads(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit):
        load_options(["--profile-dir", str(blocker / "traces")])
    assert "--profile-dir" in capsys.readouterr().err
    monkeypatch.setenv(vllm_shim.PROFILER_ENV, str(tmp_path / "vllm-traces"))
    assert vllm_shim.main(["serve", vllm_shim.DRY_RUN]) == 0
    assert f"--profile-dir {tmp_path / 'vllm-traces'}" in capsys.readouterr().out
