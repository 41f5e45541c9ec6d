"""Helpers for the server tests: run `tierkv-serve` (or another OpenAI server) as a real process on a free loopback port, talk
raw HTTP to it, read its memory.

The server's output goes to a log file that tests read (for the secrets check). Processes are
stopped by their own pid only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

READY_TIMEOUT_S = 240.0  # model load on a busy 2-core CI box


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None,
                 command: tuple[str, ...] = ("-m", "tierkv.server.cli"), port: int | None = None,
                 python: str = sys.executable) -> None:
        """`command`: what follows the Python interpreter, before `--port` (e.g. the vllm shim's
        `-m tierkv.server.vllm_shim serve`); `port`: a given one (default: a free one); `python`:
        another interpreter (vLLM's venv)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [python, *command, "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tierkv-serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"tierkv-serve not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def serving(args: list[str], log_path: Path, env: dict | None = None, **kw):
    """A ready ServerProcess; stopped at the end, and it must have exited 0 (a clean drain)."""
    srv = ServerProcess(args, log_path, env, **kw)
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.log()


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh loopback connection and read until the server closes it (or
    `timeout`): for requests no HTTP client would send."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:  # the server may answer and close before taking it all
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def raw_json(response: bytes) -> tuple[int, dict]:
    """Status and JSON body of one raw HTTP/1.1 response."""
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text output (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def scrape(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=30).text


def settled(server) -> str:
    """/metrics once nothing runs and the engine thread's stats snapshot (refreshed every quarter
    second) has caught up: two scrapes a little apart agree."""
    end, last = time.monotonic() + 10, None
    while time.monotonic() < end:
        m = scrape(server)
        key = [line for line in m.splitlines() if line.startswith(("tierkv_prefix_cache", "tierkv_requests_running"))]
        if key == last and not metric(m, "tierkv_requests_running"):
            return m
        last = key
        time.sleep(0.4)
    raise TimeoutError("the metrics did not settle")


def l3_objects_all_decode(root: Path) -> int:
    """Check every chunk object in a disk L3 directory the way a reader would; return how many."""
    import torch

    from tierkv.layout import KVLayout
    from tierkv.tiers.codec import check_payload, parse_header, payload_offset, record_size

    # SmolLM2-135M: 30 layers, 3 KV heads of 64; fp32 on the CPU. A wrong guess fails parse_header.
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32, block_size=16)
    rs, start = record_size(layout, 4096), payload_offset(layout, 4096)
    files = sorted(root.rglob("*.kv"))
    for f in files:
        data = memoryview(f.read_bytes())
        assert len(data) and len(data) % rs == 0, f
        parent = None
        for j in range(len(data) // rs):
            rec = data[j * rs : (j + 1) * rs]
            bid, xxh = parse_header(layout, rec, 4096)  # raises DecodeError on anything wrong
            assert bid.chain_ok() and (parent is None or bid.parent == parent), f
            check_payload(rec[start : start + layout.bytes_per_block], xxh)
            parent = bid.hash
        assert f.name.startswith(f"{parent:032x}.c"), f  # named after its last block
    return len(files)
