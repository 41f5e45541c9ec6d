"""The Triton fused_moe (kernels/moe.py) and router top-k (kernels/router.py) against the torch
reference, run on CPU by the Triton interpreter (see interpreted.py: in a normal run this file's one
test runs it again in a child process). bf16 and the decode/prefill sizes of real models are
GPU-tested (test_kernels_moe_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, TOL, in_child, kernel_modules, leave_only_the_child_run

if not INTERPRETED:
    test_triton_kernels_under_interpreter = in_child(__file__)

pytest.importorskip("triton")

from tierkv.kernels import reference as ref  # noqa: E402


@pytest.fixture(scope="module")
def tk():
    return kernel_modules("moe", "router")


def moe_case(t, h, e, inter, k, dtype, bias=False, seed=0, skew=False):
    """Random inputs of one fused_moe call; `skew` routes most tokens to expert 0 (long runs)."""
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(t, h, generator=g)).to(dtype)
    w13 = (0.3 * torch.randn(e, 2 * inter, h, generator=g)).to(dtype)
    w2 = (0.3 * torch.randn(e, h, inter, generator=g)).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if skew:
        ids[: t * 3 // 4, 0] = 0
        ids[: t * 3 // 4, 1:] = torch.arange(1, k).expand(t * 3 // 4, -1)
    weights = torch.rand(t, k, generator=g).to(dtype)
    b13 = (0.3 * torch.randn(e, 2 * inter, generator=g)).to(dtype) if bias else None
    b2 = (0.3 * torch.randn(e, h, generator=g)).to(dtype) if bias else None
    return x, w13, w2, ids, weights, b13, b2


def _check(tk, case, activation="silu", tiles=None, method=None, **launch):
    x, w13, w2, ids, weights, b13, b2 = case
    got = tk.moe.fused_moe(x, w13, w2, ids, weights, activation, b13, b2, tiles=tiles, method=method, **launch)
    assert got.dtype == x.dtype and got.shape == x.shape
    if x.dtype == torch.float32:
        want = ref.fused_moe(x, w13, w2, ids, weights, activation, b13, b2)
        torch.testing.assert_close(got, want, **TOL[x.dtype])
        return
    # fp16: both round at every step (the kernel sums the k experts in fp32, the reference in fp16),
    # so each is held to the fp32 reference of the same inputs: the kernel must be as close as the
    # fp16 reference is (within fp16's own tolerance on top)
    as32 = [t if t is None or t.dtype == ids.dtype else t.float() for t in case]
    exact = ref.fused_moe(*as32[:5], activation, *as32[5:])
    in_dtype = ref.fused_moe(x, w13, w2, ids, weights, activation, b13, b2).float()
    err, err_ref = (got.float() - exact).abs().max(), (in_dtype - exact).abs().max()
    assert err <= 2 * err_ref + TOL[x.dtype]["atol"], f"kernel error {err:.3g}, the fp16 reference's {err_ref:.3g}"


METHODS = ["grouped", "gemv"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("method,tiles", [("grouped", (16, 16, 16)), ("grouped", (32, 32, 16)), ("gemv", (1, 16, 16))])
def test_silu_matches_the_reference(tk, method, dtype, tiles):
    # hidden and intermediate sizes that are not multiples of the tiles; 9 experts, some unused
    _check(tk, moe_case(11, 40, 9, 24, 3, dtype), tiles=tiles, method=method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swigluoai_with_biases_matches_the_reference(tk, method, dtype):
    _check(tk, moe_case(7, 32, 4, 16, 2, dtype, bias=True), "swigluoai", tiles=(16, 16, 16), method=method)


@pytest.mark.parametrize("method", METHODS)
def test_one_token_and_runs_longer_than_a_tile(tk, method):
    _check(tk, moe_case(1, 32, 8, 16, 4, torch.float32), tiles=(16, 16, 16), method=method)
    _check(tk, moe_case(40, 32, 6, 16, 2, torch.float32, skew=True), tiles=(16, 16, 32), method=method)


@pytest.mark.parametrize("k,down_launch,bias", [(3, (16, 16, 4, 1, 1), False), (3, (32, 64, 4, 2, 1), True),
                                                 (17, (16, 32, 4, 3, 1), True)])
def test_the_per_pair_down_launch_sums_the_k_experts_itself(tk, k, down_launch, bias):
    # one program per (pair, column tile) over the whole intermediate dim (24 = 16 + a partial chunk,
    # or one chunk of 64 with 40 masked); the last to arrive sums the k pairs (k = 17: 32 rows)
    case = moe_case(3, 40, 20, 24, k, torch.float32, bias=bias)
    _check(tk, case, "swigluoai" if bias else "silu", tiles=(1, 16, 16), method="gemv", down_launch=down_launch)


@pytest.mark.parametrize("k,splits,bias", [(3, 2, False), (3, 3, True), (5, 4, True), (17, 2, False)])
def test_the_per_pair_down_launch_splits_the_intermediate_dim(tk, k, splits, bias):
    # inter 40 in BLOCK_K 16 steps: 2 splits are chunks of 32 and 8, 3 of 16, 16, 8; 4 ask for 10 each,
    # which whole steps make 3 chunks of 16, 16, 8 (BLOCK_S 4 with one row masked); each (pair, chunk)
    # program leaves an fp32 partial, the last of the token's k * splits sums them
    case = moe_case(2, 40, 20, 40, k, torch.float32, bias=bias)
    _check(tk, case, "swigluoai" if bias else "silu", tiles=(1, 16, 16), method="gemv",
           down_launch=(16, 16, 4, 2, splits))


def test_the_gate_up_launch_zeroes_the_down_launchs_counters(tk):
    # the down launch's arrival counters come from torch.empty: the gate_up launch before it zeroes
    # them (all 1100 here: more than its 1024-wide stores), else no program would see itself last
    x, w13, w2, ids, _, _, _ = moe_case(1, 32, 4, 16, 2, torch.float32)
    act = torch.empty(2, 16)
    arrived = torch.full((1100,), 7, dtype=torch.int32)
    tk.moe._gate_up_pair_kernel[(2, 1)](x, w13, w13, act, ids.reshape(-1), arrived, arrived.numel(), 32, 16, 2,
                                        x.stride(0), w13.stride(0), w13.stride(1), 0, 1.702, 7.0, HAS_BIAS=False,
                                        ACTIVATION=0, DOT_PREC="ieee", BLOCK_N=16, BLOCK_K=16)
    assert int(arrived.abs().sum()) == 0


def test_the_default_down_launch_splits_until_every_sm_has_programs(tk):
    # 4 SMs under the interpreter: 16 programs wanted; 1 pair * 2 column tiles of 32 doubles to 8 splits
    # (inter 2048 holds 8 chunks of 256), while 8 pairs * 64 tiles need none
    assert tk.moe._down_chunk(1, 64, 2048, (32, 256, 4, 3, None), torch.device("cpu")) == (256, 8)
    assert tk.moe._down_chunk(8, 2048, 768, (32, 256, 4, 3, None), torch.device("cpu")) == (768, 1)
    assert tk.moe._down_chunk(1, 64, 300, (32, 256, 4, 3, None), torch.device("cpu")) == (512, 1)


@pytest.mark.parametrize("tokens", [3, 37])  # the default path and tiles: per-pair for 3 tokens, grouped for 37
def test_routing_weights_in_fp32_and_the_default_choices(tk, tokens):
    x, w13, w2, ids, weights, b13, b2 = moe_case(tokens, 48, 5, 32, 2, torch.float16)
    _check(tk, (x, w13, w2, ids, weights.float(), b13, b2))


@pytest.mark.parametrize("method", ["kernel", "torch"])
def test_sorting_pads_each_experts_run_to_whole_tiles(tk, method):
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]])  # expert 0: pairs 1, 5; expert 1: 3; expert 2: 0, 2, 4
    pairs, tile_expert, total = tk.moe.sort_by_expert(ids, 4, 4, method)
    assert int(total) == 12 and pairs.numel() == tk.moe.padded_rows(6, 4, 4)
    assert pairs.tolist() == [1, 5, 6, 6, 3, 6, 6, 6, 0, 2, 4, 6, 6, 6, 6, 6, 6, 6]
    assert tile_expert.tolist() == [0, 1, 2, 4, 4]


@pytest.mark.parametrize("tokens,k,experts,block_m", [(1, 8, 128, 16), (100, 3, 7, 16), (70, 2, 5, 32),
                                                      (300, 2, 128, 16), (33, 4, 300, 16)])
def test_the_one_program_sort_equals_the_torch_one(tk, tokens, k, experts, block_m):
    # pairs in chunks of 8192 / 2^ceil(log2 E) (10 chunks of 64, 9 of 16): counts carried across
    # chunks; unused experts; a run longer than a tile
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = experts - 1  # one long run
    got = tk.moe.sort_by_expert(ids, experts, block_m, "kernel")
    want = tk.moe.sort_by_expert(ids, experts, block_m, "torch")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def router_logits(tokens, experts, dtype, seed=0):
    """Logits without ties: each row a permutation of multiples of 1/16 (exact in fp16 and bf16)."""
    g = torch.Generator().manual_seed(seed)
    rows = [(torch.randperm(experts, generator=g) - experts // 2) / 16 for _ in range(tokens)]
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("router,renormalize,experts,k", [("softmax", True, 60, 8), ("softmax", False, 128, 8),
                                                          ("topk_softmax", False, 32, 4), ("softmax", True, 5, 5)])
def test_router_topk_matches_the_reference(tk, router, renormalize, experts, k, dtype):
    logits = router_logits(6, experts, dtype)
    ids, weights = tk.router.moe_topk(logits, k, router, renormalize)
    want_ids, want_weights = ref.moe_topk(logits, k, router, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(ids, want_ids)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -10, atol=0)  # fp16: one ulp
    torch.testing.assert_close(weights, want_weights, **tol)


def test_router_ties_go_to_the_lower_expert_id(tk):
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, 0.0]])
    ids, weights = tk.router.moe_topk(logits, 3, "topk_softmax")
    assert ids.tolist() == [[1, 3, 2]]
    assert weights[0, 0] == weights[0, 1] > weights[0, 2]


# (experts, n_group, topk_group, k, renormalize, scale): DeepSeek-V3/Kimi K2; V2-Lite's size in one group;
# groups and group sizes that are not powers of two
@pytest.mark.parametrize("experts,n_group,topk_group,k,renormalize,scale", [
    (256, 8, 4, 8, True, 2.5), (64, 1, 1, 6, True, 1.0), (24, 3, 2, 5, False, 1.0), (30, 5, 3, 4, True, 1.5)])
def test_grouped_sigmoid_router_matches_the_reference(tk, experts, n_group, topk_group, k, renormalize, scale):
    g = torch.Generator().manual_seed(experts)
    logits, bias = torch.randn(7, experts, generator=g), 0.5 * torch.randn(experts, generator=g)
    grouped = dict(correction_bias=bias, n_group=n_group, topk_group=topk_group, scale=scale)
    ids, weights = tk.router.moe_topk(logits, k, "grouped_sigmoid", renormalize, **grouped)
    want_ids, want_weights = ref.moe_topk(logits, k, "grouped_sigmoid", renormalize, **grouped)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)


def test_grouped_sigmoid_ties_go_to_the_lower_group_and_expert_id(tk):
    # 4 groups of 2 experts, all scores 0.5: the bias makes groups 1 and 3 worth 3.0, group 2 2.0
    logits, bias = torch.zeros(1, 8), torch.tensor([0.0, 0.0, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0])
    ids, weights = tk.router.moe_topk(logits, 3, "grouped_sigmoid", True, correction_bias=bias, n_group=4,
                                      topk_group=2)
    assert ids.tolist() == [[2, 3, 6]]
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3))
    ids, weights = tk.router.moe_topk(logits, 2, "grouped_sigmoid", False, correction_bias=bias, n_group=4,
                                      topk_group=1, scale=2.0)
    assert ids.tolist() == [[2, 3]] and weights.tolist() == [[1.0, 1.0]]


def test_router_refuses_bad_arguments(tk):
    from tierkv.kernels import ShapeError

    with pytest.raises(ShapeError, match="k .* must be an int in \\[1, 4\\]"):
        tk.router.moe_topk(torch.zeros(2, 4), 5)
    with pytest.raises(ShapeError, match="router 'sigmoid' is not one of"):
        tk.router.moe_topk(torch.zeros(2, 4), 2, "sigmoid")


leave_only_the_child_run(globals())
