"""py-spy on another process: sample it while a block of work runs, and say where each thread's time went.

`record(pid, path)` samples the process into `path` (py-spy's raw format: one collapsed stack a
line, ending in its sample count) for as long as its block runs (PySpyError after the block when
py-spy could not). `summarise(path)` turns such a
file into text: per thread, its samples and the functions most often on top of its stack (self)
and anywhere in it (inclusive). Needs the py-spy binary (pip install py-spy) and the right to
ptrace the process (root, or kernel.yama.ptrace_scope 0). It measures only what it is given.
"""

from __future__ import annotations

import collections
import contextlib
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

RATE = 250  # samples a second
_FRAME = re.compile(r" \((.*?):\d+\)$")  # "fn (file.py:123)" -> "fn (file.py)": lines apart are one function


class PySpyError(RuntimeError):
    """py-spy could not sample the process (not allowed to ptrace it, say)."""


def available() -> bool:
    return shutil.which("py-spy") is not None


@contextlib.contextmanager
def record(pid: int, path: Path, *, gil: bool = False):
    """Sample `pid` while the block runs; `gil`: only the thread holding the GIL at each sample."""
    # --nonblocking: never pause the process to sample it, so that its timings stay its own
    cmd = ["py-spy", "record", "-p", str(pid), "-r", str(RATE), "-f", "raw", "-o", str(path), "--threads", "--nonblocking"]
    spy = subprocess.Popen(cmd + (["--gil"] if gil else []), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attached before the work starts
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        _, err = spy.communicate(timeout=60)
        if not path.exists():
            raise PySpyError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")


def summarise(path: Path, title: str, top: int = 25) -> str:
    threads: dict[str, list] = collections.defaultdict(lambda: [0, collections.Counter(), collections.Counter()])
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        t = threads[re.sub(r"^thread \(\d+\): ", "", frames[0])]
        n = int(count)
        t[0] += n
        names = [_FRAME.sub(r" (\1)", f) for f in frames[1:]]
        if names:
            t[1][names[-1]] += n
        for name in set(names):
            t[2][name] += n
    lines = [title, f"py-spy record, {RATE} samples/s; per thread: self = on top of the stack, "
             "inclusive = anywhere in it", ""]
    for name, (total, own, anywhere) in sorted(threads.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"== thread {name}: {total} samples ({total / RATE:.1f} s)")
        for label, counter in (("self", own), ("inclusive", anywhere)):
            lines.append(f"  {label}:")
            lines += [f"    {n:7d} {100 * n / total:5.1f}%  {fn}" for fn, n in counter.most_common(top)]
        lines.append("")
    return "\n".join(lines)
