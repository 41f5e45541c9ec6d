"""The Triton fused_moe on a CUDA GPU in bf16, at the MoE shapes of Qwen3-30B-A3B and gpt-oss-20b,
against the fp32 torch reference of the same inputs; and captured in a CUDA graph (no host sync),
replayed with other routing. The router top-k kernel (kernels/router.py) against its reference, in
bf16 and fp32 and in a graph, DeepSeek-V3's group-limited sigmoid router included."""

from __future__ import annotations

import pytest
import torch

from tierkv.kernels import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)"),
]

# (hidden, experts, top-k, intermediate, activation with biases?)
SHAPES = {"qwen3-30b-a3b": (2048, 128, 8, 768, False), "gpt-oss-20b": (2880, 32, 4, 2880, True)}


def _case(shape, tokens, seed=0):
    hidden, experts, k, inter, bias = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g, device="cuda")).bfloat16()  # noqa: E731
    x = rand(tokens, hidden)
    w13, w2 = rand(experts, 2 * inter, hidden, scale=hidden**-0.5), rand(experts, hidden, inter, scale=inter**-0.5)
    logits = torch.randn(tokens, experts, generator=g, device="cuda")
    top, ids = logits.topk(k, dim=-1)
    weights = top.softmax(-1).bfloat16()
    b13 = rand(experts, 2 * inter, scale=0.1) if bias else None
    b2 = rand(experts, hidden, scale=0.1) if bias else None
    return x, w13, w2, ids, weights, ("swigluoai" if bias else "silu"), b13, b2


def _rel(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens,method", [(1, None), (3, "grouped"), (7, "gemv"), (7, None), (256, None),
                                           (2048, None)])
def test_bf16_matches_the_fp32_reference(shape, tokens, method):
    from tierkv.kernels import moe

    x, w13, w2, ids, weights, act, b13, b2 = _case(shape, tokens)
    got = moe.fused_moe(x, w13, w2, ids, weights, act, b13, b2, method=method)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    want = ref.fused_moe(x.float(), w13.float(), w2.float(), ids, weights.float(), act, f32(b13), f32(b2))
    in_bf16 = ref.fused_moe(x, w13, w2, ids, weights, act, b13, b2)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    # the kernel is at least as close to the exact result as transformers' bf16 order is, and close outright
    assert _rel(got, want) <= max(1.5 * _rel(in_bf16, want), 5e-3)
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("down_launch", [(16, 128, 4, 3, 1), (16, 512, 2, 5, None), (32, 256, 4, 4, 3),
                                         (64, 128, 4, 3, 8)])
def test_the_per_pair_path_at_every_down_launch(shape, down_launch):
    from tierkv.kernels import moe

    x, w13, w2, ids, weights, act, b13, b2 = _case(shape, 3)
    got = moe.fused_moe(x, w13, w2, ids, weights, act, b13, b2, method="gemv", down_launch=down_launch)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    want = ref.fused_moe(x.float(), w13.float(), w2.float(), ids, weights.float(), act, f32(b13), f32(b2))
    in_bf16 = ref.fused_moe(x, w13, w2, ids, weights, act, b13, b2)
    assert _rel(got, want) <= max(1.5 * _rel(in_bf16, want), 5e-3)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_per_pair_path_gives_the_same_bits_every_call(shape):
    # whichever of a column tile's k * splits programs arrives last sums the partials, in a fixed
    # order: repeated calls (other programs last each time) must agree to the bit
    from tierkv.kernels import moe

    x, w13, w2, ids, weights, act, b13, b2 = _case(shape, 4)
    calls = [moe.fused_moe(x, w13, w2, ids, weights, act, b13, b2, method="gemv", down_launch=(16, 128, 4, 3, 4))
             for _ in range(20)]
    assert all(torch.equal(c, calls[0]) for c in calls[1:])


def _distinct_logits(tokens, experts, dtype, seed=0):
    """Router logits without ties: each row a permutation of multiples of 1/16 (exact in bf16)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    order = torch.rand(tokens, experts, generator=g, device="cuda").argsort(dim=-1)
    return ((order - experts // 2) / 16).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("router,renormalize,experts,k", [("softmax", True, 128, 8), ("softmax", False, 128, 8),
                                                          ("topk_softmax", False, 32, 4), ("softmax", True, 256, 8)])
@pytest.mark.parametrize("tokens", [1, 300])
def test_router_topk_matches_the_reference(router, renormalize, experts, k, dtype, tokens):
    from tierkv.kernels import router as triton_router

    logits = _distinct_logits(tokens, experts, dtype)
    ids, weights = triton_router.moe_topk(logits, k, router, renormalize)
    want_ids, want_weights = ref.moe_topk(logits, k, router, renormalize)
    assert torch.equal(ids, want_ids)
    # fp32: 1e-6; bf16: one ulp (the exp may differ from torch's in the last fp32 bits)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    torch.testing.assert_close(weights, want_weights, **tol)


def test_router_topk_runs_in_a_cuda_graph():
    from tierkv.kernels import router as triton_router

    logits = _distinct_logits(4, 128, torch.bfloat16)
    triton_router.moe_topk(logits, 8, "softmax", True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = triton_router.moe_topk(logits, 8, "softmax", True)
    logits.copy_(_distinct_logits(4, 128, torch.bfloat16, seed=1))
    graph.replay()
    want_ids, want_weights = triton_router.moe_topk(logits, 8, "softmax", True)
    torch.cuda.synchronize()
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_deepseek_v3_grouped_sigmoid_router_matches_the_reference(tokens):
    # DeepSeek-V3 / Kimi K2: 256 experts in 8 groups, the best 4 groups kept, 8 experts a token. The
    # kernel's sigmoid is torch's on CUDA (libdevice expf, IEEE division), so the choice is exact
    from tierkv.kernels import router as triton_router

    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 256, generator=g, device="cuda")
    bias = 0.5 * torch.randn(256, generator=g, device="cuda")
    grouped = dict(correction_bias=bias, n_group=8, topk_group=4, scale=2.5)
    ids, weights = triton_router.moe_topk(logits, 8, "grouped_sigmoid", True, **grouped)
    want_ids, want_weights = ref.moe_topk(logits, 8, "grouped_sigmoid", True, **grouped)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
    # in a CUDA graph (compiled by the call above), replayed with other logits
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = triton_router.moe_topk(logits, 8, "grouped_sigmoid", True, **grouped)
    logits.copy_(torch.randn(tokens, 256, generator=g, device="cuda"))
    graph.replay()
    want_ids, want_weights = ref.moe_topk(logits, 8, "grouped_sigmoid", True, **grouped)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 64])  # the per-pair path and the sorted, grouped one
def test_runs_in_a_cuda_graph(shape, tokens):
    from tierkv.kernels import moe

    x, w13, w2, ids, weights, act, b13, b2 = _case(shape, tokens)
    static = [x.clone(), ids.clone(), weights.clone()]
    moe.fused_moe(static[0], w13, w2, static[1], static[2], act, b13, b2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(static[0], w13, w2, static[1], static[2], act, b13, b2)
    x2, _, _, ids2, weights2, *_ = _case(shape, tokens, seed=1)
    for buf, new in zip(static, (x2, ids2, weights2)):
        buf.copy_(new)
    graph.replay()
    want = moe.fused_moe(x2, w13, w2, ids2, weights2, act, b13, b2)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("tokens,k,experts", [(1, 8, 128), (256, 8, 128), (2048, 8, 128), (256, 4, 32),
                                              (512, 8, 256)])
def test_the_one_program_sort_equals_the_torch_one(tokens, k, experts):
    from tierkv.kernels import moe

    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.randn(tokens, experts, generator=g, device="cuda").topk(k, dim=-1).indices
    for block_m in (16, 64):
        got = moe.sort_by_expert(ids, experts, block_m, "kernel")
        want = moe.sort_by_expert(ids, experts, block_m, "torch")
        for a, b in zip(got, want):
            assert torch.equal(a, b)
