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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,context,new_tokens", [(128, 0, 2048), (128, 0, 3001), (128, 5120, 3001),
                                                  (64, 20480, 2500)])
def test_prefill_one_long_sequence_takes_the_dense_path(dtype, d, context, new_tokens):
    # a one-sequence chunk with its cached length known on the host goes through cuDNN (self part
    # causal + prefix part, merged by log-sum-exp); it must equal the reference and the Triton path
    from tierkv.kernels import dense

    _, prefill, _, _ = _kernels()
    g = torch.Generator().manual_seed(11)
    pb = make_paged([context + new_tokens], 8, d, 16, dtype=dtype, device="cuda", generator=g, table_fill=FAR)
    q = torch.randn(new_tokens, 32, d, generator=g).to(dtype).cuda()
    cu = cu_seqlens([new_tokens], "cuda")
    assert dense.applies(q, pb.kv, 1, context, None), "the shape this test is about must take the dense path"
    got = prefill.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5, context=context)
    want = ref.paged_prefill(q.float(), pb.kv.float(), pb.block_tables, cu, pb.seq_lens, d**-0.5)
    _close(got, want, dtype)
    triton_path = prefill.paged_prefill(q, pb.kv, pb.block_tables, cu, pb.seq_lens, d**-0.5)
    _close(triton_path, want, dtype)
    assert got.shape == q.shape and got.dtype == dtype


def test_dense_path_refuses_what_it_cannot_compute():
    from tierkv.kernels import dense

    kv = torch.zeros(4, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.zeros(4096, 32, 128, dtype=torch.bfloat16, device="cuda")
    assert dense.applies(q, kv, 1, 0, None)
    assert not dense.applies(q, kv, 2, 0, None)          # two sequences: the varlen Triton kernel
    assert not dense.applies(q, kv, 1, None, None)       # cached length unknown on the host
    assert dense.applies(q, kv, 1, 3 * dense.ALIGN, None)
    assert not dense.applies(q, kv, 1, 3 * dense.ALIGN + 16, None)   # a context that would need its own plan
    assert not dense.applies(q, kv, 1, 0, 1024)          # sliding window
    assert not dense.applies(q[: dense.MIN_NEW_TOKENS - 1], kv, 1, 0, None)
    assert not dense.applies(q.float(), kv.float(), 1, 0, None)
    assert not dense.applies(torch.zeros(4096, 32, 256, dtype=torch.bfloat16, device="cuda"),
                             torch.zeros(4, 2, 16, 8, 256, dtype=torch.bfloat16, device="cuda"), 1, 0, None)


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


# ---- fused decoder kernels: rms_norm, rope_kv_write, silu_mul against the reference run by torch
# on the same GPU (HF's rounding order), at Llama-3.1-8B sizes: hidden 4096, 32 q / 8 kv heads of
# 128, intermediate 14336, up to 8192 tokens a step.


def _fused():
    from tierkv.kernels import activation, norm, rope

    return norm, rope, activation


def _rounds_like_reference(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the dtype's tolerance of the reference and bitwise equal to it almost everywhere:
    rounding once at the end instead of in HF's order changes about a quarter of the elements,
    a kernel's own fp32 sum, rsqrt or exp a few per ten thousand."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    differ = (got != want).float().mean().item()
    assert differ <= 0.01, f"{differ:.2%} of the elements differ from the reference's rounding"


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(*shape, device="cuda", generator=g)).to(dtype)


def _cos_sin(tokens: int, d: int, dtype: torch.dtype, seed: int):
    """cos, sin [T, D] as CausalLM.rope makes them: fp32 angles of positions up to 128K, then cast."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    positions = torch.randint(0, 131072, (tokens,), device="cuda", generator=g)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qkv(tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """q [T, Hq, D], k, v [T, Hkv, D]: strided views of one qkv GEMM output, as model.Attention has."""
    qkv = _randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, seed=seed)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return qkv, q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (37, 4096), (8192, 4096), (300, 5120)])
def test_rms_norm_hidden_states(dtype, tokens, hidden):
    norm = _fused()[0]
    stream = _randn(tokens, hidden, dtype=dtype, seed=1, scale=4.0)
    attn_out = _randn(tokens, hidden, dtype=dtype, seed=2)
    w = (1 + 0.2 * _randn(hidden, dtype=torch.float32, seed=3)).to(dtype)
    _rounds_like_reference(norm.rms_norm(stream, w, 1e-5), ref.rms_norm(stream, w, 1e-5), dtype)
    got, got_sum = norm.rms_norm(attn_out, w, 1e-5, residual=stream)
    want, want_sum = ref.rms_norm(attn_out, w, 1e-5, residual=stream)
    assert torch.equal(got_sum, want_sum)  # one fp32 add rounded to the dtype, as torch's
    _rounds_like_reference(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_of_strided_qk_heads(dtype):
    # Qwen3's q_norm/k_norm over each head of the qkv GEMM output, without a copy
    norm = _fused()[0]
    _, q, k, _ = _qkv(8192, 32, 8, 128, dtype, seed=4)
    w = (1 + 0.2 * _randn(128, dtype=torch.float32, seed=5)).to(dtype)
    for x in (q, k):
        assert not x.is_contiguous()
        _rounds_like_reference(norm.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 256, 8192])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (28, 4, 128), (9, 3, 64)])
def test_rope_kv_write_bitwise_reference(dtype, tokens, hq, hkv, d):
    # the kernel rounds each product and sum to the dtype as torch does: equal bit for bit
    rope = _fused()[1]
    _, q, k, v = _qkv(tokens, hq, hkv, d, dtype, seed=tokens + hq)
    cos, sin = _cos_sin(tokens, d, dtype, seed=6)
    bs = 16
    num_blocks = tokens // bs + 9
    pool = _randn(2, num_blocks, 2, bs, hkv, d, dtype=dtype, seed=7)  # [layers, nb, 2, bs, Hkv, D]
    g = torch.Generator(device="cuda").manual_seed(8)
    slots = torch.randperm(num_blocks * bs - 1, device="cuda", generator=g)[:tokens]  # never the last slot
    slots[1::7] = -1                                                   # padding rows (one token: none)
    want_pool = pool.clone()
    want_q = ref.rope_kv_write(q, k, v, cos, sin, want_pool[1], slots)
    got_q = rope.rope_kv_write(q, k, v, cos, sin, pool[1], slots)
    torch.cuda.synchronize()
    assert got_q.is_contiguous() and torch.equal(got_q, want_q)
    assert torch.equal(pool, want_pool)


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("tokens", [1, 256, 8192])
@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 128), (8, 4, 256)])
def test_rope_kv_write_qk_norm_bf16(unit_offset, tokens, hq, hkv, d):
    # Qwen3-30B-A3B's heads (32 q, 4 kv of 128) and Gemma 3's D=256, the per-head q/k RMSNorm in the
    # launch: the kernel's fp32 sum of squares runs in another order than torch's, so (as for
    # rms_norm) only almost every element is bitwise; v and every slot not written are exact
    rope, dtype = _fused()[1], torch.bfloat16
    qkv, q, k, v = _qkv(tokens, hq, hkv, d, dtype, seed=tokens + d)
    qkv.mul_(4)                                                        # q/k norm inputs are not unit-scale
    cos, sin = _cos_sin(tokens, d, dtype, seed=19)
    q_norm = (1 + 0.3 * _randn(d, dtype=torch.float32, seed=20)).to(dtype)
    k_norm = (1 + 0.3 * _randn(d, dtype=torch.float32, seed=21)).to(dtype)
    bs = 16
    num_blocks = tokens // bs + 9
    pool = _randn(2, num_blocks, 2, bs, hkv, d, dtype=dtype, seed=22)
    g = torch.Generator(device="cuda").manual_seed(23)
    slots = torch.randperm(num_blocks * bs - 1, device="cuda", generator=g)[:tokens]
    slots[1::7] = -1
    norms = (q_norm, k_norm, 1e-6, unit_offset)
    want_pool = pool.clone()
    want_q = ref.rope_kv_write(q, k, v, cos, sin, want_pool[1], slots, *norms)
    got_q = rope.rope_kv_write(q, k, v, cos, sin, pool[1], slots, *norms)
    torch.cuda.synchronize()
    assert got_q.is_contiguous()
    _rounds_like_reference(got_q, want_q, dtype)
    written = slots[slots >= 0]
    at = (1, written // bs, 0, written % bs)                           # the written K rows [n, Hkv, D]
    _rounds_like_reference(pool[at], want_pool[at], dtype)
    want_pool[at] = pool[at]
    assert torch.equal(pool, want_pool)                                # v, the other layer, unwritten slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,inter", [(1, 14336), (256, 14336), (8192, 14336), (100, 18944)])
def test_silu_mul_intermediate(dtype, tokens, inter):
    activation = _fused()[2]
    gate_up = _randn(tokens, 2 * inter, dtype=dtype, seed=tokens, scale=3.0)
    _rounds_like_reference(activation.silu_mul(gate_up), ref.silu_mul(gate_up), dtype)


def test_silu_mul_strided_rows():
    activation = _fused()[2]
    wide = _randn(513, 2 * 4096 + 64, dtype=torch.bfloat16, seed=9, scale=3.0)
    gate_up = wide[:, 32 : 32 + 2 * 4096]
    _rounds_like_reference(activation.silu_mul(gate_up), ref.silu_mul(gate_up), torch.bfloat16)


def test_package_dispatches_fused_kernels_to_triton():
    import tierkv.kernels as K

    norm, rope, activation = _fused()
    x = torch.empty(2, 8, device="cuda", dtype=torch.bfloat16)
    assert K._impl("rms_norm", x) is norm.rms_norm
    assert K._impl("rope_kv_write", x) is rope.rope_kv_write
    assert K._impl("silu_mul", x) is activation.silu_mul


def _capture(fn, side: torch.cuda.Stream | None = None):
    """fn() captured in a CUDA graph after a warm-up run on a side stream (which compiles the
    kernel), the capture on that same stream (what a launch keeps per stream, made in the warm-up,
    is not made again inside the graph); returns (graph, what the captured call returned: its
    static outputs). A host sync (reading a tensor) inside fn makes the capture itself fail."""
    side = side or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fn()
    return graph, out


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_cuda_graph_replay(residual):
    norm = _fused()[0]
    dtype = torch.bfloat16
    x = _randn(256, 4096, dtype=dtype, seed=10)          # static inputs of the graph
    r = _randn(256, 4096, dtype=dtype, seed=11)
    w = (1 + 0.2 * _randn(4096, dtype=torch.float32, seed=12)).to(dtype)
    graph, out = _capture(lambda: norm.rms_norm(x, w, 1e-5, r if residual else None))
    for seed in (13, 14):
        new_x = _randn(256, 4096, dtype=dtype, seed=seed, scale=3.0)
        new_r = _randn(256, 4096, dtype=dtype, seed=seed + 100)
        x.copy_(new_x)
        r.copy_(new_r)
        graph.replay()
        torch.cuda.synchronize()
        if residual:
            want, want_sum = ref.rms_norm(new_x, w, 1e-5, new_r)
            assert torch.equal(out[1], want_sum)
            _rounds_like_reference(out[0], want, dtype)
        else:
            _rounds_like_reference(out, ref.rms_norm(new_x, w, 1e-5), dtype)


def test_rope_kv_write_cuda_graph_replay():
    rope = _fused()[1]
    dtype, tokens, hq, hkv, d, bs = torch.bfloat16, 256, 32, 8, 128, 16
    qkv, q, k, v = _qkv(tokens, hq, hkv, d, dtype, seed=15)   # static inputs: views of one buffer
    cos, sin = _cos_sin(tokens, d, dtype, seed=16)
    slots = torch.arange(tokens, device="cuda")
    pool = torch.zeros(2, 64, 2, bs, hkv, d, dtype=dtype, device="cuda")
    graph, q_out = _capture(lambda: rope.rope_kv_write(q, k, v, cos, sin, pool[1], slots))
    for seed in (17, 18):
        new_qkv, new_q, new_k, new_v = _qkv(tokens, hq, hkv, d, dtype, seed=seed)
        new_cos, new_sin = _cos_sin(tokens, d, dtype, seed=seed)
        g = torch.Generator(device="cuda").manual_seed(seed)
        new_slots = torch.randperm(64 * bs - 1, device="cuda", generator=g)[:tokens]
        new_slots[::5] = -1
        start = _randn(*pool.shape, dtype=dtype, seed=seed + 1)
        qkv.copy_(new_qkv)
        cos.copy_(new_cos)
        sin.copy_(new_sin)
        slots.copy_(new_slots)
        pool.copy_(start)
        graph.replay()
        want_pool = start.clone()
        want_q = ref.rope_kv_write(new_q, new_k, new_v, new_cos, new_sin, want_pool[1], new_slots)
        torch.cuda.synchronize()
        assert torch.equal(q_out, want_q)
        assert torch.equal(pool, want_pool)


@pytest.mark.parametrize("pdl,steal", [(False, False), (True, False), (True, True)])
def test_decode_cuda_graph_replay(pdl, steal):
    """Split decode replayed in a graph with new queries, K/V and lengths, its merge launched after
    the split kernel or while it runs (programmatic dependent launch: the merge must still wait for
    every partial); and with the programs stealing tiles (forced down to one tile a split): each
    replay must find its ticket counters zeroed by the one before."""
    decode = _kernels()[0]
    dtype, hkv, group, d, bs = torch.bfloat16, 8, 4, 128, 16
    lens = [9000, 300, 4097]
    pb = make_paged(lens, hkv, d, bs, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(22),
                    table_fill=FAR)
    q = _randn(len(lens), hkv * group, d, dtype=dtype, seed=23)              # static inputs of the graph
    kv, seq_lens = pb.kv, pb.seq_lens
    launch = dict(pdl=pdl, steal=steal, steal_launch=(80, 1, 1))
    side = torch.cuda.Stream()  # its ticket counters are made (zeroed) by the warm-up, outside the graph
    graph, out = _capture(lambda: decode._paged_decode(q, kv, pb.block_tables, seq_lens, d**-0.5, **launch), side)
    for seed, new_lens in ((24, [8999, 17, 4097]), (25, [1, 300, 4000])):  # (each within its blocks)
        q.copy_(_randn(*q.shape, dtype=dtype, seed=seed))
        owned = torch.isfinite(kv)  # (slots no sequence owns stay NaN)
        kv.copy_(torch.where(owned, _randn(*kv.shape, dtype=dtype, seed=seed + 1), kv))
        seq_lens.copy_(torch.tensor(new_lens))
        graph.replay()
        want = ref.paged_decode(q.float(), kv.float(), pb.block_tables, seq_lens, d**-0.5)
        torch.cuda.synchronize()
        _close(out, want, dtype)
    if steal:
        with torch.cuda.stream(side):  # the graph's counters: left zero by its last replay
            assert not decode.ticket_counters(q.device, 1).any()


def test_silu_mul_cuda_graph_replay():
    activation = _fused()[2]
    dtype = torch.bfloat16
    gate_up = _randn(256, 2 * 14336, dtype=dtype, seed=19)
    graph, out = _capture(lambda: activation.silu_mul(gate_up))
    for seed in (20, 21):
        new = _randn(256, 2 * 14336, dtype=dtype, seed=seed, scale=3.0)
        gate_up.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        _rounds_like_reference(out, ref.silu_mul(new), dtype)
