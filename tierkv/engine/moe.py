"""The sparse mixture-of-experts block: a router picks k experts per token, `kernels.fused_moe` runs them.

How to build one (helpers of other families, start here):

    spec = MoESpec.from_hf(hf)               # hf: the parsed config.json; its model_type picks the router
    sparse = moe_layers(hf, num_layers)      # [bool] per layer: True where the layer has this block
    block = SparseMoE(spec, tp)              # tp: the model's TensorParallel
    out = block(x)                           # x [T, hidden] -> [T, hidden], summed over the TP ranks

Routers (`MoESpec.router`), each as transformers computes it:
- "softmax" (qwen3_moe): logits = x @ gate.weight.T; softmax in fp32 over all experts; top-k; divided
  by their sum if norm_topk_prob; cast to x's dtype. (Each router: kernels.moe_topk, one launch.)
- "topk_softmax" (gpt_oss): logits = x @ gate.weight.T + gate.bias; top-k of the logits; softmax over
  those k in x's dtype. Experts have biases and the "swigluoai" activation (clamped SwiGLU, alpha 1.702,
  limit 7.0).
- "grouped_sigmoid" (deepseek_v3): scores = sigmoid(x @ gate.weight.T) in fp32 (gate.weight kept fp32);
  experts are CHOSEN by scores + gate.e_score_correction_bias, only within the topk_group best of
  n_group groups (a group's worth: the sum of its two best biased scores); the WEIGHTS are the unbiased
  scores of the chosen, divided by their sum (+1e-20) if norm_topk_prob, times routed_scaling_factor,
  fp32. Shared experts (moe_intermediate_size * n_shared_experts wide) are added to every token.

Parameters (the names the loader fills; expert_weights.py converts checkpoints to them):
    gate.weight [E, H]; gate.bias [E] (gpt-oss); gate.e_score_correction_bias [E] fp32 (DeepSeek)
    experts.gate_up_proj [E, 2 * I_rank, H]: each expert's gate rows, then its up rows (this rank's)
    experts.down_proj [E, H, I_rank]
    experts.gate_up_proj_bias [E, 2 * I_rank], experts.down_proj_bias [E, H] (gpt-oss)
    shared_experts.gate_up_proj.weight [2 * S_rank, H], shared_experts.down_proj.weight [H, S_rank]

Tensor parallel: every rank holds every expert and the router whole, and its slice of each expert's
intermediate features (and of the shared experts'); its partial sum goes through ONE all-reduce. The
down bias is added on rank 0 only, so that it counts once. This file never reads checkpoints and
never syncs the host (the router and the kernel run on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tierkv import kernels
from tierkv.errors import ConfigError
from tierkv.kernels._checks import grouped_router_problem

from .layers import Linear
from .parallel import TensorParallel

ROUTERS = ("softmax", "topk_softmax", "grouped_sigmoid")
# model_type -> its router; the block's families
ROUTER_OF = {"qwen3_moe": "softmax", "gpt_oss": "topk_softmax", "deepseek_v3": "grouped_sigmoid"}


@dataclass(frozen=True, slots=True)
class MoESpec:
    """One sparse MoE block's shape and routing, from config.json (names as Hugging Face's)."""

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each routed expert's intermediate features
    router: str = "softmax"
    norm_topk_prob: bool = False
    activation: str = "silu"  # kernels.fused_moe's: "silu" or "swigluoai"
    expert_bias: bool = False  # gpt-oss: router and experts have biases
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # 0: no shared experts

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"MoE router {self.router!r} is not one of {', '.join(ROUTERS)}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts "
                              f"{self.num_experts}]")
        if self.router == "grouped_sigmoid":
            problem = grouped_router_problem(self.num_experts, self.num_experts_per_tok, self.n_group, self.topk_group)
            if problem:  # k is the config's num_experts_per_tok
                raise ConfigError(f"this MoE config's groups: {problem}")

    @classmethod
    def from_hf(cls, hf: dict) -> MoESpec:
        """The block of a qwen3_moe, gpt_oss or deepseek_v3 config.json; ConfigError for another."""
        model_type = hf.get("model_type")
        if model_type not in ROUTER_OF:
            raise ConfigError(f"model_type {model_type!r} has no sparse MoE block here; MoE model types: "
                              f"{', '.join(ROUTER_OF)}")
        act = hf.get("hidden_act", "silu")
        if model_type != "gpt_oss" and act != "silu":
            raise ConfigError(f"{model_type} experts with hidden_act {act!r} are not supported (only silu)")
        common = dict(hidden_size=hf["hidden_size"], num_experts_per_tok=hf["num_experts_per_tok"],
                      router=ROUTER_OF[model_type])
        if model_type == "qwen3_moe":
            # hub checkpoints say num_experts; transformers 5 writes num_local_experts
            return cls(**common, num_experts=hf.get("num_experts") or hf["num_local_experts"],
                       moe_intermediate_size=hf["moe_intermediate_size"],
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
        if model_type == "gpt_oss":
            return cls(**common, num_experts=hf["num_local_experts"], moe_intermediate_size=hf["intermediate_size"],
                       activation="swigluoai", expert_bias=True,
                       swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                       swiglu_limit=float(hf.get("swiglu_limit", 7.0)))
        inter = hf["moe_intermediate_size"]
        return cls(**common, num_experts=hf["n_routed_experts"], moe_intermediate_size=inter,
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
                   routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                   shared_intermediate_size=inter * int(hf.get("n_shared_experts") or 0))


def moe_layers(hf: dict, num_layers: int) -> list[bool]:
    """Which layers hold a sparse MoE block (the others a dense MLP), as transformers decides."""
    model_type = hf.get("model_type")
    if model_type == "qwen3_moe":
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        return [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]
    if model_type == "gpt_oss":
        return [True] * num_layers
    if model_type == "deepseek_v3":
        return [i >= int(hf.get("first_k_dense_replace", 0)) for i in range(num_layers)]
    return [False] * num_layers


def check_moe_parallel(spec: MoESpec, size: int) -> None:
    """ConfigError, saying what to change, unless `size` ranks can split each expert's features."""
    for what, n in (("moe_intermediate_size", spec.moe_intermediate_size),
                    ("shared experts' intermediate size", spec.shared_intermediate_size)):
        if n % size:
            raise ConfigError(f"tensor_parallel_size {size} does not divide the {what} {n}; use a size that does")


class Router(nn.Module):
    """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k]) by the spec's router (module docstring)."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        # DeepSeek keeps its router in fp32 (transformers' _keep_in_fp32_modules_strict): the loader does too
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden_size))
        self.bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.expert_bias else None
        grouped = spec.router == "grouped_sigmoid"
        self.e_score_correction_bias = nn.Parameter(torch.empty(spec.num_experts)) if grouped else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        # the choice from the logits: one Triton launch on CUDA, the torch reference on CPU
        if spec.router == "grouped_sigmoid":  # DeepSeek's logits in fp32, whatever x's dtype
            logits = F.linear(x.float(), self.weight.float())                     # [T, E]
            return kernels.moe_topk(logits, spec.num_experts_per_tok, spec.router, spec.norm_topk_prob,
                                    self.e_score_correction_bias, spec.n_group, spec.topk_group,
                                    spec.routed_scaling_factor)
        logits = F.linear(x, self.weight, self.bias)                              # [T, E]
        return kernels.moe_topk(logits, spec.num_experts_per_tok, spec.router, spec.norm_topk_prob)


class Experts(nn.Module):
    """The routed experts' weights in kernels.fused_moe's layout (this rank's intermediate slice)."""

    def __init__(self, spec: MoESpec, inter: int) -> None:
        super().__init__()
        e, h = spec.num_experts, spec.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * inter)) if spec.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, h)) if spec.expert_bias else None


class SharedExperts(nn.Module):
    """Experts every token passes through (DeepSeek): a SwiGLU MLP whose partial output, under
    tensor parallelism, joins the routed experts' before their one all-reduce."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """Router + routed experts (+ shared experts): x [T, hidden] -> [T, hidden] (module docstring)."""

    def __init__(self, spec: MoESpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        check_moe_parallel(spec, tp.size)
        self.spec, self.tp = spec, tp
        self.gate = Router(spec)
        self.experts = Experts(spec, spec.moe_intermediate_size // tp.size)
        shared = spec.shared_intermediate_size // tp.size
        self.shared_experts = SharedExperts(spec.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        ex = self.experts
        down_bias = ex.down_proj_bias if self.tp.rank == 0 else None  # once, not once per rank
        out = kernels.fused_moe(x, ex.gate_up_proj, ex.down_proj, ids, weights, self.spec.activation,
                                ex.gate_up_proj_bias, down_bias, self.spec.swiglu_alpha, self.spec.swiglu_limit)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
