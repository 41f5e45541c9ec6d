"""AsyncEngine: the engine on its own thread, as the server drives it."""

import asyncio
import time

import pytest

from models import save_tiny_checkpoint
from tierkv.engine.engine import Engine
from tierkv.engine.sampler import SamplingParams
from tierkv.engine.request import RequestOutput
from tierkv.server.async_engine import AsyncEngine, ShuttingDown, _put_all


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("async-llama"), seed=5))


@pytest.fixture
def engine(checkpoint):
    """A fresh engine: AsyncEngine.shutdown closes it."""
    eng = Engine(checkpoint, device="cpu")
    yield eng
    eng.close()


def test_each_streamed_output_keeps_the_logprobs_it_was_delivered_with(engine):
    # The engine thread appends each step's logprob entry to the request's own list; an output
    # handed to the event loop must not grow under it (a reader would meet an entry whose token
    # text is not filled in yet: that was a KeyError mid-stream under load).
    async def run() -> list:
        aeng = AsyncEngine(engine)
        aeng.start()
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        stream = await aeng.submit(list(range(3, 40)), params, request_id="lp")
        items = []
        while (item := await stream.queue.get()) is not None and not getattr(item, "finished", False):
            items.append(item)
            await asyncio.sleep(0.02)  # let the engine run ahead while we hold this output
        items.append(item)
        await aeng.shutdown(grace_s=5, flush_timeout_s=5)
        return items

    items = asyncio.run(run())
    assert len(items) == 12
    for n, item in enumerate(items, start=1):
        assert len(item.logprobs) == n  # what was delivered at step n, not what the request has now
        assert all("token" in e and len(e["top_tokens"]) == 2 for e in item.logprobs)


def test_each_token_leaves_in_the_step_that_sampled_it(engine):
    # Async scheduling (the default) once handed a step's tokens to the event loop only after
    # the next step had run: every streamed token a step late, the last two together. Compared
    # against the engine's own step times, not absolute ones: each token must be handed over
    # after the launch that sampled it and before the next launch begins.
    assert engine.config.async_scheduling
    launches, handed, received = [], [], []  # (start, end) of each launch | hand-over times | outputs
    run = engine.runner.run

    def timed_run(step, previous=None):
        start = time.monotonic()
        launched = run(step, previous)
        launches.append((start, time.monotonic()))
        return launched

    async def main() -> None:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def hand_over(fn, *args):  # the engine thread handing outputs to this loop
            if any(isinstance(item, RequestOutput) for _, item in (args[0] if fn is _put_all else ())):
                handed.append(time.monotonic())
            return call_soon_threadsafe(fn, *args)

        aeng = AsyncEngine(engine)
        aeng.start()
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        loop.call_soon_threadsafe = hand_over
        stream = await aeng.submit(list(range(3, 40)), params, request_id="timed")
        while True:
            item = await stream.queue.get()
            received.append(item)
            if item.request_finished:
                break
        await aeng.shutdown(grace_s=5, flush_timeout_s=5)

    engine.runner.run = timed_run
    try:
        asyncio.run(main())
    finally:
        del engine.runner.run  # the class's method again
    assert len(launches) == len(handed) == len(received) == 6  # the 6th token's step is its last
    assert [len(item.token_ids) for item in received] == [1, 2, 3, 4, 5, 6]
    for k in range(6):
        assert launches[k][1] <= handed[k], f"token {k} handed over before its step ended"
        if k + 1 < 6:
            assert handed[k] <= launches[k + 1][0], f"token {k} held back until step {k + 1} ran"


def test_the_drain_cuts_at_its_deadline_while_a_step_runs_on(engine):
    # The cut ran on the engine thread, between steps: a step longer than the grace held every
    # request past the deadline (issue 37 item 5). Here one step takes 3 s and the grace 0.3 s: the
    # stream that runs, the request still waiting to be added and a call to the engine all end
    # with ShuttingDown at the deadline; the engine aborts the request once the step ends, and the
    # shutdown, given 5 s for it, waits for that and closes the engine.
    run = engine.runner.run
    slow = {"on": False}

    def step(plan, previous=None):
        if slow["on"]:
            slow["on"] = False
            time.sleep(3.0)
        return run(plan, previous)

    async def main() -> dict:
        aeng = AsyncEngine(engine)
        aeng.start()
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        stream = await aeng.submit(list(range(3, 40)), params, request_id="running")
        assert not isinstance(await stream.queue.get(), Exception)  # its first token is out
        slow["on"] = True
        await asyncio.sleep(0.2)  # the slow step has begun
        waiting = asyncio.ensure_future(aeng.submit(list(range(3, 20)), params, request_id="waiting"))
        stats = asyncio.ensure_future(aeng.call(lambda eng: eng.cache_stats()))
        start = time.monotonic()
        aeng.drain(0.3)
        ends = {}
        while True:
            item = await stream.queue.get()
            if isinstance(item, Exception):
                ends["running"] = (time.monotonic() - start, item)
                break
        for name, fut in (("waiting", waiting), ("call", stats)):
            try:
                await fut
            except ShuttingDown as err:
                ends[name] = (time.monotonic() - start, err)
        with pytest.raises(ShuttingDown):  # the cut is done: nothing new waits on the engine
            await aeng.call(lambda eng: eng.cache_stats())
        await aeng.shutdown(grace_s=0.3, flush_timeout_s=5)
        ends["freed"] = not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
        return ends

    engine.runner.run = step
    try:
        ends = asyncio.run(main())
    finally:
        del engine.runner.run
    for name in ("running", "waiting", "call"):
        seconds, err = ends[name]
        assert isinstance(err, ShuttingDown) and 0.25 < seconds < 1.5, (name, seconds, err)
    assert ends["freed"]


def test_start_lowers_the_switch_interval_so_neither_thread_holds_the_other_back(engine):
    # The loop and the engine thread share the GIL: at CPython's default 5 ms, a token handed to
    # the loop waited out the engine thread's next launch. start() lowers it, and never raises
    # a lower one a process chose for itself.
    import sys

    from tierkv.server.async_engine import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        aeng = AsyncEngine(engine)
        aeng.start()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S, abs=2e-6)
        asyncio.run(aeng.shutdown(grace_s=1, flush_timeout_s=1))
        sys.setswitchinterval(0.0001)
        again = AsyncEngine(Engine(engine.config.model, device="cpu"))
        again.start()
        assert sys.getswitchinterval() == pytest.approx(0.0001, abs=2e-6)  # (kept to the microsecond)
        asyncio.run(again.shutdown(grace_s=1, flush_timeout_s=1))
    finally:
        sys.setswitchinterval(before)
