"""StepLog: one JSON line per engine step and per added request, written where the environment
variable TIERKV_STEP_LOG names a file (appended to): what a saturated server's rounds are made of,
read offline (bench_rounds' turnovers and round starts, docs/serving.md).

A step's line: the step's phases as time.perf_counter() seconds (t0 start, t1 after taking back a
finished step's tokens, t2 after scheduling, t3 after launching, t4 end), `taken` and `waited`
(seconds taking tokens back, and of them blocked on the GPU), the queue lengths, the requests
admitted in this schedule, those whose blocks are still loading, and each request run with its new
tokens. A request's line: when it was added and its prompt's length. Request ids are cut to their
last 6 characters. Off (None) unless asked for; it only writes, and never changes what the engine
does.
"""

from __future__ import annotations

import json
import os
import time

from ..errors import ConfigError

ENV = "TIERKV_STEP_LOG"


class StepLog:
    def __init__(self, path: str) -> None:
        try:
            self._file = open(path, "a", buffering=1 << 16)  # flushed in large writes, and at close
        except OSError as err:
            raise ConfigError(f"{ENV} names {path!r}, which cannot be opened to append to ({err.strerror}): "
                              f"name a file in a writable directory, or unset {ENV}") from None

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def added(self, req) -> None:
        self._write({"ev": "add", "t": time.perf_counter(), "id": req.request_id[-6:], "n": len(req.prompt_ids)})

    def stepped(self, times: tuple[float, float, float, float], step, scheduler, admitted: list,
                taken: float, waited: float) -> None:
        t0, t1, t2, t3 = times
        self._write({
            "ev": "step", "t0": t0, "t1": t1, "t2": t2, "t3": t3, "t4": time.perf_counter(),
            "taken": taken, "waited": waited, "waiting": len(scheduler.waiting), "running": len(scheduler.running),
            "admitted": [r.request_id[-6:] for r in admitted],
            "loading": [r.request_id[-6:] for r in scheduler.loading],
            "run": [[r.request_id[-6:], n] for r, n in zip(step.requests, step.num_new)],
        })

    def close(self) -> None:
        self._file.close()

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
