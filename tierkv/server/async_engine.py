"""AsyncEngine: the synchronous Engine on one background thread, driven from asyncio.

The thread owns the Engine (and its tokenizer, which it detokenizes with) outright: every call into
it, adding requests and reading cache stats, runs there, sent through a thread-safe command queue
that the loop drains before each step. Prompts come tokenized (the server does that on a thread
of its own), so that no request, however long its prompt, holds up a step. Outputs go back to
per-request asyncio queues via `call_soon_threadsafe`. The waiting queue is bounded (`Overloaded`
past it). The drain's cut at the end of the grace period ends every request from whichever thread
reaches the deadline, without waiting for the step in flight, however long it takes. This file
never imports anything HTTP and never touches the Engine from any thread but its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import TensorParallelError

log = logging.getLogger(__name__)

STATS_PERIOD_S = 0.25  # how stale the metrics snapshot may get
CLEAR_WAIT_S = 2.0  # how long emptying the cache waits for the blocks in use to be let go
CLOSE_S = 1.0  # after the flush: what closing the engine (its threads, tensor-parallel ranks) may take
# The engine thread and the event loop share the GIL, and CPython takes it from a thread that
# computes only once the other has waited a switch interval (5 ms by default). A token handed to
# the loop while the engine thread launches its next step (1-3 ms of Python) waited for that
# launch to end, and a request body parsed on the loop kept the next launch waiting. 0.5 ms bounds
# both waits; lowered for the process, never raised.
SWITCH_INTERVAL_S = 0.0005


class Overloaded(Exception):
    """The waiting queue is full; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__("too many requests are waiting")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The server is draining (SIGTERM): no new requests, and this one was cut short."""


class EngineFailed(ShuttingDown):
    """The engine cannot go on (a tensor-parallel rank died): no request is taken from now on,
    /health answers 503 so that a supervisor restarts the server."""


@dataclass(slots=True)
class Stream:
    """One request's handle on the event-loop side."""

    request_id: str
    prompt_tokens: int
    queue: asyncio.Queue  # RequestOutput, then None when finished; or an Exception
    arrival: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, engine: Any, *, max_waiting: int = 256) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.Queue = queue.Queue()
        # the requests the engine runs, by id, and the answers the engine thread still owes (added or
        # refused requests, calls): both under _lock, since the drain's cut takes them from any thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._owed: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()
        self._cut_done = False  # the grace period is over: every request was ended
        self._timer: threading.Timer | None = None  # the drain's deadline
        self._pending = 0  # submitted, not yet drained by the engine thread
        self._waiting = 0  # the scheduler's waiting list, as of the last step
        self._running = 0
        self.stats: dict = {}  # cache_stats() snapshot for /metrics
        self.engine_stats: dict = {}  # engine_stats() snapshot for /metrics
        self.draining = False
        self.failed: str | None = None  # why the engine cannot go on (EngineFailed), once it cannot
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tierkv-engine", daemon=True)
        self._stats_at = 0.0

    # ------------------------------------------------------------------ event-loop side

    @property
    def started(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._refresh_stats(force=True)
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread.start()

    # The two queue lengths are read live (the length of a list is one atomic read), not from the
    # counts taken between steps: a step admits requests before it computes, and a CPU step can
    # take seconds, during which the counts would show them all waiting and none running.
    @property
    def num_waiting(self) -> int:
        return self._pending + len(self.engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def refusal(self) -> ShuttingDown | None:
        """Why no new request is taken now, as the error to raise; None while they are."""
        if self.failed is not None:
            return EngineFailed(f"the engine failed and takes no requests: {self.failed}")
        if self.draining:
            return ShuttingDown("the server is shutting down")
        return None

    async def submit(self, prompt_ids: list[int], params: Any, *, request_id: str, cache_salt: str | None = None,
                     priority: int = 0, arrival: float | None = None) -> Stream:
        """Queue a request: its prompt's token ids and SamplingParams. Whatever `add_request` raises
        is raised here. `arrival`: when the request came (default: now), which its latencies count
        from, so that they include the wait for the engine thread."""
        arrival = time.monotonic() if arrival is None else arrival
        if (refused := self.refusal()) is not None:
            raise refused
        with self._lock:
            if self._cut_done:  # a drain with no grace began since the check above
                raise ShuttingDown("the server is shutting down")
            if self._pending + self._waiting >= self.max_waiting:
                # a rough wait: one step per waiting request is already pessimistic on a GPU
                raise Overloaded(retry_after=max(1, min(30, (self._pending + self._waiting) // 32)))
            self._pending += 1
            done: concurrent.futures.Future = concurrent.futures.Future()
            self._owed.add(done)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        self._commands.put(("add", (prompt_ids, params, request_id, cache_salt, priority, loop, out, done)))
        try:
            prompt_tokens = await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added just as the caller left
            raise
        return Stream(request_id, prompt_tokens, out, arrival)

    def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds; safe to call for finished or unknown ids."""
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread (e.g. cache_stats()) and return its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._cut_done:  # the engine thread may be in a step that outlasts the process
                raise ShuttingDown("the server is shutting down")
            self._owed.add(done)
        self._commands.put(("call", (fn, done)))
        return await asyncio.wrap_future(done)

    async def load(self) -> dict:
        """Requests running and waiting, and the tokens they hold or bring: the running ones' whole
        sequences and the waiting ones' prompts (SGLang's measure of load)."""
        def count(eng) -> dict:
            sched = eng.scheduler
            return {"running": len(sched.running), "waiting": len(sched.waiting) + self._pending,
                    "tokens": sum(r.num_tokens for r in sched.running) + sum(len(r.prompt_ids) for r in sched.waiting)}

        return await self.call(count)

    async def clear_cache(self, wait_s: float = CLEAR_WAIT_S) -> bool:
        """Empty L1 and L2 (TieredKVCache.clear). It cannot while a running request holds a cached
        block or an L3 write reads one: tried again for up to `wait_s` (writes land in a moment),
        then False, having changed nothing."""
        end = time.monotonic() + wait_s
        while not await self.call(lambda eng: eng.cache.clear()):
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.05)
        return True

    def drain(self, grace_s: float) -> None:
        """Refuse new requests now; after `grace_s`, cut short whatever still runs (`cut`). A timer
        thread does it, not the engine thread, which may be in the middle of a long step then."""
        if self.draining:
            return
        self.draining = True
        self._timer = threading.Timer(grace_s, self.cut)
        self._timer.daemon = True
        self._timer.start()

    def cut(self) -> None:
        """End every request now, from any thread: each stream gets a ShuttingDown error (clients see
        the documented end: an SSE error event, or a 503 before any header) and each answer the
        engine thread still owes is that error. The engine thread frees their blocks once its step
        ends; nothing here waits for it. Idempotent."""
        with self._lock:
            if self._cut_done:
                return
            self._cut_done = True
            streams, self._streams = self._streams, {}
            owed, self._owed = self._owed, set()
        for done in owed:
            try:
                done.set_exception(ShuttingDown("the server is shutting down"))
            except concurrent.futures.InvalidStateError:
                pass  # its caller went away (cancelled)
        err = ShuttingDown("the server shut down before this request finished")
        self._send([(target, err) for target in streams.values()])
        for request_id in streams:
            self._commands.put(("abort", request_id))

    async def shutdown(self, grace_s: float, flush_timeout_s: float) -> None:
        """Stop taking requests and let running ones finish until the grace period ends (it began
        with the drain, when a signal started one), then cut the rest. The engine then gets at most
        `flush_timeout_s` to end the step in flight, flush write-back blocks to L3 and close; past
        that it is left behind (a daemon thread), so the process exits in time however long a step
        takes."""
        self.drain(grace_s)
        while not self._cut_done and (self.num_running or self.num_waiting):
            await asyncio.sleep(0.05)
        self.cut()  # nothing is left to cut when every request finished in time
        if self._timer is not None:
            self._timer.cancel()
        end = time.monotonic() + flush_timeout_s
        self._commands.put(("stop", end))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, flush_timeout_s + CLOSE_S)
        if self._thread.is_alive():
            log.warning("the engine was still in a step %.0f s after the grace period (--flush-timeout): exiting "
                        "without flushing write-back blocks to L3 or closing it", flush_timeout_s)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        eng = self.engine
        while True:
            block = self.failed is not None or not eng.has_unfinished()  # a failed engine only takes commands
            if self._drain(block):
                return
            if self.failed is not None:
                continue
            if not eng.has_unfinished():
                self._refresh_stats()
                continue
            try:
                eng.step(emit=self._hand_over)  # each token leaves as soon as the host has it
            except TensorParallelError as err:
                # Every rank is stopped already: nothing can run again in this process.
                log.error("engine failed: %s", err)
                self.failed = str(err).splitlines()[0]
                self._fail_all(EngineFailed(f"the engine failed while running this request: {self.failed}"))
                self._count()
                continue
            except Exception:
                # A fault in the engine fails the requests in flight, never the server.
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(RuntimeError("the engine failed while running this request"))
                self._count()
                continue
            self._count()
            self._refresh_stats()

    def _hand_over(self, outputs: list) -> None:
        for out in outputs:
            if out.logprobs:
                self._name_tokens(out.logprobs)
                # a snapshot: the event loop reads it while the next step appends (unnamed)
                # entries to the request's own list
                out.logprobs = out.logprobs[:]
        self._deliver([(out.request_id, out, out.request_finished) for out in outputs])

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; True when told to stop."""
        try:
            cmd = self._commands.get(timeout=STATS_PERIOD_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            kind, arg = cmd
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "call":
                fn, done = arg
                if self._claim(done):
                    try:
                        done.set_result(fn(self.engine))
                    except Exception as err:  # noqa: BLE001 (handed to the caller)
                        done.set_exception(err)
            elif kind == "stop":
                self._stop_engine(arg)
                return True
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._count()
        return False

    def _claim(self, done: concurrent.futures.Future) -> bool:
        """Take on an answer the engine thread owes; False when there is none to give: the cut gave
        it already, or its caller went away."""
        with self._lock:
            if done not in self._owed:
                return False
            self._owed.discard(done)
        return done.set_running_or_notify_cancel()

    def _add(self, prompt_ids, params, request_id, salt, priority, loop, out, done) -> None:
        with self._lock:
            self._pending -= 1
        if not self._claim(done):
            return
        if (refused := self.refusal()) is not None:
            done.set_exception(refused)
            return
        try:
            self.engine.add_request(prompt_ids, params, cache_salt=salt, priority=priority, request_id=request_id)
        except Exception as err:  # noqa: BLE001 (handed to the caller)
            done.set_exception(err)
            return
        with self._lock:
            cut = self._cut_done  # it came between the drain and the cut, which passed it by
            if not cut:
                self._streams[request_id] = (loop, out)
        if cut:
            self.engine.abort(request_id)
            done.set_exception(ShuttingDown("the server is shutting down"))
            return
        done.set_result(len(prompt_ids))

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        with self._lock:
            self._streams.pop(request_id, None)

    def _deliver(self, items: list[tuple[str, Any, bool]]) -> None:
        """Queue (request id, output or error, finished) items to their streams."""
        sends = []
        with self._lock:
            for request_id, item, finished in items:
                target = self._streams.get(request_id)
                if target is None:
                    continue  # aborted, or cut, meanwhile
                if finished:
                    del self._streams[request_id]
                sends.append((target, item))
        self._send(sends)

    @staticmethod
    def _send(sends: list[tuple[tuple[asyncio.AbstractEventLoop, asyncio.Queue], Any]]) -> None:
        """Put each item in its stream's queue: one wake-up of each event loop for the lot, not one
        per stream."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for (loop, out), item in sends:
            by_loop.setdefault(loop, []).append((out, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

    def _name_tokens(self, logprobs: list[dict]) -> None:
        """Add the text of each sampled and top token; done here because the tokenizer belongs
        to this thread (fast tokenizers are not safe to share across threads). Entries are the
        request's own dicts, so each is decoded once."""
        tok = self.engine.tokenizer
        for entry in reversed(logprobs):
            if "token" in entry:
                break
            dec = (lambda i: tok.decode([i], skip_special_tokens=False)) if tok is not None else str
            entry["token"] = dec(entry["token_id"])
            entry["top_tokens"] = [dec(i) for i, _ in entry["top"]]

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
        self._deliver([(rid, err, True) for rid in ids])

    def _count(self) -> None:
        sched = self.engine.scheduler
        with self._lock:
            self._waiting = len(sched.waiting)
        self._running = len(sched.running)

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.failed is None and (force or now - self._stats_at >= STATS_PERIOD_S):  # failed: the last stats stay
            self._stats_at = now
            try:
                self.stats = self.engine.cache_stats()
                self.engine_stats = self.engine.engine_stats()
            except Exception:
                log.exception("cache_stats() failed")

    def _stop_engine(self, end: float) -> None:
        """Flush write-back blocks to L3 until `end` (time.monotonic()), then close the engine."""
        self._fail_all(ShuttingDown("the server shut down before this request finished"))
        self._count()
        try:
            if not self.engine.cache.flush(max(0.0, end - time.monotonic())):
                log.warning("L3 flush did not finish within --flush-timeout; unflushed blocks are lost")
        except Exception:
            log.exception("L3 flush failed")
        self._refresh_stats(force=True)
        try:
            self.engine.close()
        except Exception:
            log.exception("engine close failed")
        while True:  # whatever arrived after "stop" gets an answer instead of hanging its caller
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            done = arg[-1] if kind == "add" else arg[1] if kind == "call" else None
            if done is not None and self._claim(done):
                done.set_exception(ShuttingDown("the server is shutting down"))


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue_, item in puts:
        queue_.put_nowait(item)
