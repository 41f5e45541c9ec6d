"""A disk L3 shared between tensor-parallel sizes (CPU, gloo, real processes, real files).

Rank 0 stores whole-model blocks (every rank's KV heads, joined), the bytes a single-rank engine
stores, so the same directory serves TP=1 and TP=2 in both directions: a prompt cached by one is
served from L3 to the other, which then gives TP=1's greedy tokens. With L1 and L2 emptied first,
every prefix block the second engine uses came through L3; a rank whose heads were lost or put in
the wrong place changes the tokens. Rank 0's L2 slots hold exactly its heads of the stored bytes.
gpt-oss (full and window layers) does the same with a cache, and an exchange, per layer group,
and takes an L3 tail read while its start is recomputed in every group over two ranks.
`tierkv-serve -tp 2` under write_back fills L3 only by its shutdown flush, and one rank reads it.
A worker killed while L3 writes go on fails the call, and the engine still closes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from models import save_tiny_checkpoint

from tierkv import LLM, SamplingParams
from tierkv.errors import ConfigError, TensorParallelError
from tierkv.groups import GroupedPrefetch, caches_of
from tierkv.hashing import hash_blocks, token_bytes
from tierkv.heads import HeadSplit
from tierkv.tiering_l3 import block_id
from tierkv.tiers.open import open_store

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-l3")
    return {kind: str(save_tiny_checkpoint(kind, root / kind, seed=5)) for kind in ("llama", "qwen3", "gpt_oss")}


def batch() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    head = torch.randint(0, 256, (20,), generator=g).tolist()
    return [head + torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 26)]


def greedy(llm: LLM, prompts) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], [o.cached_tokens for o in outs]


@pytest.mark.parametrize(("writer", "reader", "kind", "offload"), [
    (2, 1, "llama", None), (1, 2, "llama", None), (2, 1, "qwen3", "fp8_e4m3"),
    (2, 1, "gpt_oss", None), (1, 2, "gpt_oss", None),
], ids=["tp2-writes-tp1-reads", "tp1-writes-tp2-reads", "fp8-tp2-writes-tp1-reads",
        "groups-tp2-writes-tp1-reads", "groups-tp1-writes-tp2-reads"])
def test_disk_l3_written_at_one_tp_size_is_read_at_another(checkpoints, tmp_path, writer, reader, kind, offload):
    path, prompts = checkpoints[kind], batch()
    options = dict(device="cpu", block_size=4, l2="2MiB", l3=[f"file://{tmp_path}/l3"], kv_offload_dtype=offload)
    plain = LLM(path, device="cpu", block_size=4, kv_offload_dtype=offload, l2="2MiB")
    want, _ = greedy(plain, prompts)
    plain.close()

    first = LLM(path, tensor_parallel_size=writer, **options)
    try:
        assert greedy(first, prompts)[0] == want
        assert first.cache.flush(timeout=60)
        written = first.engine.cache_stats()["tiers"]["l3"]["blocks_in"]
        assert written >= (20 + 13) // 4  # at least the first prompt's full blocks
    finally:
        first.close()

    second = LLM(path, tensor_parallel_size=reader, **options)
    try:
        got, cached = greedy(second, prompts)
        assert got == want
        stats = second.engine.cache_stats()["tiers"]
        # every cached block came from L3 on its first use; the 20-token head the two prompts
        # share (five blocks) was in L1 by the second prompt's turn
        assert sum(stats[t]["hit_tokens"] for t in ("l1", "l2", "l3")) == sum(cached) > 0
        assert stats["l3"]["hit_tokens"] == sum(cached) - 20
        assert stats["l3"]["blocks_out"] > 0
        if reader > 1:
            # rank 0's L2 slots hold exactly its heads of the stored whole-model bytes (of each
            # layer group's cache, under its group's name, where the model has window layers)
            for cache in caches_of(second.cache):
                tiers = cache.tiers
                store = open_store(options["l3"][0], tiers.l3_layout)
                # the blocks read from L3: each prompt's cached prefix (the blocks after it this
                # engine computed, and its bytes for them differ from the writer's in rounding)
                ns, index = cache.namespace(), cache.index.entries
                read = {h for p, n in zip(prompts, cached) for h in hash_blocks(token_bytes(p), 4, ns)[: n // 4]}
                entries = [index[h] for h in read if h in index and index[h].l2 >= 0]
                assert entries
                stored = torch.zeros((len(entries), tiers.l3_layout.bytes_per_block), dtype=torch.uint8)
                assert all(store.get_many([block_id(e) for e in entries], list(stored)))
                store.close()
                split = HeadSplit(tiers.l3_layout, tiers.exchange.split.ranks)
                assert torch.equal(tiers.l2.rows[torch.tensor([e.l2 for e in entries])], split.split(stored, 0))
    finally:
        second.close()



def test_an_l3_tail_read_by_every_layer_group_over_two_ranks_gives_one_ranks_tokens(checkpoints, tmp_path):
    """gpt-oss at TP=2 from a disk L3 written at TP=1: load-or-recompute splits the L3 part, its
    end is read while its start is recomputed, by the full group whole and by the window group
    its last window, each through its own heads exchange; the worker repeats each group's loads."""
    path = checkpoints["gpt_oss"]
    prompt = torch.randint(0, 256, (121,), generator=torch.Generator().manual_seed(12)).tolist()  # 30 blocks
    l3 = [f"file://{tmp_path}/l3"]
    one = LLM(path, device="cpu", block_size=4, l2="2MiB", l3=l3)
    want = one.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    assert one.cache.flush(timeout=60)
    one.close()
    two = LLM(path, device="cpu", tensor_parallel_size=2, block_size=4, l2="2MiB", l3=l3)
    try:
        cache, engine = two.cache, two.engine
        for c in cache.caches:  # one read in each group: block 0, and the disk's speed measured
            assert c.prefetch(c.match(prompt), 30, blocks=(0, 1)).wait(30)
        lead = cache.caches[0]
        engine.scheduler.recompute_seconds_per_token = lead.tiers.load_seconds("l3", 29) / 29 / 2 / 4
        req = engine.add_request(prompt, GREEDY)
        engine.step()
        start = req.adopt_at
        assert isinstance(req.tail, GroupedPrefetch) and 4 < start < 100
        assert req.tail.wait(30)
        while engine.has_unfinished():
            engine.step()
        assert req.output_ids == want
        assert req.cached_tokens == 4 + (120 - start)  # block 0, and the whole tail
        rank0, rank1 = (r["groups"] for r in engine.cache_stats()["ranks"])
        loads = [g["tiers"]["l2"]["blocks_out"] for g in rank0]
        assert [g["tiers"]["l2"]["blocks_out"] for g in rank1] == loads and 0 < loads[1] < loads[0]
    finally:
        two.close()


def test_tierkv_serve_over_two_ranks_flushes_whole_blocks_to_l3_on_sigterm(checkpoints, tmp_path):
    """write_back under TP: the blocks reach L3 only by the shutdown flush, which gathers the
    worker's heads while it is still up; one rank then reads them all."""
    openai = pytest.importorskip("openai")
    from server_helpers import ServerProcess

    path, prompt = checkpoints["qwen3"], batch()[1]
    l3 = f"file://{tmp_path}/l3"
    plain = LLM(path, device="cpu", block_size=4, l2="2MiB")
    want = plain.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    plain.close()
    server = ServerProcess(["--model", path, "--device", "cpu", "-tp", "2", "--block-size", "4", "--l2", "2MiB",
                            "--l3", l3, "--write-policy", "write_back"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        got = client.completions.create(model="qwen3", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=1,
                                        extra_body={"ignore_eos": True})
        assert [int(t) for t in got.choices[0].logprobs.tokens] == want
    finally:
        assert server.stop() == 0, server.log()
    one = LLM(path, device="cpu", block_size=4, l2="2MiB", l3=[l3])
    try:
        out = one.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.token_ids == want
        assert out.cached_tokens == (len(prompt) - 1) // 4 * 4  # every full prompt block came from L3
        assert one.cache.stats()["tiers"]["l3"]["hit_tokens"] == out.cached_tokens
    finally:
        one.close()


def test_a_worker_killed_with_l3_writes_in_flight_fails_the_call_and_close_returns(checkpoints, tmp_path):
    """The L3 threads on rank 0 wait on the worker's heads: a dead worker must fail them, not hang
    the engine's shutdown."""
    llm = LLM(checkpoints["llama"], device="cpu", tensor_parallel_size=2, block_size=4, l2="2MiB",
              l3=[f"file://{tmp_path}/l3"])
    worker = llm.engine.workers.procs[0]
    llm.generate(batch(), GREEDY, use_tqdm=False)  # ranks up, L3 written through
    os.kill(worker.pid, signal.SIGKILL)
    long = [batch()[1] + list(range(n, n + 40)) for n in range(8)]
    with pytest.raises(TensorParallelError, match="tierkv-tp-rank1 exited with code -9"):
        llm.generate(long, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 30
    worker.join(10)
    assert not worker.is_alive()


def test_no_room_for_the_shared_memory_staging_is_a_clear_error(checkpoints, tmp_path, monkeypatch):
    """The ranks' KV heads of L3 blocks pass through shared memory; where it cannot be had, the
    engine says how much it needs and how to get it."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("TIERKV_SHM_DIR", str(blocked))  # staging directories cannot be made under a file
    with pytest.raises(ConfigError, match=r"stages the ranks' KV heads in shared memory: \d+ MiB .*--shm-size"):
        LLM(checkpoints["llama"], device="cpu", tensor_parallel_size=2, block_size=4, l2="2MiB",
            l3=[f"file://{tmp_path}/l3"])
