"""Running a test file's Triton kernels on CPU under the Triton interpreter.

TRITON_INTERPRET=1 must be set before triton itself is imported (triton.language's own @jit
helpers are built at import), which an ordinary pytest process cannot promise. So in a normal run
such a file holds one test, `in_child(__file__)`, that runs the same file in a child pytest with
the variable set; in the child (INTERPRETED) it holds the real tests. No other test file sees
the variable. fp16 and fp32 only: bf16 tl.dot is wrong under the interpreter (DEVICE.md).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def in_child(path: str):
    """The one test of file `path` in a normal run: the file again, in a child pytest under the interpreter."""

    def test_triton_kernels_under_interpreter():
        pytest.importorskip("triton")
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"interpreter tests failed:\n{run.stdout[-20000:]}\n{run.stderr[-5000:]}"

    return test_triton_kernels_under_interpreter


def kernel_modules(*names: str) -> type:
    """The Triton kernel modules `names` of tierkv.kernels, built for the interpreter, as attributes."""
    mods = {name: importlib.import_module(f"tierkv.kernels.{name}") for name in ("_launch", *names)}
    assert mods["_launch"].INTERPRETING
    return type("Kernels", (), mods)


def leave_only_the_child_run(namespace: dict) -> None:
    """In a normal run, drop the interpreter cases a file defined above this call (its `globals()`):
    the child runs them. Tests defined after the call run in the normal run too."""
    if INTERPRETED:
        return
    for name in [n for n in namespace if n.startswith("test_") and n != "test_triton_kernels_under_interpreter"]:
        del namespace[name]
