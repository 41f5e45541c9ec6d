"""The custom-engine example (examples/custom_engine.py) as a test: a paged engine of its own, with
its own attention over its own buffers registered with tierkv, gives the tokens of the same model
run with no cache at all, whichever tier serves the prefix: L1, L2, a disk L3 after a restart, and
with two threads sharing the engine. And the loop of docs/custom_engine.md, run as written."""

import importlib.util
import threading
from pathlib import Path

import pytest
import torch

from models import save_tiny_checkpoint
from tierkv import CacheConfig

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("custom_engine", ROOT / "examples" / "custom_engine.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

SYSTEM = list(range(3, 40))  # a shared "system prompt": two full blocks of 16 and then some


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    path = save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return example.Llama(path)


def reference(model, prompts, max_new=6):
    return [example.reference_generate(model, p, max_new) for p in prompts]


def engine(model, l3_dir: Path, **kw) -> "example.PagedEngine":
    config = CacheConfig(l2=64 * model.layout().bytes_per_block, l3=[f"file://{l3_dir}"], **kw)
    return example.PagedEngine(model, num_blocks=24, config=config, name="tiny-test")


def test_the_example_engine_equals_its_no_cache_reference_through_every_tier(model, tmp_path):
    first, second = SYSTEM + [100, 101, 102], SYSTEM + [200, 201, 202, 203]
    want = reference(model, [first, second])
    e = engine(model, tmp_path)
    got = e.generate([first], 6)[0]
    assert got["tokens"] == want[0] and got["cached"] == 0
    got = e.generate([second], 6)[0]  # the system prompt's blocks are in L1
    assert got["tokens"] == want[1] and got["by_tier"] == {"l1": 32, "l2": 0, "l3": 0}
    e.cache.evict("l1")  # out of the engine's buffers: the next hit loads from L2
    assert e.cache.match(second).by_tier["l2"] == 32
    got = e.generate([second], 6)[0]
    assert got["tokens"] == want[1] and got["by_tier"] == {"l1": 0, "l2": 32, "l3": 0}
    # a batch of both, decoded together
    assert [r["tokens"] for r in e.generate([first, second], 6)] == want
    e.cache.close()  # write-through: L3 holds every full block already

    restarted = engine(model, tmp_path)  # a new process: empty buffers and L2, the same disk
    assert restarted.cache.match(second).by_tier == {"l1": 0, "l2": 0, "l3": 32}
    got = restarted.generate([second], 6)[0]
    assert got["tokens"] == want[1] and got["by_tier"] == {"l1": 0, "l2": 0, "l3": 32}
    assert restarted.cache.stats()["tiers"]["l3"]["blocks_out"] >= 2
    restarted.cache.close()


def test_two_threads_share_the_engine_and_its_cache(model, tmp_path):
    prompts = [SYSTEM + [300 + i, 7, 8] for i in range(4)]
    want = reference(model, prompts)
    e = engine(model, tmp_path, write_policy="write_back")
    results: dict[int, list[int]] = {}
    errors = []

    def run(i):
        try:
            for _ in range(2):  # the second round finds its own prompt cached
                results[i] = e.generate([prompts[i]], 6)[0]["tokens"]
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert [results[i] for i in range(4)] == want
    assert e.cache.live_sequences() == []  # every sequence either thread admitted was freed
    e.cache.evict("l1")
    assert e.cache.stats()["tiers"]["l1"]["used_blocks"] == 0  # every block given back
    e.cache.close()


def test_the_engines_own_buffers_hold_exactly_the_reference_kv(model, tmp_path):
    """The bytes tierkv loaded into the engine's buffers (from L2) are the engine's own earlier bytes."""
    prompt = SYSTEM + [9, 9]
    e = engine(model, tmp_path)
    e.generate([prompt], 1)
    seq = e.cache.admit(prompt)
    before = [torch.stack([layer[:, s] for s in seq.slots[:2]]) for layer in e.kv]
    e.cache.free(seq)
    e.cache.evict("l1")
    for layer in e.kv:
        layer.zero_()
    seq = e.cache.admit(prompt)
    seq.wait()
    after = [torch.stack([layer[:, s] for s in seq.slots[:2]]) for layer in e.kv]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    e.cache.free(seq)
    e.cache.close()


def test_the_docs_loop_runs_as_written_and_every_block_it_commits_holds_its_kv(tmp_path):
    """docs/custom_engine.md's loop, run as written, with a stand-in for the attention it leaves to
    the engine that writes each token's KV (prefix_kv: a pure function of the prefix) into buffers in
    vLLM's layout: a prefill in chunks not aligned to blocks, then decoding. Every block it commits
    reaches L3 holding its tokens' KV, read back by another cache, and no sequence is left behind."""
    import re

    from prefix_kv import prefix_kv
    from tierkv import KVLayout, TieredKVCache

    doc = (ROOT / "docs" / "custom_engine.md").read_text()
    block = doc.split("## The loop")[1].split("```python")[1].split("```")[0]
    loop = block[block.index("seq = cache.admit(") :]  # after the set-up, which is for a GPU
    loop, n = re.subn(r"^(\s+)\.\.\.(\s+#.*)$", r"\1write_kv(layer, seq, tokens, written, end)\2", loop, flags=re.M)
    assert n == 1  # the one line the doc leaves to the engine: its attention

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=16)
    buffers = [torch.zeros(2, 16, 16, 2, 4) for _ in range(3)]  # [K/V, blocks, block_size, kv_heads, head_dim]

    def write_kv(layer, seq, tokens, start, end):
        kv = prefix_kv(layout, tokens[:end])  # [L, 2, end, H, D]
        for p in range(start, end):
            buffers[layer][:, seq.slots[p // 16], p % 16] = kv[layer, :, p]

    url = f"file://{tmp_path}"
    cache = TieredKVCache(layout, CacheConfig(l2=32 * layout.bytes_per_block, l3=[url]), kv_caches=buffers,
                          kv_layout="vllm", model="docs-loop")
    prompt = list(range(100, 141))
    samples = iter(range(7, 100))
    names = dict(cache=cache, prompt=prompt, salt=None, chunk=5, max_tokens=60, num_layers=3, logits=None,
                 sample=lambda logits: next(samples), write_kv=write_kv)
    exec(loop, names)
    tokens = names["tokens"]
    assert tokens[:41] == prompt and len(tokens) == 60  # the KV of all but the last token is written
    assert names["seq"].num_tokens == names["written"] == 59  # room reserved for no more than that
    with TieredKVCache(layout, CacheConfig(l1=8 * layout.bytes_per_block, l2=8 * layout.bytes_per_block, l3=[url]),
                       device="cpu", model="docs-loop") as reader:
        n, kv = reader.retrieve(tokens, limit=len(tokens))
        assert n == 48 and torch.equal(kv, prefix_kv(layout, tokens)[:, :, :48])
