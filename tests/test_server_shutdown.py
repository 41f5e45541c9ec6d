"""tierkv-serve's drain on SIGTERM when one engine step lasts longer than the grace period (issue 37 item 5).

The server's own cut ran only between engine steps, so with a CPU step longer than the grace the
requests in flight waited for the step, and uvicorn's own deadline cancelled them first: a plain
500 and CancelledError tracebacks. Here a 1500-token prompt makes one prefill step of several
seconds while the grace is 1 s: every request must end at the deadline with the documented error
(an SSE error event, or a 503 before any header), and the process must exit within the grace and
the flush timeout (0.5 s: the step outlasts it, and is left behind). The bundled SmolLM2 on the CPU; one server, started for the test.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
from server_helpers import ServerProcess
from tierkv.server.async_engine import CLOSE_S

MODEL = "smol"
GRACE_S = 1.0
FLUSH_S = 0.5
CUT_BOUND_S = GRACE_S + 2.0  # from SIGTERM to a request's last byte: the deadline, and CI's slowness
WORDS = ("cache", "block", "token", "prefix", "router", "replica", "memory", "tier", "host", "disk")


def long_prompt(seed: int, words: int = 1500) -> str:
    """1500 tokens that no other prompt shares (one word a token): one prefill step of them all."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def test_requests_in_flight_when_a_step_outlasts_the_grace_end_cleanly_at_the_deadline(tmp_path):
    srv = ServerProcess(["--served-model-name", MODEL, "--l1", "160MiB", "--max-model-len", "2048",
                         "--max-num-batched-tokens", "1600", "--grace-period", str(GRACE_S),
                         "--flush-timeout", str(FLUSH_S)], tmp_path / "server.log")
    ended: dict[str, tuple[float, int, list[str]]] = {}  # name -> (when, status, SSE data lines or the body)
    started = {name: threading.Event() for name in ("decoding", "long")}

    def stream(name: str, prompt: str, max_tokens: int) -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "stream": True}) as r:
            started[name].set()  # its headers: the request is in the engine
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        ended[name] = (time.monotonic(), r.status_code, lines)

    def plain(name: str, prompt: str, max_tokens: int) -> None:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens})
        ended[name] = (time.monotonic(), r.status_code, [r.text])

    try:
        srv.wait_ready()
        clients = [threading.Thread(target=stream, args=("decoding", "Once upon a time", 400)),
                   threading.Thread(target=plain, args=("plain", "Tell me a story", 400))]
        for c in clients:
            c.start()
        assert started["decoding"].wait(60)
        time.sleep(1.0)  # both decode now
        clients.append(threading.Thread(target=stream, args=("long", long_prompt(1), 8)))
        clients[-1].start()
        assert started["long"].wait(60)
        # its prefill is the engine's next step: a request that comes now waits for that step to end
        clients.append(threading.Thread(target=plain, args=("queued", "Hello", 4)))
        clients[-1].start()
        time.sleep(0.3)
        sigterm = time.monotonic()
        srv.terminate()
        for c in clients:
            c.join(120)
        code = srv.proc.wait(60)
        exited = time.monotonic() - sigterm
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    for name, (when, status, lines) in ended.items():
        assert when - sigterm < CUT_BOUND_S, (name, when - sigterm, status, lines[-2:])
        if name in ("decoding", "long"):  # SSE: an error event, then [DONE]
            assert status == 200 and lines[-1] == "data: [DONE]", (name, lines[-3:])
            assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down", (name, lines[-2])
        else:  # before any header: 503 in OpenAI's shape
            assert status == 503 and json.loads(lines[0])["error"]["code"] == "shutting_down", (name, lines)
    # the long prompt's step was longer than the grace: not one token of it came before the cut
    assert not [line for line in ended["long"][2] if '"text"' in line]
    # the shutdown waited for the step in flight no longer than --flush-timeout (and a second to close),
    # and the process exited cleanly with the step still running
    assert code == 0 and exited < GRACE_S + FLUSH_S + CLOSE_S + 1.5, (code, exited, log[-3000:])
    assert "the engine was still in a step" in log
    assert "Traceback" not in log and "CancelledError" not in log and "timeout graceful shutdown" not in log
    assert '" 500' not in log


def test_the_process_exits_right_after_its_stopped_line(tmp_path):
    # Collecting the heap of a loaded model at interpreter exit took 2 s here (6-15 s in the
    # issue's runs) after the server had logged "stopped": time a supervisor counts against the
    # grace period. The server freezes that heap out of the collector's sight.
    srv = ServerProcess(["--served-model-name", MODEL, "--l1", "64MiB"], tmp_path / "server.log")
    try:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200
        srv.terminate()
        end = time.monotonic() + 60
        while "tierkv.serve: stopped" not in srv.log() and time.monotonic() < end:
            time.sleep(0.02)
        stopped = time.monotonic()
        code = srv.proc.wait(60)
        after = time.monotonic() - stopped
    finally:
        srv.stop()
    assert code == 0 and after < 1.0, (code, after)
