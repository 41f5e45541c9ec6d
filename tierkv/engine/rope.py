"""RoPE's inverse frequencies and attention factor for a ModelConfig: default, linear, llama3 and
YaRN (transformers' arithmetic, op for op), per layer type where the config has two.

Plain arithmetic on small tensors, computed once at load (CausalLM.reset_rope); never per step.
"""

from __future__ import annotations

import math

import torch

from .layers import yarn_mscale
from .model_config import ModelConfig

def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None, sliding: bool = False) -> torch.Tensor:
    """[rope_dim / 2] fp32 inverse frequencies, with linear, llama3 or YaRN scaling applied; `sliding`:
    those of the sliding-window layers (cfg.sliding_rope's, where it is set)."""
    theta, scaling = cfg.sliding_rope if sliding and cfg.sliding_rope else (cfg.rope_theta, cfg.rope_scaling)
    d = cfg.rope_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    scaling = scaling or {"rope_type": "default"}
    if scaling["rope_type"] == "linear":
        # stretching positions by `factor` == shrinking every frequency by it
        return inv_freq / float(scaling["factor"])
    if scaling["rope_type"] == "llama3":
        # Llama 3.1: long wavelengths (beyond the original context / low_freq_factor) are slowed
        # down by `factor`, short ones kept, and the band between is interpolated smoothly.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(is_medium, smoothed, scaled)
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(scaling, theta, d, cfg.max_position_embeddings, inv_freq)
    return inv_freq


def _yarn_factor(scaling: dict, max_positions: int) -> float:
    # DeepSeek-V3-style configs may leave factor null: the context's growth over the original's
    factor = scaling.get("factor")
    return float(factor) if factor is not None else max_positions / _yarn_original_context(scaling, max_positions)


def _yarn_original_context(scaling: dict, max_positions: int) -> int:
    # left out, it is max_position_embeddings (transformers' standardize_rope_params)
    return scaling.get("original_max_position_embeddings") or max_positions


def _yarn_inv_freq(scaling: dict, theta: float, d: int, max_positions: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters, op for op): frequencies that turn fewer than
    beta_slow times over the original context are interpolated (divided by factor), those that turn
    more than beta_fast times kept, with a linear ramp between (over dims rounded outwards unless
    `truncate` is false, as gpt-oss sets)."""
    factor = _yarn_factor(scaling, max_positions)
    old_ctx = _yarn_original_context(scaling, max_positions)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over old_ctx
        return (d * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = 1.0 / inv_freq  # theta ** (2i / d), as transformers computes it
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (its `attention_factor`, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are set, else mscale(factor));
    1 for every other RoPE."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, cfg.max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)
