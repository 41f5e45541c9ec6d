"""POST /start_profile and /stop_profile: a torch.profiler trace of the engine's steps, as vLLM and SGLang serve them.

Registered only when tierkv-serve runs with --profile-dir (vLLM: VLLM_TORCH_PROFILER_DIR). The
profiler starts and stops on the engine thread, between two steps, so a trace holds whole steps:
CPU ops of every thread and, on a GPU, the kernels and copies of every stream (the copy stream's
L1<->L2 moves included), and each step as a named range (the requests it runs, those waiting for
their loads: Engine.label_steps). /stop_profile writes it as a gzipped Chrome trace (chrome://tracing,
Perfetto) named by the process and the time it ended (ms), and answers its path. Nothing here runs while no profile is
being taken; this file never changes what the engine computes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from fastapi import FastAPI

from .api_errors import answer
from .async_engine import AsyncEngine
from .protocol import ERRORS, APIError


class EngineProfiler:
    """One torch.profiler session at a time, started and stopped by the engine thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._session: torch.profiler.profile | None = None

    def start(self, engine=None) -> None:
        if self._session is not None:
            raise APIError(409, "a profile is being taken already: POST /stop_profile first", code="profiling")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        session = torch.profiler.profile(activities=activities)
        session.start()
        self._session = session
        if engine is not None:
            engine.label_steps = True  # each step a named range: which requests ran, which loaded

    def stop(self, engine=None) -> Path:
        if self._session is None:
            raise APIError(409, "no profile is being taken: POST /start_profile first", code="profiling")
        session, self._session = self._session, None
        if engine is not None:
            engine.label_steps = False
        session.stop()
        path = self.directory / f"tierkv-serve-{os.getpid()}-{time.time_ns() // 1_000_000}.pt.trace.json.gz"
        session.export_chrome_trace(str(path))
        return path


def add_profile_routes(app: FastAPI, engine: AsyncEngine, directory: Path) -> None:
    profiler = EngineProfiler(directory)

    async def start() -> dict:
        await engine.call(profiler.start)
        return {"status": "profiling", "directory": str(directory)}

    async def stop() -> dict:
        return {"status": "stopped", "trace": str(await engine.call(profiler.stop))}

    @app.post("/start_profile", responses=ERRORS)
    async def start_profile():
        """Start tracing the engine's steps (until /stop_profile)."""
        return await answer(start())

    @app.post("/stop_profile", responses=ERRORS)
    async def stop_profile():
        """Stop tracing; the trace is written to --profile-dir, and its path answered."""
        return await answer(stop())
