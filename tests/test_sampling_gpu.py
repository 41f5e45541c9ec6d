"""Sampling on a CUDA GPU: top_k_top_p_filter at Qwen2's vocabulary (151936) and batch 256 against
the sort-based reference on the same GPU, replayed in a CUDA graph, and the engine's Sampler
drawing inside the filtered set."""

from __future__ import annotations

import pytest
import torch
from sampling_cases import safe_top_p

from tierkv.kernels import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]


def _sampling_rows(batch: int, vocab: int, dtype: torch.dtype, seed: int):
    """CUDA logits [batch, vocab] with per-row top_k / top_p: scales 0.5 to 4 (flat to peaked);
    every 8th row rounded to quarters (each value tied thousands of times, so boundaries fall in
    ties); -inf padding columns in others; k from 1 to past V and off (0); p tiny, 1, or halfway
    between two cumulative masses, so the kernel's chunked fp32 sums and the reference's cumsum
    cannot disagree about a token (sampling_cases.safe_top_p)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0]).repeat(batch // 4)
    logits = torch.randn(batch, vocab, generator=g) * scales[:, None]
    logits[1::8] = (logits[1::8] * 4).round() / 4
    logits[2::8, vocab - 1000:] = float("-inf")        # a vocabulary padded past the tokenizer's
    logits = logits.to(dtype).cuda()
    choices = torch.tensor([1, 2, 20, 50, 1000, 32768, vocab - 1, vocab, vocab + 5, 0])
    top_k = choices[torch.randint(len(choices), (batch,), generator=g)]
    top_p = safe_top_p(logits, g)
    top_p[::16], top_p[5::16] = 1e-7, 1.0             # the top run alone; off
    return logits, top_k.cuda(), top_p.cuda()


def _same_filter(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    kept = want != float("-inf")
    assert got.dtype == want.dtype
    assert torch.equal(got != float("-inf"), kept), f"rows differ: {(got != want).any(-1).nonzero()[:, 0].tolist()}"
    assert torch.equal(got[kept], want[kept])
    return kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_top_p_filter_vocab_152k_batch_256(dtype):
    from tierkv.kernels import sampling

    vocab = 151936
    logits, top_k, top_p = _sampling_rows(256, vocab, dtype, seed=1)
    for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
        kept = _same_filter(sampling.top_k_top_p_filter(logits, k, p), ref.top_k_top_p_filter(logits, k, p))
    # the batch spans every regime: a lone token, a few, thousands, the whole vocabulary
    counts = kept.sum(-1)
    assert (counts == 1).any() and (counts == vocab).any() and ((counts > 1000) & (counts < vocab - 1000)).any()


def test_top_k_top_p_filter_replays_in_a_cuda_graph():
    from tierkv.kernels import sampling

    logits, top_k, top_p = _sampling_rows(256, 151936, torch.float32, seed=2)
    sampling.top_k_top_p_filter(logits, top_k, top_p)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampling.top_k_top_p_filter(logits, top_k, top_p)
    for seed in (3, 4):
        for static, fresh in zip((logits, top_k, top_p), _sampling_rows(256, 151936, torch.float32, seed)):
            static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        _same_filter(out, ref.top_k_top_p_filter(logits, top_k, top_p))


def test_sampler_on_cuda_draws_inside_the_filtered_set():
    import tierkv.kernels as K
    from tierkv.engine.sampler import Sampler, SamplingBatch, SamplingParams

    assert K.backend_for(torch.empty(1, device="cuda")) == "triton"
    vocab = 151936
    logits, top_k, top_p = _sampling_rows(64, vocab, torch.float32, seed=5)
    params = [SamplingParams(top_k=int(k) if 0 < k < vocab else 0, top_p=float(p))
              for k, p in zip(top_k.tolist(), top_p.tolist())]
    batch = SamplingBatch.build(params, vocab, "cuda")
    kept = ref.top_k_top_p_filter(logits, batch.top_k, batch.top_p) != float("-inf")
    for _ in range(20):
        tokens = Sampler()(logits, batch).token_ids
        assert kept.gather(1, tokens[:, None]).all()
