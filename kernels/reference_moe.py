"""Plain-torch mixture-of-experts kernels: the ground truth for kernels/moe.py and router.py, and
what runs on CPU. Re-exported by reference.py, whose rules they follow (the Triton counterpart's
signature; clarity over speed; nothing outside torch).
"""

from __future__ import annotations

import torch

from . import _checks


# Mixture of experts. Expert weights, one layout for every family (the loader converts to it):
#   w13 [E, 2I, H]: expert e's gate rows [0, I) then its up rows [I, 2I), each a Linear weight [out, in]
#   w2  [E, H, I]:  expert e's down projection, a Linear weight [out, in]
#   b13 [E, 2I], b2 [E, H]: optional biases (gpt-oss), laid out like the weights' rows


def moe_activation(gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gate_up [n, 2I] (gate, then up) -> [n, I], each op in gate_up's dtype as transformers does.

    "silu":      silu(gate) * up (Qwen3-MoE, DeepSeek-V3)
    "swigluoai": gpt-oss's clamped SwiGLU: gate = min(gate, limit), up = clamp(up, -limit, limit),
                 (up + 1) * gate * sigmoid(alpha * gate)
    """
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The routed experts of a sparse MoE block: sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    x:            [T, H]
    w13, w2:      [E, 2I, H], [E, H, I] (see the layout above); b13 [E, 2I], b2 [E, H] or None
    topk_ids:     [T, k] int, each row's k distinct experts
    topk_weights: [T, k], fp32 or x's dtype (the router's; a product with it rounds to x's dtype)
    expert_e(v) = (act(v @ w13[e].T + b13[e]) @ w2[e].T + b2[e])
    returns       [T, H] in x's dtype

    A loop over the experts in transformers' order and rounding (each expert's weighted output
    rounded to x's dtype, then index_add), so the CPU engine matches transformers exactly.
    """
    _, _, experts, _, _ = _checks.check_fused_moe(x, w13, w2, topk_ids, topk_weights, activation, b13, b2)
    out = torch.zeros_like(x)
    for e in range(experts):
        tokens, slots = torch.where(topk_ids == e)                        # [n] each
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w13[e].T                                    # [n, 2I]
        if b13 is not None:
            gate_up = gate_up + b13[e]
        down = moe_activation(gate_up, activation, alpha, limit) @ w2[e].T  # [n, H]
        if b2 is not None:
            down = down + b2[e]
        weighted = down * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, weighted.to(x.dtype))
    return out


def moe_topk(logits: torch.Tensor, k: int, router: str = "softmax", renormalize: bool = False,
             correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
             scale: float = 1.0):
    """A MoE router's choice from its logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] in
    logits' dtype), each as transformers computes it:

    "softmax" (Qwen3-MoE): softmax over all experts in fp32, the top k of those probabilities, divided
                  by their sum if renormalize (norm_topk_prob), cast to logits' dtype.
    "topk_softmax" (gpt-oss): the top k logits, then a softmax over those k (in logits' dtype).
    "grouped_sigmoid" (DeepSeek-V3, Kimi K2): scores = sigmoid(logits) in fp32; experts are CHOSEN by
                  scores + correction_bias (e_score_correction_bias), only within the topk_group of
                  n_group groups (E / n_group consecutive experts each) whose two best chosen-scores sum
                  highest; the WEIGHTS are the chosen experts' unbiased scores, divided by their sum
                  + 1e-20 if renormalize, times scale (routed_scaling_factor), cast to logits' dtype.
    """
    _checks.check_moe_topk(logits, k, router, correction_bias, n_group, topk_group, scale)
    if router == "grouped_sigmoid":
        return _grouped_sigmoid(logits, k, renormalize, correction_bias, n_group, topk_group, scale)
    if router == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)            # [T, E]
        weights, ids = torch.topk(probs, k, dim=-1)                           # [T, k] each
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)
    top, ids = torch.topk(logits, k, dim=-1)
    return ids, torch.softmax(top, dim=-1, dtype=top.dtype)


def _grouped_sigmoid(logits, k, renormalize, correction_bias, n_group, topk_group, scale):
    scores = logits.float().sigmoid()                                          # [T, E] fp32
    choice = scores + correction_bias.float()
    groups = choice.view(-1, n_group, logits.shape[1] // n_group)              # [T, G, E/G]
    group_worth = groups.topk(2, dim=-1).values.sum(dim=-1)                    # [T, G]
    best_groups = group_worth.topk(topk_group, dim=-1).indices                 # [T, topk_group]
    keep = torch.zeros_like(group_worth, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = groups.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)
    ids = choice.topk(k, dim=-1).indices                                       # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, (weights * scale).to(logits.dtype)
