"""CUDA graphs of the decode and small mixed steps (tierkv/engine/graphs.py).

On CPU the runner never tries graphs. On a GPU: a replay gives the eager forward's logits and
writes the KV pool only at the live rows' slots, whatever batch ran before; greedy generation
with graphs equals enforce_eager token for token, with decode batches that are and are not
captured sizes, with mixed steps (chunked prefill beside decodes), and with batches larger than
the largest graph (which run eagerly).
"""

from __future__ import annotations

import pytest
import torch
from models import make_pool, save_tiny_checkpoint

from tierkv import LLM, SamplingParams, kernels
from tierkv.engine import graphs as graphs_module
from tierkv.engine.attention import AttentionMetadata
from tierkv.engine.graphs import StepGraphs, capture_sizes, mixed_shapes
from tierkv.engine.loader import load_model

pytest.importorskip("transformers")  # builds the tiny checkpoints

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(1) == [1]


def test_mixed_shapes():
    """Token sizes up to the step budget; sequence counts hold the batch and its padding sequence."""
    assert mixed_shapes(8, 8192) == [(t, b) for t in (64, 128, 192, 256, 512) for b in (2, 4, 8, 16)]
    assert mixed_shapes(7, 100) == [(64, b) for b in (2, 4, 8)]
    assert mixed_shapes(256, 512)[-1] == (512, 512) and (64, 256) not in mixed_shapes(256, 512)
    assert mixed_shapes(4, 32) == []


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-graphs"), seed=5))


def varied_prompts(vocab: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def varied_params(n: int) -> list[SamplingParams]:
    """Requests end one after another, so decode batches shrink through every size below n."""
    return [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(n)]


def test_cpu_never_uses_graphs(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", l1="16MiB")
    g = llm.engine.runner.graphs
    assert not g.enabled and "cpu" in g.disabled_reason and not g.graphs
    prompts = varied_prompts(512, (5, 17, 30))
    outs = llm.generate(prompts, varied_params(3), use_tqdm=False)
    eager = LLM(tiny_llama, device="cpu", l1="16MiB", enforce_eager=True)
    assert eager.engine.runner.graphs.disabled_reason == "enforce_eager"
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(prompts, varied_params(3), use_tqdm=False)]
    assert g.replays == 0


class Rerun:
    """Stands in for a CUDA graph on CPU: "replay" runs the captured work again on the static
    buffers, so the buffer handling (padding, stale rows, row selection) is checked in CI.
    `tokens`: a mixed step's graph of that many tokens over `bs` sequences."""

    def __init__(self, graphs: StepGraphs, bs: int, width: int, tokens: int | None = None) -> None:
        self.graphs, self.bs, self.width, self.tokens = graphs, bs, width, tokens
        self.replays = 0

    def replay(self) -> None:
        # fresh metadata each time, as a graph recomputes the prefill plan from the buffers
        self.graphs._forward(self.tokens or self.bs, self.graphs._meta(self.bs, self.width, self.tokens))
        self.replays += 1


def decode_meta(lens: list[int], table: torch.Tensor, sample: list[int], block_size: int, device) -> AttentionMetadata:
    """One new token per sequence at position len - 1, written into its own block table's slot."""
    b = len(lens)
    pos = torch.tensor(lens) - 1
    slots = table[torch.arange(b), pos // block_size].long() * block_size + pos % block_size  # [B]
    return AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32).to(device),
        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32).to(device),
        logits_indices=torch.tensor(sample, dtype=torch.int64).to(device), is_decode=True,
    )


def random_tables(lens: list[int], num_blocks: int, block_size: int, g: torch.Generator) -> torch.Tensor:
    """[B, blocks of the longest] int32: distinct random blocks for each sequence, padded with -1
    past its own (as the cache pads its tables)."""
    need = [-(-n // block_size) for n in lens]
    table = torch.randperm(num_blocks, generator=g)[: len(lens) * max(need)].view(len(lens), max(need)).int()
    for row, n in enumerate(need):
        table[row, n:] = -1
    return table


def replays_as_eager(graphs: StepGraphs, model, pool: torch.Tensor, ids, pos, meta: AttentionMetadata,
                     block_size: int, what: str) -> None:
    """The step replayed gives the eager forward's logits and pool, and writes the pool at the
    step's slots only."""
    ref_pool = pool.clone()
    ref = model(ids, pos, ref_pool, meta)  # [rows that sample, vocab]
    before = pool.clone()
    out = graphs.run(ids, pos, pool, meta)
    assert out is not None and out.shape == ref.shape, what
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-4, atol=1e-4)
    written = (pool != before).any(dim=5).any(dim=4).any(dim=2).any(dim=0).cpu()  # [blocks, block_size]
    expected = torch.zeros(pool.shape[1], block_size, dtype=torch.bool)
    slots = meta.slot_mapping.cpu()
    expected[slots // block_size, slots % block_size] = True
    assert torch.equal(written, expected), f"{what}: the graph wrote outside the live slots"


@torch.inference_mode()
def check_replays(graphs: StepGraphs, model, pool: torch.Tensor, block_size: int, max_len: int) -> None:
    """Batches go up and down, so padding rows hold stale inputs of an earlier, larger batch and
    must still write nothing; each replay must give the eager forward's logits and pool writes.
    The last two batches are short, so graphs of a narrower block table replay where captured."""
    dev, num_blocks, vocab = pool.device, pool.shape[1], model.config.vocab_size
    bs = block_size
    g = torch.Generator().manual_seed(0)
    for b, longest in ((8, max_len), (3, max_len), (5, max_len), (1, max_len), (3, max_len), (2, max_len),
                       (7, max_len), (1, 40), (2, 40)):
        lens = torch.randint(1, longest + 1, (b,), generator=g).tolist()
        table = random_tables(lens, num_blocks, bs, g)
        sample = [i for i in range(b) if i % 3 != 1]  # some rows do not sample
        meta = decode_meta(lens, table, sample, bs, dev)
        ids = torch.randint(0, vocab, (b,), generator=g).to(dev)
        pos = torch.tensor(lens).to(dev) - 1
        replays_as_eager(graphs, model, pool, ids, pos, meta, bs, f"batch {b}")
    assert graphs.replays == 9

    # what a graph cannot serve runs eagerly (run returns None)
    def runs(meta: AttentionMetadata, kv=pool) -> bool:
        n = meta.num_seqs
        return graphs.run(torch.zeros(n, dtype=torch.int64, device=dev), torch.full((n,), 4, device=dev), kv, meta) is not None

    too_many = graphs.sizes[-1] + 1
    assert not runs(decode_meta([5] * too_many, torch.arange(too_many, dtype=torch.int32)[:, None], [0], bs, dev))
    assert not runs(decode_meta([5, 5], torch.zeros(2, graphs.width + 1, dtype=torch.int32), [0, 1], bs, dev))
    meta = decode_meta([5, 5], torch.zeros(2, 1, dtype=torch.int32), [0, 1], bs, dev)
    meta.is_decode = False  # a mixed step's metadata: a mixed graph's, where they are captured
    mixed = graphs.mixed_replays
    assert runs(meta) == bool(graphs.mixed_graphs) and graphs.mixed_replays == mixed + bool(graphs.mixed_graphs)
    meta.is_decode = True
    assert not runs(meta, kv=pool.clone())  # not the pool the graphs captured
    assert graphs.replays == 9


def mixed_meta(new: list[int], lens: list[int], table: torch.Tensor, sample: list[int], block_size: int,
               device) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of sequences computing new[b] tokens up to length lens[b]."""
    pos = torch.cat([torch.arange(n - k, n) for k, n in zip(new, lens)])  # [T]
    row = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new))  # [T]
    slots = table[row, pos // block_size].long() * block_size + pos % block_size  # [T]
    cu = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32).to(device), cu_seqlens_q=cu.to(device),
        logits_indices=(cu[1:][sample] - 1).to(torch.int64).to(device), is_decode=all(k == 1 for k in new),
    )
    return pos.to(device), meta


@torch.inference_mode()
def check_mixed_replays(graphs: StepGraphs, model, pool: torch.Tensor, block_size: int, max_len: int) -> None:
    """Mixed steps of varied token and sequence counts, some filling their graph's tokens exactly
    (no padding tokens) and some not: each replay gives the eager forward's logits and writes the
    pool at the live tokens' slots only (the padding sequence writes nothing, stale rows of an
    earlier, larger step neither). Steps no mixed graph holds run eagerly."""
    dev, num_blocks, vocab, bs = pool.device, pool.shape[1], model.config.vocab_size, block_size
    decodes, mixed = graphs.replays, graphs.mixed_replays
    g = torch.Generator().manual_seed(1)
    cases = ((1, 1, 1, 1, 40), (30,), (5, 1, 1), (1, 1, 1, 1, 1, 1, 2, 50), (64,), (1, 63), (3, 4, 5, 6, 7, 8, 9))
    for new in cases:
        new = list(new)
        lens = [int(torch.randint(k, max_len + 1, (1,), generator=g)) for k in new]
        sample = [i for i in range(len(new)) if i % 3 != 1]
        pos, meta = mixed_meta(new, lens, random_tables(lens, num_blocks, bs, g), sample, bs, dev)
        ids = torch.randint(0, vocab, (len(pos),), generator=g).to(dev)
        replays_as_eager(graphs, model, pool, ids, pos, meta, bs, f"step {new}")
    assert graphs.mixed_replays == mixed + len(cases) and graphs.replays == decodes
    top = max(t for t, _ in graphs.mixed_graphs)
    pos, meta = mixed_meta([top + 1], [top + 1], torch.arange(-(-(top + 1) // bs), dtype=torch.int32)[None], [0],
                           bs, dev)
    assert graphs.run(torch.zeros(top + 1, dtype=torch.int64, device=dev), pos, pool, meta) is None  # too long
    pos, meta = mixed_meta([2, 3], [2, 3], torch.tensor([[0], [1]], dtype=torch.int32), [0, 1], bs, dev)
    meta.wait_layer = lambda layer: None  # loads still landing: eager, layer by layer
    assert graphs.run(torch.zeros(5, dtype=torch.int64, device=dev), pos, pool, meta) is None
    assert graphs.mixed_replays == mixed + len(cases)


def test_mixed_static_buffers_on_cpu(tmp_path, monkeypatch):
    """A mixed step's padding and stale rows, with `Rerun` in place of CUDA graphs (fp32 Qwen3)."""
    monkeypatch.setattr(graphs_module, "MIXED_TOKENS", (16, 64))
    bs, max_len = 16, 256
    lm = load_model(save_tiny_checkpoint("qwen3", tmp_path / "qwen3"), device="cpu", dtype=torch.float32)
    pool = make_pool(lm.model, 160, bs).normal_()  # random KV everywhere: block 0 too
    graphs = StepGraphs(lm.model, pool, block_size=bs, max_model_len=max_len, max_batch_size=8, max_step_tokens=64)
    graphs.disabled_reason, graphs.sizes = None, capture_sizes(8)
    graphs.mixed = mixed_shapes(8, 64)
    graphs._allocate()
    graphs.graphs = {(n, graphs.width): Rerun(graphs, n, graphs.width) for n in graphs.sizes}
    graphs.mixed_graphs = {(t, b): Rerun(graphs, b, graphs.width, t) for t, b in graphs.mixed}
    check_mixed_replays(graphs, lm.model, pool, bs, max_len)
    assert graphs.mixed_graphs[16, 2].replays == 0  # (30,) needs 64 tokens; (5, 1, 1) 16 tokens, 4 sequences
    assert graphs.mixed_graphs[16, 4].replays == 1 and graphs.mixed_graphs[64, 2].replays == 2


def test_static_buffers_on_cpu(tmp_path):
    """The replay path's buffer handling, with `Rerun` in place of CUDA graphs (fp32 Qwen3)."""
    bs, max_len = 16, 256
    lm = load_model(save_tiny_checkpoint("qwen3", tmp_path / "qwen3"), device="cpu", dtype=torch.float32)
    pool = make_pool(lm.model, 160, bs).normal_()  # [layers, blocks, 2, bs, Hkv, D], random KV everywhere
    graphs = StepGraphs(lm.model, pool, block_size=bs, max_model_len=max_len, max_batch_size=8)
    graphs.capture()  # a no-op on CPU
    assert not graphs.graphs
    graphs.disabled_reason, graphs.sizes = None, capture_sizes(8)
    graphs._allocate()
    graphs.graphs = {(n, graphs.width): Rerun(graphs, n, graphs.width) for n in graphs.sizes}
    check_replays(graphs, lm.model, pool, bs, max_len)
    assert all(r.replays for r in graphs.graphs.values() if r.bs in (1, 2, 4, 8))


def test_a_short_context_replays_the_narrowest_graph_that_holds_it(tmp_path, monkeypatch):
    """Widths for short contexts: each step replays the narrowest captured width that holds its
    block tables, and a size captured only at the full width uses that one (CPU, `Rerun`)."""
    monkeypatch.setattr(graphs_module, "SHORT_CONTEXTS", (48, 1024))  # 1024 >= max_model_len: not a width
    bs, max_len = 16, 256
    lm = load_model(save_tiny_checkpoint("qwen3", tmp_path / "qwen3"), device="cpu", dtype=torch.float32)
    pool = make_pool(lm.model, 160, bs).normal_()
    graphs = StepGraphs(lm.model, pool, block_size=bs, max_model_len=max_len, max_batch_size=8)
    assert graphs.widths == [3, 16]
    graphs.disabled_reason, graphs.sizes = None, capture_sizes(8)
    graphs._allocate()
    graphs.graphs = {(n, w): Rerun(graphs, n, w) for n in graphs.sizes for w in graphs.widths if w == 16 or n < 4}
    check_replays(graphs, lm.model, pool, bs, max_len)
    assert graphs.graphs[1, 3].replays == 1 and graphs.graphs[2, 3].replays == 1  # the two short batches
    assert graphs.width_for(1, 3) == 3 and graphs.width_for(1, 4) == 16 and graphs.width_for(4, 1) == 16


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("max_len", [256, 2048])
def test_replay_matches_eager_and_writes_only_live_slots(tmp_path, max_len):
    """fp32 Qwen3 (q/k norm) with random KV everywhere in the pool. At max_model_len 2048 the
    sizes whose decode launch differs at 512 tokens also get a 32-block graph (more, shorter
    splits), which the short batches of check_replays replay. Then the mixed steps'."""
    bs = 16
    lm = load_model(save_tiny_checkpoint("qwen3", tmp_path / "qwen3"), device="cuda", dtype=torch.float32)
    pool = make_pool(lm.model, 8 * max_len // bs + 64, bs).normal_()  # [layers, blocks, 2, bs, Hkv, D]
    graphs = StepGraphs(lm.model, pool, block_size=bs, max_model_len=max_len, max_batch_size=8, max_step_tokens=512)
    graphs.capture()
    assert graphs.enabled, graphs.disabled_reason
    assert graphs.mixed_disabled_reason is None and sorted(graphs.mixed_graphs) == mixed_shapes(8, min(512, max_len))
    assert graphs.width == max_len // bs
    if max_len == 256:
        assert sorted(graphs.graphs) == [(n, max_len // bs) for n in (1, 2, 4, 8)]
    else:
        assert (1, 32) in graphs.graphs and (1, 128) in graphs.graphs
        assert kernels.decode_launch(pool[0], 1, 512) != kernels.decode_launch(pool[0], 1, max_len)
    check_replays(graphs, lm.model, pool, bs, max_len)
    check_mixed_replays(graphs, lm.model, pool, bs, max_len)


def generate_both(path: str, prompts, params, **options):
    """(tokens with graphs, tokens eager, the graphs object) for the same prompts."""
    common = dict(device="cuda", l1="64MiB", l2=0, **options)  # l2=0: not the default 32 GiB pinned per LLM
    llm = LLM(path, **common)
    graphs = llm.engine.runner.graphs
    assert graphs.enabled, graphs.disabled_reason
    with_graphs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    eager_llm = LLM(path, enforce_eager=True, **common)
    assert not eager_llm.engine.runner.graphs.graphs
    eager = [o.token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    eager_llm.close()
    return with_graphs, eager, graphs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n", [3, 5, 8])
def test_fp32_greedy_with_graphs_equals_eager(tiny_llama, n):
    """Decode batches shrink from n to 1 (3, 5, 6, 7 are padded); prefix caching and
    chunked prefill stay on, as in normal serving."""
    prompts = varied_prompts(512, [4 + 9 * i for i in range(n)])
    ours, eager, graphs = generate_both(tiny_llama, prompts, varied_params(n), dtype="float32", max_num_seqs=8)
    assert graphs.sizes == [1, 2, 4, 8]
    assert ours == eager
    assert graphs.replays > 0 and graphs.mixed_replays > 0  # the prompts' step is a mixed graph's


@pytest.mark.gpu
@needs_cuda
def test_batches_larger_than_the_largest_graph_run_eagerly(tiny_llama, monkeypatch):
    monkeypatch.setattr(graphs_module, "MAX_CAPTURE_BATCH", 4)
    prompts = varied_prompts(512, [6 + 7 * i for i in range(7)])
    ours, eager, graphs = generate_both(tiny_llama, prompts, varied_params(7), dtype="float32", max_num_seqs=8)
    assert graphs.sizes == [1, 2, 4]
    assert ours == eager
    # decode batches of 7, 6, 5 ran eagerly, those of 4 and below replayed
    assert graphs.replays > 0


@pytest.mark.gpu
@needs_cuda
def test_bf16_graph_logits_are_close_to_eager(tmp_path, monkeypatch):
    """In bf16 the padded GEMMs and the wider block table (another split count) may round a
    little differently from eager, so compare logits of every decode step rather than tokens."""
    path = str(save_tiny_checkpoint("qwen3", tmp_path / "qwen3", seed=2))
    llm = LLM(path, device="cuda", dtype="bfloat16", l1="64MiB", l2=0, max_num_seqs=8)
    graphs, model = llm.engine.runner.graphs, llm.engine.lm.model
    replay = graphs.run
    rows, agree, worst = 0, 0, 0.0

    def run_both(input_ids, positions, kv_pool, meta):
        nonlocal rows, agree, worst
        ref = model(input_ids, positions, kv_pool, meta)  # eager first: writes the same K/V slots
        out = replay(input_ids, positions, kv_pool, meta)
        if out is not None:
            rows += out.shape[0]
            agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
            worst = max(worst, float((out - ref).abs().max() / ref.abs().max()))
        return out

    monkeypatch.setattr(graphs, "run", run_both)
    prompts = varied_prompts(512, [5, 20, 33, 47, 60])
    llm.generate(prompts, varied_params(5), use_tqdm=False)
    llm.close()
    assert rows > 0 and graphs.replays > 0
    assert agree >= 0.95 * rows, f"argmax agrees on {agree}/{rows} rows"
    assert worst < 0.05, f"largest logit difference {worst:.4f} of the logits' scale"
