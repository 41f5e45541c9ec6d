"""Attention sinks (gpt-oss) in the reference paged kernels, against the formula written out.

A sink is one learned logit per query head that joins the softmax's denominator and nothing else:
out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}). The Triton kernels are held to the
reference under the interpreter (test_kernels_sinks_triton.py) and on the GPU
(test_kernels_sinks_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from tierkv import kernels
from tierkv.kernels import ShapeError
from tierkv.kernels import reference as ref
from tierkv.kernels.testing import cu_seqlens, make_paged


def naive(q, keys, values, positions, scale, sinks, window=None):
    """One sequence, float64, a loop over queries and heads: the sink formula as written."""
    hq, hkv = q.shape[1], keys.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        for h in range(hq):
            lo = 0 if window is None else max(0, p - window + 1)
            k = keys[lo : p + 1, h // (hq // hkv)].double()             # [n, D]
            v = values[lo : p + 1, h // (hq // hkv)].double()
            e = torch.exp(k @ q[i, h].double() * scale)                  # [n]
            out[i, h] = (e @ v) / (e.sum() + torch.exp(sinks[h].double()))
    return out


def _sinks(hq: int, seed: int) -> torch.Tensor:
    # around the size of the scores, so that neither the sink nor the keys dominate
    return 2.0 * torch.randn(hq, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("window", [None, 5])
def test_decode_reference_equals_the_sink_formula(window):
    g = torch.Generator().manual_seed(0)
    lens, hkv, group, d = [1, 9, 30], 2, 3, 16
    pb = make_paged(lens, hkv, d, 4, generator=g)
    q = torch.randn(len(lens), hkv * group, d, generator=g)
    sinks = _sinks(hkv * group, 1)
    got = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.3, window, sinks)
    for b, n in enumerate(lens):
        want = naive(q[b : b + 1], pb.keys[b], pb.values[b], [n - 1], 0.3, sinks, window)
        torch.testing.assert_close(got[b : b + 1].double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 4])
def test_prefill_reference_equals_the_sink_formula(window):
    g = torch.Generator().manual_seed(2)
    lens, q_lens, hkv, group, d = [13, 20], [13, 6], 1, 4, 8
    pb = make_paged(lens, hkv, d, 4, generator=g)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=g)
    sinks = _sinks(hkv * group, 3)
    cu = cu_seqlens(q_lens)
    got = ref.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, 0.5, window, sinks)
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = naive(q[rows], pb.keys[b], pb.values[b], list(range(n - m, n)), 0.5, sinks, window)
        torch.testing.assert_close(got[rows].double(), want, rtol=1e-5, atol=1e-6)


def test_sinks_shrink_the_output_and_none_changes_nothing():
    # a sink only adds to the denominator: the output is the sinkless one times a factor in (0, 1)
    g = torch.Generator().manual_seed(4)
    pb = make_paged([12], 1, 8, 4, generator=g)
    q = torch.randn(1, 2, 8, generator=g)
    plain = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.4)
    assert torch.equal(ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.4, None, None), plain)
    sunk = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.4, None, torch.tensor([0.0, 50.0]))
    ratio = sunk / plain                                                  # [1, 2, 8]
    assert torch.allclose(ratio[0, 0], ratio[0, 0, :1].expand(8)) and 0 < float(ratio[0, 0, 0]) < 1
    assert float(sunk[0, 1].abs().max()) < 1e-12                          # a huge sink takes all the mass


def test_package_passes_sinks_through():
    g = torch.Generator().manual_seed(5)
    pb = make_paged([7, 3], 2, 16, 4, generator=g)
    sinks = _sinks(4, 6)
    q = torch.randn(2, 4, 16, generator=g)
    torch.testing.assert_close(kernels.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.2, sinks=sinks),
                               ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.2, None, sinks))
    cu = cu_seqlens([2, 3])
    qp = torch.randn(5, 4, 16, generator=g)
    torch.testing.assert_close(kernels.paged_prefill(qp, pb.kv, pb.block_tables, cu, pb.seq_lens, 0.2, 3, sinks=sinks),
                               ref.paged_prefill(qp, pb.kv, pb.block_tables, cu, pb.seq_lens, 0.2, 3, sinks))


def test_sinks_in_the_model_dtype_read_as_fp32():
    # a bf16 model holds bf16 sinks (as transformers does): the same logits as their fp32 values
    g = torch.Generator().manual_seed(7)
    pb = make_paged([9, 4], 2, 16, 4, generator=g)
    q = torch.randn(2, 4, 16, generator=g)
    sinks = _sinks(4, 8).to(torch.bfloat16)
    assert torch.equal(ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.2, None, sinks),
                       ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.2, None, sinks.float()))


@pytest.mark.parametrize("sinks, words", [
    (torch.zeros(3), "sinks"),                          # not one per query head
    (torch.zeros(4, dtype=torch.int32), "dtype"),       # logits are floats
    (torch.zeros(2, 2), "sinks"),
    ([0.0] * 4, "torch.Tensor"),
])
def test_bad_sinks_are_refused(sinks, words):
    pb = make_paged([5], 2, 16, 4)
    q = torch.randn(1, 4, 16)
    with pytest.raises(ShapeError, match=words):
        ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 1.0, None, sinks)
    with pytest.raises(ShapeError, match=words):
        ref.paged_prefill(q, pb.kv, pb.block_tables, cu_seqlens([1]), pb.seq_lens, 1.0, None, sinks)
