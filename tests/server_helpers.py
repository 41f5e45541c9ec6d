"""Helpers for tests/test_server.py: run `tierkv-serve` as a real process on a free loopback port.

The server's output goes to a log file that tests read (for the secrets check). Processes are
stopped by their own pid only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack

READY_TIMEOUT_S = 240.0  # model load on a busy 2-core CI box


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierkv.server.cli", "--port", str(self.port), *args],
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


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text output (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def l3_objects_all_decode(root: Path) -> int:
    """Check every object in a disk L3 directory the way a reader would; return how many."""
    import torch

    from tierkv.layout import KVLayout
    from tierkv.tiers.codec import (
        PREFIX_SIZE,
        BlockId,
        check_payload,
        decode_header,
        payload_offset,
    )

    # SmolLM2-135M: 30 layers, 3 KV heads of 64; fp32 on the CPU. A wrong guess fails decode_header.
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32, block_size=16)
    files = sorted(root.rglob("*.kv"))
    for f in files:
        data = f.read_bytes()
        hlen = int.from_bytes(data[4:8], "little")
        head = msgpack.unpackb(data[PREFIX_SIZE: PREFIX_SIZE + hlen])
        bid = BlockId(int.from_bytes(head["hash"], "little"), int.from_bytes(head["parent"], "little"),
                      head["ns"], head["tokens"])
        assert bid.chain_ok(), f
        assert f.name == f"{bid.hash:032x}.kv"
        xxh = decode_header(layout, bid, data, align=4096)  # raises DecodeError on anything wrong
        start = payload_offset(layout, 4096)
        payload = memoryview(data)[start:]
        assert len(payload) == layout.bytes_per_block, f
        check_payload(payload, xxh)
    return len(files)
