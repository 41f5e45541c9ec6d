"""The Triton kernels on a CUDA GPU, bf16 and fp16, against the fp32 torch reference.

Covers the sizes the CPU interpreter cannot reach (128K-token sequences, batch 256) and checks
that no kernel reads a block-table entry past a sequence's length: those entries hold a block id
far outside the pool, so reading one faults, and unowned pool slots hold NaN.
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

TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}
# outputs of long sequences are averages of many values (|out| ~ 1/sqrt(L)), where an absolute
# tolerance says little, so every comparison also bounds the relative error of the whole output
REL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
FAR = 2**31 - 1  # block id written past each sequence's blocks: a read of it is an illegal address


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all(), "NaN/inf in the output: a kernel read memory it does not own"
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < REL[dtype], f"relative error {rel:.2e} over {REL[dtype]:.0e}"


def _kernels():
    from tierkv.kernels import block_copy, decode, prefill, write

    return decode, prefill, write, block_copy


def _decode_check(lens, hkv, group, d, bs, dtype, window=None, seed=0):
    decode = _kernels()[0]
    g = torch.Generator().manual_seed(seed)
    pb = make_paged(lens, hkv, d, bs, dtype=dtype, device="cuda", generator=g, table_fill=FAR)
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(dtype).cuda()
    got = decode.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, d**-0.5, window)
    want = ref.paged_decode(q.float(), pb.kv.float(), pb.block_tables, pb.seq_lens, d**-0.5, window)
    torch.cuda.synchronize()
    assert got.dtype == dtype
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 32), (128, 64), (256, 16)])
def test_decode_ragged_batch(dtype, d, bs):
    lens = [1, 15, 16, 17, 1000, 4097, 33, 2]
    _decode_check(lens, 8, 4, d, bs, dtype)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_gqa_and_window(group):
    _decode_check([5, 300, 2049], 2, group, 128, 16, torch.bfloat16, window=256)


def test_decode_128k_tokens():
    _decode_check([131072], 8, 4, 128, 16, torch.bfloat16)


def test_decode_batch_256():
    lens = torch.randint(1, 3000, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    _decode_check(lens, 8, 4, 128, 16, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 16), (128, 64)])
def test_prefill_plain_chunked_prefix_hit(dtype, d, bs):
    _, prefill, _, _ = _kernels()
    g = torch.Generator().manual_seed(2)
    lens, q_lens = [700, 2048, 1, 5000, 64], [700, 512, 1, 129, 0]
    pb = make_paged(lens, 4, d, bs, dtype=dtype, device="cuda", generator=g, table_fill=FAR)
    q = torch.randn(sum(q_lens), 16, d, generator=g).to(dtype).cuda()
    cu = cu_seqlens(q_lens, "cuda")
    got = prefill.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5)
    want = ref.paged_prefill(q.float(), pb.kv.float(), pb.block_tables, cu, pb.seq_lens, d**-0.5)
    _close(got, want, dtype)


def test_prefill_long_context_window():
    _, prefill, _, _ = _kernels()
    g = torch.Generator().manual_seed(3)
    lens, q_lens = [33000], [1000]
    pb = make_paged(lens, 2, 128, 16, dtype=torch.bfloat16, device="cuda", generator=g, table_fill=FAR)
    q = torch.randn(1000, 8, 128, generator=g).to(torch.bfloat16).cuda()
    cu = cu_seqlens(q_lens, "cuda")
    for window in (None, 4096):
        got = prefill.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, 128**-0.5, window)
        want = ref.paged_prefill(q.float(), pb.kv.float(), pb.block_tables, cu, pb.seq_lens, 128**-0.5, window)
        _close(got, want, torch.bfloat16)


def test_kv_write_into_layer_view():
    write = _kernels()[2]
    pool = torch.zeros(4, 64, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    want = pool.clone()
    k, v = torch.randn(2, 300, 8, 128, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    write.kv_write(k, v, pool[2], slots)
    ref.kv_write(k, v, want[2], slots)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("pinned", [False, True])
def test_block_gather_scatter(pinned):
    block_copy = _kernels()[3]
    pool = torch.randn(4, 50, 2, 16, 8, 128, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([49, 0, 7, 8, 31], device="cuda")
    staged = torch.empty(5, 4, 2, 16, 8, 128, dtype=torch.bfloat16, pin_memory=pinned,
                         device="cpu" if pinned else "cuda")
    block_copy.gather_blocks(pool, slots, staged)
    torch.cuda.synchronize()
    assert torch.equal(staged.cuda(), pool[:, slots].transpose(0, 1))
    fresh = torch.zeros_like(pool)
    block_copy.scatter_blocks(staged, fresh, slots)
    torch.cuda.synchronize()
    assert torch.equal(fresh[:, slots], pool[:, slots])
    assert int(fresh.count_nonzero()) == int(fresh[:, slots].count_nonzero())


def test_copy_blocks_reads_a_pinned_layer_view():
    block_copy = _kernels()[3]
    host = torch.randn(40, 4, 2, 16, 8, 128).to(torch.bfloat16).pin_memory()  # L2: [slots, layers, ...]
    staging = torch.zeros(64, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    src = torch.tensor([39, 0, 17, 18, 5], device="cuda")
    rows = torch.tensor([63, 2, 3, 10, 0], device="cuda")
    block_copy.copy_blocks(host[:, 2], src, staging, rows)
    torch.cuda.synchronize()
    assert torch.equal(staging[rows].cpu(), host[src.cpu(), 2])
    assert int(staging.count_nonzero()) == int(staging[rows].count_nonzero())


def test_package_dispatches_cuda_to_triton():
    import tierkv.kernels as K

    assert K.backend_for(torch.empty(1, device="cuda")) == "triton"
    pb = make_paged([40], 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(1, 32, 128, device="cuda").to(torch.bfloat16)
    out = K.paged_decode(q, pb.kv, pb.block_tables, pb.seq_lens, 0.1)
    want = ref.paged_decode(q.float(), pb.kv.float(), pb.block_tables, pb.seq_lens, 0.1)
    _close(out, want, torch.bfloat16)


@pytest.mark.parametrize("d,new_tokens", [(128, 3000), (256, 700)])
def test_prefill_long_chunk_tile_shapes(d, new_tokens):
    # d=128: >= 1024 new tokens per sequence and 24 tiles x 32 heads select the 256-row tiles;
    # head_dim 256 the 64x32 ones
    _, prefill, _, _ = _kernels()
    g = torch.Generator().manual_seed(5)
    lens, q_lens = [new_tokens + 77, new_tokens], [new_tokens, new_tokens]
    pb = make_paged(lens, 8, d, 16, dtype=torch.bfloat16, device="cuda", generator=g, table_fill=FAR)
    q = torch.randn(sum(q_lens), 32, d, generator=g).to(torch.bfloat16).cuda()
    cu = cu_seqlens(q_lens, "cuda")
    got = prefill.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5)
    want = ref.paged_prefill(q.float(), pb.kv.float(), pb.block_tables, cu, pb.seq_lens, d**-0.5)
    _close(got, want, torch.bfloat16)


def test_compile_variants_leaves_nothing_to_compile_mid_run():
    # after the engine's start-up compile, batches of every shape run on kernels already built
    import random

    from tierkv import kernels

    _, prefill, _, _ = _kernels()
    hkv, group, d, bs = 8, 4, 128, 16
    pool = torch.zeros(64, 2, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    assert kernels.compile_variants(pool, hkv * group, d**-0.5, {None, 4096}) > 4

    def compiled() -> int:
        return sum(len(c[0]) for c in prefill._prefill_kernel.device_caches.values())

    before = compiled()
    rng = random.Random(0)
    for _ in range(40):
        num_seqs = rng.choice([1, 3, 16])
        q_lens = [rng.choice([1, 2, 7, 30, 65, 300]) for _ in range(num_seqs)]
        lens = [q + rng.choice([0, 40, 700]) for q in q_lens]
        pb = make_paged(lens, hkv, d, bs, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(sum(q_lens), hkv * group, d, device="cuda", dtype=torch.bfloat16)
        prefill.paged_prefill(q, pb.kv, pb.block_tables, cu_seqlens(q_lens, "cuda"), pb.seq_lens, d**-0.5,
                              rng.choice([None, 4096]))
    torch.cuda.synchronize()
    assert compiled() == before
