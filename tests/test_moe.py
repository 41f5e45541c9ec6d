"""The sparse MoE block (tierkv/engine/moe.py) and the fused_moe reference against transformers.

Each family's block is compared with transformers' own module (Qwen3MoeSparseMoeBlock, GptOssMLP,
DeepseekV3MoE) built from a tiny config with random weights, the weights copied over through the
loader's conversions (expert_weights.py), outputs in fp32. The reference kernel is compared with a
plain per-token loop. Tensor parallelism: two simulated ranks' partial outputs sum to the whole.
"""

from __future__ import annotations

import pytest
import torch

from tierkv.engine.expert_weights import ExpertWeights
from tierkv.engine.moe import MoESpec, SparseMoE, moe_layers
from tierkv.engine.parallel import TensorParallel
from tierkv.errors import ConfigError
from tierkv.kernels import ShapeError
from tierkv.kernels import reference as ref

TINY = dict(hidden_size=32, num_experts_per_tok=3, hidden_act="silu")


def _hf_config(kind: str):
    from transformers import DeepseekV3Config, GptOssConfig, Qwen3MoeConfig

    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**TINY, num_experts=8, moe_intermediate_size=24, norm_topk_prob=True)
    if kind == "qwen3_moe_unnormed":
        return Qwen3MoeConfig(**TINY, num_experts=8, moe_intermediate_size=24, norm_topk_prob=False)
    if kind == "gpt_oss":
        return GptOssConfig(**TINY, num_local_experts=6, intermediate_size=24)
    if kind == "deepseek_v3":  # 4 groups of 4 experts, the best 2 groups kept, a shared expert of 2x24
        return DeepseekV3Config(**TINY, n_routed_experts=16, moe_intermediate_size=24, n_group=4, topk_group=2,
                                n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    raise ValueError(kind)


def _hf_block(kind: str, seed: int = 0):
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as ds
    import transformers.models.gpt_oss.modeling_gpt_oss as go
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qm

    config = _hf_config(kind)
    cls = {"gpt_oss": go.GptOssMLP, "deepseek_v3": ds.DeepseekV3MoE}.get(kind, qm.Qwen3MoeSparseMoeBlock)
    block = cls(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(block.named_parameters()) + list(block.named_buffers()):
            # router rows far apart so that top-k choices are not near-ties; a correction bias that
            # changes which experts are chosen (DeepSeek)
            scale = 1.0 if ("gate.weight" in name or "router" in name or "correction" in name) else 0.3
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    return config, block


def _state(kind: str, block) -> dict[str, torch.Tensor]:
    """transformers' module state as the checkpoint names it -> our parameters via ExpertWeights."""
    hf = _hf_config(kind).to_dict()
    hf["model_type"] = "qwen3_moe" if kind.startswith("qwen3_moe") else kind
    spec = MoESpec.from_hf(hf)
    return spec, hf["model_type"], {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}


def _ours(kind: str, block, tp: TensorParallel | None = None, fused: bool = False) -> SparseMoE:
    spec, model_type, checkpoint = _state(kind, block)
    tp = tp or TensorParallel()
    weights = ExpertWeights(spec, model_type, tp, torch.device("cpu"), torch.float32)
    for name, tensor in checkpoint.items():
        if name.endswith("experts.gate_up_proj") and model_type != "gpt_oss" and not fused:
            # transformers keeps experts fused in memory; save_pretrained splits them per expert
            # (as hub checkpoints hold them): feed that form, the one real checkpoints have
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)
                weights.add(name.replace("gate_up_proj", f"{e}.gate_proj.weight"), gate)
                weights.add(name.replace("gate_up_proj", f"{e}.up_proj.weight"), up)
            continue
        if name.endswith("experts.down_proj") and model_type != "gpt_oss" and not fused:
            for e, w in enumerate(tensor):
                weights.add(name.replace("down_proj", f"{e}.down_proj.weight"), w)
            continue
        assert weights.claims(name), name
        weights.add(name, tensor)
    block_ours = SparseMoE(spec, tp)
    state = {k.removeprefix("model.layers.0.mlp."): v for k, v in weights.finish().items()}
    block_ours.load_state_dict(state, strict=True)
    return block_ours


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_unnormed", "gpt_oss", "deepseek_v3"])
def test_block_matches_transformers(kind):
    torch.manual_seed(1)
    _, block = _hf_block(kind)
    ours = _ours(kind, block)
    x = 3 * torch.randn(37, TINY["hidden_size"])  # large enough that gpt-oss's clamps bite
    with torch.no_grad():
        want = block(x[None])
        want = (want[0] if isinstance(want, tuple) else want)[0]   # GptOssMLP returns (out, scores)
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if kind == "gpt_oss":  # the clamp must bite somewhere, or the test would not see it
        assert (x @ ours.experts.gate_up_proj.flatten(0, 1).T).abs().max() > 7.0


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_router_matches_transformers(kind):
    _, block = _hf_block(kind)
    ours = _ours(kind, block)
    x = torch.randn(50, TINY["hidden_size"])
    router = block.router if kind == "gpt_oss" else block.gate
    with torch.no_grad():
        _, want_w, want_ids = router(x)
        ids, weights = ours.gate(x)
    # same experts with the same weights (transformers' DeepSeek top-k is unsorted: compare as sets)
    order_want, order_got = want_ids.sort(dim=-1).indices, ids.sort(dim=-1).indices
    assert torch.equal(want_ids.gather(1, order_want), ids.gather(1, order_got))
    torch.testing.assert_close(weights.gather(1, order_got), want_w.gather(1, order_want), rtol=1e-6, atol=1e-6)


def test_deepseek_groups_limit_the_choice():
    # with the correction bias favouring group 0's experts, every token's experts come from at most
    # topk_group groups, and the weights (the unbiased scores) sum to routed_scaling_factor
    _, block = _hf_block("deepseek_v3")
    ours = _ours("deepseek_v3", block)
    ids, weights = ours.gate(torch.randn(64, TINY["hidden_size"]))
    groups = ids // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))


@pytest.mark.parametrize("kind,fused", [("qwen3_moe", False), ("qwen3_moe", True), ("gpt_oss", True),
                                        ("deepseek_v3", False)])
def test_tensor_parallel_partials_sum_to_the_whole(kind, fused):
    # each rank holds every expert's slice of intermediate features (read from per-expert or fused
    # checkpoint tensors); their partial outputs (before the one all-reduce) sum to the unsplit
    # block's, the down bias counted once (rank 0)
    _, block = _hf_block(kind)
    whole = _ours(kind, block)
    x = torch.randn(21, TINY["hidden_size"])
    with torch.no_grad():
        want = whole(x)
        parts = [_ours(kind, block, _RankOnly(r, 2), fused)(x) for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-5)


class _RankOnly(TensorParallel):
    """One rank of `size` with no peers: all_reduce returns this rank's partial sum unchanged."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)

    def all_reduce(self, x):
        return x


def test_moe_layers_follow_the_config():
    qwen = dict(model_type="qwen3_moe", num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert moe_layers(qwen, 6) == [False, True, False, False, False, True]
    assert moe_layers(dict(model_type="deepseek_v3", first_k_dense_replace=2), 4) == [False, False, True, True]
    assert moe_layers(dict(model_type="gpt_oss"), 2) == [True, True]


def test_bad_specs_say_what_to_change():
    with pytest.raises(ConfigError, match="num_experts_per_tok 9"):
        MoESpec(hidden_size=8, num_experts=8, num_experts_per_tok=9, moe_intermediate_size=4)
    with pytest.raises(ConfigError, match="n_group 3"):
        MoESpec(hidden_size=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4,
                router="grouped_sigmoid", n_group=3)
    with pytest.raises(ConfigError, match="does not divide the moe_intermediate_size 6"):
        SparseMoE(MoESpec(hidden_size=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6),
                  TensorParallel(0, 4))


# the reference kernel against a plain per-token loop


def _expert_case(t=13, h=16, e=5, inter=12, k=2, bias=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (0.5 * torch.randn(e, 2 * inter, h, generator=g)).to(dtype)
    w2 = (0.5 * torch.randn(e, h, inter, generator=g)).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    b13 = (0.5 * torch.randn(e, 2 * inter, generator=g)).to(dtype) if bias else None
    b2 = (0.5 * torch.randn(e, h, generator=g)).to(dtype) if bias else None
    return x, w13, w2, ids, weights, b13, b2


def _per_token(x, w13, w2, ids, weights, activation, b13, b2, alpha=1.702, limit=7.0):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e] @ x[t] + (0 if b13 is None else b13[e])
            gate, up = gate_up.chunk(2)
            if activation == "silu":
                act = gate / (1 + torch.exp(-gate)) * up
            else:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate / (1 + torch.exp(-alpha * gate))
            out[t] += weights[t, j] * (w2[e] @ act + (0 if b2 is None else b2[e]))
    return out


@pytest.mark.parametrize("activation,bias", [("silu", False), ("swigluoai", True), ("swigluoai", False)])
def test_reference_fused_moe_matches_a_per_token_loop(activation, bias):
    x, w13, w2, ids, weights, b13, b2 = _expert_case(bias=bias)
    x = 3 * x  # large enough that the swigluoai clamps bite
    got = ref.fused_moe(x, w13, w2, ids, weights, activation, b13, b2)
    want = _per_token(x, w13, w2, ids, weights, activation, b13, b2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_moe_rejects_bad_shapes():
    x, w13, w2, ids, weights, _, _ = _expert_case()
    with pytest.raises(ShapeError, match="w2 must be"):
        ref.fused_moe(x, w13, w2.transpose(1, 2), ids, weights)
    with pytest.raises(ShapeError, match="topk_ids and topk_weights"):
        ref.fused_moe(x, w13, w2, ids[:, :1], weights)
    with pytest.raises(ShapeError, match="activation 'gelu'"):
        ref.fused_moe(x, w13, w2, ids, weights, "gelu")
    with pytest.raises(ShapeError, match="b2 must be"):
        ref.fused_moe(x, w13, w2, ids, weights, "silu", None, torch.zeros(5, 3))


# DeepSeek's group-limited sigmoid router, kernels.moe_topk's "grouped_sigmoid"


def _old_grouped_sigmoid(logits, bias, k, n_group, topk_group, renormalize, scale):
    """engine/moe.py's Router._grouped_sigmoid before kernels.moe_topk took it over, from its fp32 logits on."""
    scores = logits.sigmoid()
    choice = scores + bias.float()
    groups = choice.view(-1, n_group, logits.shape[1] // n_group)
    group_worth = groups.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = group_worth.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_worth, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = groups.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scale


# (experts, n_group, topk_group, k, renormalize, scale): DeepSeek-V3/Kimi K2, V2-Lite's size, tiny ones
GROUPED_CASES = [(256, 8, 4, 8, True, 2.5), (64, 1, 1, 6, True, 1.0), (16, 4, 2, 3, False, 2.5),
                 (30, 5, 3, 4, True, 1.5)]


@pytest.mark.parametrize("experts,n_group,topk_group,k,renormalize,scale", GROUPED_CASES)
def test_reference_grouped_sigmoid_equals_the_old_torch_router(experts, n_group, topk_group, k, renormalize, scale):
    g = torch.Generator().manual_seed(experts)
    logits, bias = torch.randn(41, experts, generator=g), 0.5 * torch.randn(experts, generator=g)
    ids, weights = ref.moe_topk(logits, k, "grouped_sigmoid", renormalize, correction_bias=bias, n_group=n_group,
                                topk_group=topk_group, scale=scale)
    want_ids, want_weights = _old_grouped_sigmoid(logits, bias, k, n_group, topk_group, renormalize, scale)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)   # to the bit


def test_a_config_with_bad_groups_is_refused_at_load_by_the_routers_rule():
    # MoESpec (config.json) and kernels.moe_topk check the groups by the same rule (_checks.grouped_router_problem)
    from tierkv.engine.moe import MoESpec
    from tierkv.errors import ConfigError

    spec = dict(hidden_size=8, num_experts=16, moe_intermediate_size=4, router="grouped_sigmoid")
    MoESpec(**spec, num_experts_per_tok=4, n_group=4, topk_group=1)  # 1 group of 4 holds the 4
    with pytest.raises(ConfigError, match="groups: n_group 3 must divide the 16 experts"):
        MoESpec(**spec, num_experts_per_tok=2, n_group=3)
    with pytest.raises(ConfigError, match="groups: topk_group 1 groups? of 4 experts cannot hold k 5"):
        MoESpec(**spec, num_experts_per_tok=5, n_group=4, topk_group=1)


def test_grouped_sigmoid_refuses_bad_groups():
    logits, bias = torch.zeros(2, 16), torch.zeros(16)
    grouped = dict(router="grouped_sigmoid", correction_bias=bias)
    with pytest.raises(ShapeError, match="n_group 3 must divide the 16 experts"):
        ref.moe_topk(logits, 2, **grouped, n_group=3)
    with pytest.raises(ShapeError, match="n_group 16 must divide the 16 experts into groups of two or more"):
        ref.moe_topk(logits, 2, **grouped, n_group=16)
    with pytest.raises(ShapeError, match="topk_group 5 must be in \\[1, n_group 4\\]"):
        ref.moe_topk(logits, 2, **grouped, n_group=4, topk_group=5)
    with pytest.raises(ShapeError, match="topk_group 1 groups? of 4 experts cannot hold k 5"):
        ref.moe_topk(logits, 5, **grouped, n_group=4, topk_group=1)
    with pytest.raises(ShapeError, match="needs correction_bias"):
        ref.moe_topk(logits, 2, "grouped_sigmoid", n_group=4)
    with pytest.raises(ShapeError, match="correction_bias must be \\[16\\]"):
        ref.moe_topk(logits, 2, "grouped_sigmoid", correction_bias=torch.zeros(8), n_group=4)
    with pytest.raises(ShapeError, match="apply to router 'grouped_sigmoid' only"):
        ref.moe_topk(logits, 2, "softmax", correction_bias=bias)


def test_bench_moe_runs_its_smoke_case(tmp_path):
    # benchmarks/bench_moe.py on CPU (tiny shapes through the reference): the script the lead runs on
    # the H200 keeps working, and its JSON holds a row per shape and batch
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_moe import BATCHES, SMOKE_SHAPES, main

    main(["--smoke", "--out", str(tmp_path)])
    (written,) = tmp_path.glob("bench_moe-*.json")  # named after the machine
    rows = json.loads(written.read_text())["rows"]
    assert [(r["shape"], r["batch"]) for r in rows] == [(s, b) for s in SMOKE_SHAPES for b in BATCHES]
    assert all(r["weight_bytes"] > 0 and r["backend"] == "reference" for r in rows)
