"""Attention sinks (gpt-oss) in the Triton and cuDNN paths on a CUDA GPU, bf16, against the fp32
torch reference: gpt-oss-20b's heads (64 q on 8 kv, d=64), its 128-token window, long contexts
whose decode splits many ways, and the dense (cuDNN) long-chunk path of full-attention layers.
"""

from __future__ import annotations

import pytest
import torch

from tierkv.kernels import reference as ref
from tierkv.kernels.testing import cu_seqlens, make_paged

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

TOL = dict(rtol=1.6e-2, atol=1e-2)
FAR = 2**31 - 1  # block id past each sequence's blocks: reading one faults
HKV, GROUP, D = 8, 8, 64


def _sinks(seed: int) -> torch.Tensor:
    return 2.0 * torch.randn(HKV * GROUP, generator=torch.Generator().manual_seed(seed)).cuda()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, **TOL)
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.2e}"


@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("lens", [[1, 15, 200, 4097, 33], [100_000]])
def test_decode_with_sinks(window, lens):
    from tierkv.kernels import decode

    g = torch.Generator().manual_seed(0)
    pb = make_paged(lens, HKV, D, 16, dtype=torch.bfloat16, device="cuda", generator=g, table_fill=FAR)
    q = torch.randn(len(lens), HKV * GROUP, D, generator=g).to(torch.bfloat16).cuda()
    sinks = _sinks(1)
    got = decode.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, D**-0.5, window, sinks)
    want = ref.paged_decode(q.float(), pb.kv.float(), pb.block_tables, pb.seq_lens, D**-0.5, window, sinks)
    _close(got, want)


@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("lens,q_lens", [([3000, 700, 9], [3000, 300, 9]), ([20_000], [3])])
def test_prefill_with_sinks(window, lens, q_lens):
    from tierkv.kernels import prefill

    g = torch.Generator().manual_seed(2)
    pb = make_paged(lens, HKV, D, 16, dtype=torch.bfloat16, device="cuda", generator=g, table_fill=FAR)
    q = torch.randn(sum(q_lens), HKV * GROUP, D, generator=g).to(torch.bfloat16).cuda()
    cu = cu_seqlens(q_lens, "cuda")
    sinks = _sinks(3)
    got = prefill.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, D**-0.5, window, sinks=sinks)
    want = ref.paged_prefill(q.float(), pb.kv.float(), pb.block_tables, cu, pb.seq_lens, D**-0.5, window, sinks)
    _close(got, want)


@pytest.mark.parametrize("context,new_tokens", [(0, 3001), (5120, 2500)])
def test_dense_path_with_sinks(context, new_tokens):
    from tierkv.kernels import dense, prefill

    g = torch.Generator().manual_seed(4)
    pb = make_paged([context + new_tokens], HKV, D, 16, dtype=torch.bfloat16, device="cuda", generator=g,
                    table_fill=FAR)
    q = torch.randn(new_tokens, HKV * GROUP, D, generator=g).to(torch.bfloat16).cuda()
    cu = cu_seqlens([new_tokens], "cuda")
    sinks = _sinks(5)
    assert dense.applies(q, pb.kv, 1, context, None)
    got = prefill.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, D**-0.5, context=context, sinks=sinks)
    want = ref.paged_prefill(q.float(), pb.kv.float(), pb.block_tables, cu, pb.seq_lens, D**-0.5, None, sinks)
    _close(got, want)


def test_compile_variants_cover_the_sink_kernels():
    from tierkv import kernels
    from tierkv.kernels import prefill

    pool = torch.zeros(64, 2, 16, HKV, D, dtype=torch.bfloat16, device="cuda")
    assert kernels.compile_variants(pool, HKV * GROUP, D**-0.5, {None, 128}, sinks=True) > 4

    def compiled() -> int:
        return sum(len(c[0]) for c in prefill._prefill_kernel.device_caches.values())

    before = compiled()
    sinks = _sinks(6).to(torch.bfloat16)  # a bf16 model's sinks: the variants compiled above
    for q_lens, ctx, window in (([1, 7, 300], 40, None), ([3], 5000, 128), ([65] * 16, 0, 128)):
        lens = [n + ctx for n in q_lens]
        pb = make_paged(lens, HKV, D, 16, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(sum(q_lens), HKV * GROUP, D, device="cuda", dtype=torch.bfloat16)
        prefill.paged_prefill(q, pb.kv, pb.block_tables, cu_seqlens(q_lens, "cuda"), pb.seq_lens, D**-0.5, window,
                              sinks=sinks)
    torch.cuda.synchronize()
    assert compiled() == before
