"""The Triton paged-attention kernels with attention sinks (gpt-oss) against the torch reference,
on CPU under the Triton interpreter (see interpreted.py: in a normal run this file's one test runs
it again in a child process). Split launches are the point: a sink joins each head's softmax once,
at the merge, and an unsplit launch joins it in the kernel. bf16 runs on the GPU
(test_kernels_sinks_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, TOL, in_child, kernel_modules, leave_only_the_child_run

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)


pytest.importorskip("triton")

from tierkv.kernels import reference as ref  # noqa: E402
from tierkv.kernels.testing import cu_seqlens, make_paged  # noqa: E402


@pytest.fixture(scope="module")
def tk():
    return kernel_modules("decode", "prefill")


def _sinks(hq: int, seed: int) -> torch.Tensor:
    return 2.0 * torch.randn(hq, generator=torch.Generator().manual_seed(seed))


# lengths 0 (nothing to attend: zeros), 1, within and across blocks; windows shorter and longer
# than the sequences; 4 splits leave the short sequences' later splits empty
@pytest.mark.parametrize("splits,window,dtype", [(1, None, torch.float32), (4, None, torch.float32),
                                                 (1, 7, torch.float16), (4, 7, torch.float16)])
def test_decode_with_sinks(tk, splits, window, dtype):
    g = torch.Generator().manual_seed(0)
    lens, hkv, group, d = [0, 1, 20, 77], 2, 4, 16
    pb = make_paged(lens, hkv, d, 16, dtype=dtype, generator=g)
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(dtype)
    sinks = _sinks(hkv * group, 1).to(dtype)  # in the model's dtype, as a model holds them
    got = tk.decode._paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, d**-0.5, window, sinks,
                                  num_splits=splits, block_n=16)
    want = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, d**-0.5, window, sinks)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert not got[0].any()


def test_decode_sink_joins_once_across_splits(tk):
    # a sink as large as the scores: joined once per split instead of once, the output would be
    # several times too small
    g = torch.Generator().manual_seed(2)
    pb = make_paged([64], 1, 16, 16, generator=g)
    q = torch.randn(1, 2, 16, generator=g)
    sinks = torch.tensor([1.0, 3.0])
    want = ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.25, None, sinks)
    for splits in (1, 2, 4):
        got = tk.decode._paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.25, None, sinks,
                                      num_splits=splits, block_n=16)
        torch.testing.assert_close(got, want, **TOL[torch.float32])


# cold prefill, chunk after a cached prefix, one token, an empty request; unsplit and split
# (a short extend over a long prefix), packed GQA rows and one head a row
@pytest.mark.parametrize("splits,pack,window,dtype", [
    (1, None, None, torch.float32), (1, False, 6, torch.float16), (3, True, None, torch.float16),
    (4, False, 37, torch.float32), (2, True, 5, torch.float32)])
def test_prefill_with_sinks(tk, splits, pack, window, dtype):
    g = torch.Generator().manual_seed(3)
    lens, q_lens, hkv, group, d = [70, 40, 20, 9, 5], [1, 17, 20, 5, 0], 1, 4, 32
    pb = make_paged(lens, hkv, d, 16, dtype=dtype, generator=g)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=g).to(dtype)
    cu = cu_seqlens(q_lens)
    sinks = _sinks(hkv * group, 4).to(dtype)
    got = tk.prefill._paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5, window, sinks,
                                    num_splits=splits, pack=pack, block_m=16, block_n=16)
    want = ref.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5, window, sinks)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_public_entries_pass_sinks_to_triton(tk, monkeypatch):
    import tierkv.kernels as K

    monkeypatch.setenv("TIERKV_KERNELS", "triton")
    g = torch.Generator().manual_seed(5)
    pb = make_paged([9, 30], 2, 16, 16, generator=g)
    sinks = _sinks(4, 6)
    q = torch.randn(2, 4, 16, generator=g)
    torch.testing.assert_close(K.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.3, 8, sinks=sinks),
                               ref.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.3, 8, sinks))
    cu = cu_seqlens([3, 4])
    qp = torch.randn(7, 4, 16, generator=g)
    torch.testing.assert_close(K.paged_prefill(qp, pb.kv, pb.block_tables, cu, pb.seq_lens, 0.3, sinks=sinks),
                               ref.paged_prefill(qp, pb.kv, pb.block_tables, cu, pb.seq_lens, 0.3, None, sinks))


leave_only_the_child_run(globals())
