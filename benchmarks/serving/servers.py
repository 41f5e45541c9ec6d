"""The servers bench_serving starts: one tierkv-serve process per workload and configuration
(off | l1 | l1+l2 | l1+l2+disk), its tier sizes and flags, stopped by its own pid whatever
happens; for --url, the external server's tier sizes as it reports them. It never decides what
a session sends.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from pathlib import Path

import httpx
from server_helpers import ServerProcess

from tierkv.cache import max_sequence_tokens
from tierkv.config import parse_size
from tierkv.engine.config import EngineConfig

from .model import ModelInfo
from .workloads import Source

CONFIGS = ("off", "l1", "l1+l2", "l1+l2+disk")
SERVED_NAME = "bench"
BLOCK_SIZE = EngineConfig().block_size  # the servers run with the engine's default block size


def tier_sizes(a, src: Source, kvb: int) -> dict:
    """L1 = the workload's KV / --kv-over-l1, but room for at least two of its largest requests;
    L2 = its --XX-l2-over-kv x its KV; the disk holds twice its KV. --l1, --l2, --l3-size override."""
    block = BLOCK_SIZE * kvb
    wanted, least = src.kv_tokens * kvb / a.kv_over_l1, 2 * src.largest_request * kvb
    l1 = parse_size(a.l1) if a.l1 else math.ceil(max(wanted, least) / block) * block
    l2 = parse_size(a.l2) if a.l2 else math.ceil(src.shape["l2_over_kv"] * src.kv_tokens * kvb / block) * block
    l3 = parse_size(a.l3_size) if a.l3_size else 2 * src.kv_tokens * kvb
    return dict(l1_bytes=l1, l2_bytes=l2, l3_bytes=l3, l1_raised_for_largest_request=least > wanted and not a.l1,
                kv_bytes=src.kv_tokens * kvb, kv_over_l1=src.kv_tokens * kvb / l1, l2_over_kv=l2 / (src.kv_tokens * kvb))


def external_sizes(a, src: Source, kvb: int) -> dict:
    """An external server's tiers are what they are: read them, to report the KV / L1 ratio."""
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    r = httpx.get(a.url + "/v1/cache/stats", headers=headers, timeout=60)
    tiers = r.json()["tiers"] if r.status_code == 200 else {}
    l1, l2 = (tiers.get(t, {}).get("capacity_bytes", 0) for t in ("l1", "l2"))
    kv = src.kv_tokens * kvb
    return dict(l1_bytes=l1, l2_bytes=l2, l3_bytes=None, l1_raised_for_largest_request=False, kv_bytes=kv,
                kv_over_l1=kv / l1 if l1 else None, l2_over_kv=l2 / kv)


def server_args(a, config: str, model: ModelInfo, sizes: dict, max_len: int, l3_dir: Path) -> list[str]:
    # a context the config's tiers cannot hold for one sequence is refused at startup: ask for
    # at most what they hold (the "off" and "l1" configs have no L2)
    block_bytes = BLOCK_SIZE * model.kv_bytes_per_token
    holds = max_sequence_tokens(sizes["l1_bytes"] // block_bytes,
                                sizes["l2_bytes"] // block_bytes if "l2" in config else 0, BLOCK_SIZE)
    args = ["--served-model-name", SERVED_NAME, "--l1", str(sizes["l1_bytes"]), "--max-model-len", str(min(max_len, holds)),
            "--max-num-seqs", str(a.max_num_seqs), "--max-waiting", "100000", "--max-connections", "4096",
            "--log-level", "warning",
            # stop fast: nothing in flight is worth waiting for, nor queued disk writes worth keeping
            "--grace-period", "5", "--flush-timeout", "1"]
    if model.path is not None:
        args += ["--model", str(model.path)]
    if config == "off":
        args.append("--no-enable-prefix-caching")
    args += ["--l2", str(sizes["l2_bytes"]) if "l2" in config else "0"]
    if "disk" in config:
        args += ["--l3", f"file://{l3_dir}?size={sizes['l3_bytes']}&direct=1"]
    if a.enforce_eager:
        args.append("--enforce-eager")
    if a.profile_seconds:  # /start_profile and /stop_profile, for the profiled point (session.py)
        args += ["--profile-dir", str(l3_dir.with_name(f"traces-{config.replace('+', '_')}"))]
    return args + a.server_args.split()


def with_server(a, config: str, model: ModelInfo, sizes: dict, max_len: int, tmp: Path, session,
                deadline: float) -> dict:
    """Start the config's server (waiting for it until `deadline` at most), run `session(url)` (a
    coroutine function) against it, stop it."""
    l3_dir = tmp / f"l3-{config.replace('+', '_')}"
    srv = ServerProcess(server_args(a, config, model, sizes, max_len, l3_dir), tmp / f"server-{config}.log")
    try:
        t = time.perf_counter()
        srv.wait_ready(min(a.timeout, deadline - t))
        start_s = time.perf_counter() - t
        print(f"{config}: server up in {start_s:.1f} s", flush=True)
        figures = asyncio.run(session(srv.url))
        figures["server"] = dict(start_s=start_s, args=srv.proc.args[3:])
        return figures
    finally:
        code = srv.stop()
        if code != 0:
            print(f"{config}: server exited with {code}; log tail:\n{srv.log_path.read_text()[-1500:]}", flush=True)
        shutil.rmtree(l3_dir, ignore_errors=True)
