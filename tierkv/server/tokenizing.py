"""Tokenizing prompts for the server: a copy of the model's tokenizer on one thread of its own.

Every route that tokenizes (the generation routes, /tokenize, /detokenize, /render) and applies chat
templates does it here, so that neither the engine thread (whose step it would hold up: ~0.5 s
for a 1 MiB prompt) nor the event loop (which sends every stream's tokens) ever waits on it. One
thread, as vLLM's API server has: however many clients send long prompts, tokenizing takes one
core at most, and the Rust tokenizer releases the GIL while it works. It never touches the Engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..engine.tokenizer import Tokenizer


class Tokenizing:
    """A copy of the model's tokenizer (a fast tokenizer is not safe to share between threads, and
    the engine thread keeps its own for detokenizing), used on one thread."""

    def __init__(self, root: str | None, refusal: Callable[[], Exception | None] = lambda: None) -> None:
        """`root`: the directory holding the tokenizer files (None: the model has none). `refusal`:
        why no work is taken now (the server is draining), checked as each job starts, so that the
        jobs queued behind a long one end at once rather than one after another."""
        self.tokenizer = Tokenizer.from_dir(Path(root)) if root else None
        if self.tokenizer is not None:
            _ = self.tokenizer.length_bound  # read from tokenizer.json now rather than by the first request
        self.refusal = refusal
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-tokenize")

    async def run(self, fn: Callable[[Tokenizer | None], Any], *, tokenizes: bool = True) -> Any:
        """`fn(tokenizer)` on the tokenizing thread; tokenizer is None for a model without one.
        `tokenizes=False`: `fn` never touches the tokenizer and is O(1) Python work (a token-id
        prompt's checks), done here on the event loop: the hop to the thread and back costs ~0.1 ms on
        an idle host and several on a busy one, and would queue it behind another request's long
        text."""
        def job():
            if (refused := self.refusal()) is not None:
                raise refused
            return fn(self.tokenizer)

        if not tokenizes:
            return job()
        return await asyncio.get_running_loop().run_in_executor(self.pool, job)
