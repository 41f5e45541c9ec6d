"""AsyncEngine: the engine on its own thread, as the server drives it."""

import asyncio

import pytest

from models import save_tiny_checkpoint
from tierkv.engine.engine import Engine
from tierkv.engine.sampler import SamplingParams
from tierkv.server.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("async-llama"), seed=5)), device="cpu")
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
        stream = await aeng.submit(lambda eng: (list(range(3, 40)), params), request_id="lp")
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
