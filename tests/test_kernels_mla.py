"""The MLA decode kernel (kernels/mla.py, kernels.reference.mla_decode): the absorbed form equals
multi-head attention over the up-projected keys and values, and the Triton kernel equals the
reference under the Triton interpreter on CPU (fp32, fp16; see interpreted.py). bf16 on the GPU:
test_kernels_mla_gpu.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from interpreted import INTERPRETED, TOL, in_child, kernel_modules, leave_only_the_child_run

from tierkv.kernels import reference as ref
from tierkv.kernels.errors import ShapeError
from tierkv.kernels.testing import make_paged

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)


def latent_case(lens, heads, lat, rope, bs, dtype=torch.float32, seed=0, table_fill=-1):
    """A latent pool of random tokens (NaN where no sequence owns a slot), with random absorbed
    queries: (paged batch, q_latent [B, H, L], q_pe [B, H, R])."""
    g = torch.Generator().manual_seed(seed)
    pb = make_paged(lens, 1, (lat + rope) // 2, bs, dtype=dtype, generator=g, table_fill=table_fill)
    q_latent = torch.randn(len(lens), heads, lat, generator=g).to(dtype)
    q_pe = torch.randn(len(lens), heads, rope, generator=g).to(dtype)
    return pb, q_latent, q_pe


if INTERPRETED:
    pytest.importorskip("triton")

    @pytest.fixture(scope="module")
    def tk():
        return kernel_modules("mla")

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("splits", [1, 3])
    def test_triton_mla_decode_matches_reference(tk, dtype, splits):
        # DeepSeek-like proportions scaled down: L = 32, R = 8 -> D = 20, so c_kv runs 12 features into
        # the V plane and k_pe sits in its last 8; 4 heads (padded to a 16-row tile). Lengths 0, 1,
        # within a block, several blocks; table entries past each sequence are -1 (never read)
        pb, ql, qp = latent_case([0, 1, 13, 16, 45], 4, 32, 8, 16, dtype)
        got = tk.mla._mla_decode(ql, qp, pb.kv, pb.block_tables, pb.seq_lens, 0.3, num_splits=splits, block_n=16)
        want = ref.mla_decode(ql, qp, pb.kv, pb.block_tables, pb.seq_lens, 0.3)
        assert got.dtype == dtype and got.shape == ql.shape
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])

    def test_triton_mla_decode_head_groups_and_many_splits(tk):
        # 80 heads: two programs per sequence (64 + 16 masked rows); 20 splits of one 16-token tile
        # each for 320 tokens, merged 16 at a time (the second round rescales the first); the short
        # sequence leaves most of its splits empty; a page of 32 tokens read in two tiles
        pb, ql, qp = latent_case([320, 33], 80, 64, 16, 32, torch.float16, seed=1)
        got = tk.mla._mla_decode(ql, qp, pb.kv, pb.block_tables, pb.seq_lens, 0.1, num_splits=20, block_n=16)
        want = ref.mla_decode(ql, qp, pb.kv, pb.block_tables, pb.seq_lens, 0.1)
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])

    def test_triton_mla_decode_automatic_launch_and_a_strided_query(tk):
        pb, ql, qp = latent_case([300, 5, 64], 16, 64, 16, 16, torch.float32, seed=2)
        # q_pe as the model hands it over: the rope part of each head's [nope + rope] query row
        qp = torch.cat([torch.zeros(3, 16, 24), qp], dim=-1)[..., 24:]
        got = tk.mla.mla_decode(ql, qp, pb.kv, pb.block_tables, pb.seq_lens, 0.2)
        want = ref.mla_decode(ql, qp, pb.kv, pb.block_tables, pb.seq_lens, 0.2)
        torch.testing.assert_close(got, want, **TOL[torch.float32])


leave_only_the_child_run(globals())


def test_absorbed_decode_equals_attention_over_up_projected_heads():
    """softmax(q . k) v with per-head keys cat(c_kv W_UK^T, k_pe) and values c_kv W_UV^T equals the
    absorbed form: (q_nope W_UK) against c_kv plus q_pe against k_pe, then the latent output times W_UV."""
    heads, lat, rope, nope, vdim = 4, 32, 8, 16, 12
    pb, _, q_pe = latent_case([1, 13, 45], heads, lat, rope, 16)
    g = torch.Generator().manual_seed(7)
    w_uk = torch.randn(heads, nope, lat, generator=g) / lat**0.5     # [H, nope, L]
    w_uv = torch.randn(heads, vdim, lat, generator=g) / lat**0.5     # [H, v, L]
    q_nope = torch.randn(3, heads, nope, generator=g)
    scale = (nope + rope) ** -0.5

    q_latent = torch.einsum("bhn,hnl->bhl", q_nope, w_uk)
    absorbed = torch.einsum("bhl,hvl->bhv", ref.mla_decode(q_latent, q_pe, pb.kv, pb.block_tables, pb.seq_lens, scale),
                            w_uv)
    for b in range(3):
        latent = torch.cat([pb.keys[b][:, 0], pb.values[b][:, 0]], dim=-1)          # [len, L + R]
        c_kv, k_pe = latent.split([lat, rope], dim=-1)
        keys = torch.cat([torch.einsum("tl,hnl->thn", c_kv, w_uk),
                          k_pe[:, None].expand(-1, heads, -1)], dim=-1)              # [len, H, nope + R]
        values = torch.einsum("tl,hvl->thv", c_kv, w_uv)                            # [len, H, v]
        query = torch.cat([q_nope[b], q_pe[b]], dim=-1)                              # [H, nope + R]
        probs = torch.softmax(torch.einsum("hd,thd->ht", query, keys) * scale, dim=-1)
        torch.testing.assert_close(absorbed[b], torch.einsum("ht,thv->hv", probs, values), rtol=1e-5, atol=1e-5)


def test_mla_decode_refuses_a_pool_that_is_not_one_latent_head():
    pb, ql, qp = latent_case([5], 4, 32, 8, 16)
    with pytest.raises(ShapeError, match="kv_lora_rank 32 \\+ rope dim 6"):
        ref.mla_decode(ql, qp[..., :6], pb.kv, pb.block_tables, pb.seq_lens, 1.0)
    two_heads = pb.kv.expand(-1, -1, -1, 2, -1)
    with pytest.raises(ShapeError, match="kv_heads must be 1"):
        ref.mla_decode(ql, qp, two_heads, pb.block_tables, pb.seq_lens, 1.0)


def test_benchmark_script_runs_on_cpu(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_mla_decode import SMOKE_SHAPES, main

    result = json.loads(main(["--smoke", "--out", str(tmp_path)]).read_text())
    assert [(r["batch"], r["context"]) for r in result["decode"]] == SMOKE_SHAPES
    assert all(r["ms"] > 0 and r["latent_bytes"] == r["batch"] * r["context"] * 576 * 4 for r in result["decode"])
    assert all(r["max_abs_err_seq0"] < 1e-5 for r in result["decode"])
