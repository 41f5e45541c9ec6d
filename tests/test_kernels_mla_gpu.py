"""The Triton MLA decode kernel on a CUDA GPU in bf16 against the fp32 reference, at DeepSeek's real
latent (kv_lora_rank 512 + rope 64 = two planes of 288) and sizes the interpreter cannot reach:
long contexts split over many programs, large batches, 128 heads (two head groups). Block-table
entries past each sequence hold a block id far outside the pool (a read faults) and unowned slots
hold NaN, so a kernel reading memory it does not own fails.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_mla import latent_case

from tierkv.kernels import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

FAR = 2**31 - 1


@pytest.mark.parametrize("lens,heads", [
    ([1, 15, 16, 17, 1000, 4097, 33, 2], 16),   # DeepSeek-V2-Lite: 16 heads
    ([32768], 16),                              # one long context: many splits, one merge
    ([5, 3000, 70000], 128),                    # DeepSeek-V3 at TP 1: 128 heads, two head groups
    (torch.randint(1, 3000, (128,), generator=torch.Generator().manual_seed(1)).tolist(), 16),  # batch 128
])
def test_mla_decode_bf16(lens, heads):
    from tierkv.kernels import mla

    pb, ql, qp = latent_case(lens, heads, 512, 64, 16, torch.bfloat16, seed=len(lens), table_fill=FAR)
    kv, tables, seq_lens = pb.kv.cuda(), pb.block_tables.cuda(), pb.seq_lens.cuda()
    scale = 192**-0.5
    got = mla.mla_decode(ql.cuda(), qp.cuda(), kv, tables, seq_lens, scale)
    want = ref.mla_decode(ql.cuda().float(), qp.cuda().float(), kv.float(), tables, seq_lens, scale)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all(), "NaN/inf in the output: the kernel read memory it does not own"
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.2e}"


def test_prefill_variants_of_the_up_projected_heads_compile():
    from tierkv.engine.mla import MLASpec, compile_variants

    spec = MLASpec(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   rope_interleave=True, attention_bias=False, scale=192**-0.5)
    latent_pool = torch.zeros(8, 2, 16, 1, spec.pool_head_dim, dtype=torch.bfloat16, device="cuda")
    assert compile_variants(spec, latent_pool, 16) > 0
