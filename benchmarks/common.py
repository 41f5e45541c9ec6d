"""What every benchmark writes next to its figures: where and when it ran, on what code.

Benchmarks print a table and save `benchmarks/results/NAME-<machine>.json`; this file builds
the metadata part and writes the file. It never measures anything itself.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    import torch

    info = {
        "machine": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    # the device machine runs a copy of the working tree whose .git may lag behind it: the
    # caller names the commit it sent (TIERKV_COMMIT) where it can
    if os.environ.get("TIERKV_COMMIT"):
        info["git_commit"] = os.environ["TIERKV_COMMIT"]
        return info
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = None
    return info


def machine_tag() -> str:
    """The suffix of result file names: the GPU's model ('h200', 'h100': the first word of its
    name shaped like a letter and digits, not its memory kind, "NVIDIA H100 80GB HBM3"), 'cpu'
    without one."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    words = torch.cuda.get_device_name().split()
    return next((w for w in words if re.fullmatch(r"[A-Z]\d{2,}[A-Z]?", w)), words[-1]).lower()


def write_results(name: str, figures: dict, out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir) if out_dir else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{machine_tag()}.json"
    path.write_text(json.dumps({"environment": environment(), **figures}, indent=2) + "\n")
    return path
