"""CompileWatch: counts and times the Triton compilations that happen while it is armed.

A serving engine compiles every kernel variant its steps may pick before the first request
(runner.py's warm-up); a variant it missed is compiled on first use, mid-step, stalling that
step and every request in it for 0.1-1 s. Triton specialises a kernel per argument dtype and per
integer argument that is 1 or divisible by 16, so a variant can hide behind a shape the warm-up
never met. Armed after the warm-up, this names each such compile (kernel, signature, seconds)
instead of leaving an unexplained slow step.

It uses Triton's public hooks (`triton.knobs.runtime.jit_cache_hook`, called before a compile,
and `jit_post_compile_hook`, after it), chaining to any hook set before it was armed, and never
changes what Triton compiles or runs. Without Triton (CPU installs) it arms nothing and counts 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

log = logging.getLogger(__name__)

RECENT = 16  # compiles whose name and seconds are kept for stats; the count covers all


class CompileWatch:
    def __init__(self) -> None:
        self.count = 0  # compiles finished while armed
        self.seconds = 0.0  # their total time
        self.recent: deque[tuple[str, float]] = deque(maxlen=RECENT)  # (kernel signature, seconds)
        self._started: dict[int, float] = {}  # thread id -> when its compile began (compiles are per thread)
        self._knobs = None
        self._before = self._after = None  # the hooks this one chains to

    @property
    def armed(self) -> bool:
        return self._knobs is not None

    def arm(self) -> bool:
        """Start counting; False where Triton (or its hooks) is missing. Arming twice is a no-op."""
        if self.armed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        self._knobs, self._before, self._after = runtime, runtime.jit_cache_hook, runtime.jit_post_compile_hook
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._on_start, self._on_done
        return True

    def disarm(self) -> None:
        """Stop counting and give Triton back the hooks that were set before `arm`. Where a later
        watch has chained onto this one (two engines in one process), its hooks stay and this one's
        go on being called through them."""
        runtime = self._knobs
        if runtime is not None and runtime.jit_post_compile_hook == self._on_done:
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        self._knobs = None

    def _on_start(self, **kwargs):
        self._started[threading.get_ident()] = time.perf_counter()
        # a truthy answer would make Triton skip the compile: only the chained hook may say so
        return self._before(**kwargs) if self._before is not None else None

    def _on_done(self, **kwargs):
        began = self._started.pop(threading.get_ident(), None)
        seconds = time.perf_counter() - began if began is not None else 0.0
        name = str(kwargs.get("repr") or kwargs.get("fn") or "?")
        self.count += 1
        self.seconds += seconds
        self.recent.append((name, seconds))
        log.warning("Triton compiled %s after start-up in %.3f s: a kernel variant the warm-up missed stalled "
                    "the steps behind it", name, seconds)
        return self._after(**kwargs) if self._after is not None else None

    def stats(self) -> dict:
        return {"compiles": self.count, "compile_seconds": self.seconds,
                "recent": [{"kernel": name, "seconds": s} for name, s in self.recent]}
