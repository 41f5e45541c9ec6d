"""A checkpoint's mixture-of-experts tensors -> the parameters of moe.SparseMoE, fused at load.

What checkpoints hold (per layer L, prefix `model.layers.L.mlp.`):
- per expert (Qwen3-MoE and DeepSeek hub checkpoints, and what transformers 5 save_pretrained
  writes for them): `experts.N.gate_proj.weight` [I, H], `experts.N.up_proj.weight` [I, H],
  `experts.N.down_proj.weight` [H, I];
- fused as transformers holds them in memory: `experts.gate_up_proj` [E, 2I, H] (gate rows, then up)
  and `experts.down_proj` [E, H, I];
- gpt-oss (bf16, as transformers saves it): `experts.gate_up_proj` [E, H, 2I] with gate and up
  INTERLEAVED along the last dim (gate = [..., 0::2], up = [..., 1::2]), `experts.gate_up_proj_bias`
  [E, 2I] interleaved alike, `experts.down_proj` [E, I, H], `experts.down_proj_bias` [E, H], and the
  router as `router.weight` / `router.bias`; gpt_oss_* below convert them (MXFP4 `*_blocks` /
  `*_scales` are dequantised by the gpt-oss loading code first);
- the router `gate.weight` [E, H] (+ DeepSeek's `gate.e_score_correction_bias` [E]) and DeepSeek's
  `shared_experts.{gate,up,down}_proj.weight`.
All become moe.py's parameters (its docstring lists them), each rank keeping its slice of every
expert's intermediate features: it is handed each tensor as something to index (a safetensors slice,
or a tensor) and reads only that slice. DeepSeek's router stays fp32, as transformers keeps it. This
file only reads tensors it is handed; it never opens files.
"""

from __future__ import annotations

import re

import torch

from tierkv.errors import ModelLoadError

from .moe import MoESpec
from .parallel import TensorParallel

_PER_EXPERT = re.compile(r"^(.*\.mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.)experts\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)$")
_ROUTER = re.compile(r"^(.*\.mlp\.)(?:gate|router)\.(weight|bias|e_score_correction_bias)$")
_SHARED = re.compile(r"^(.*\.mlp\.)shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")


def gpt_oss_gate_up(w: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate_up_proj [E, H, 2I] (gate, up interleaved) -> [E, 2I, H] (gate rows, then up)."""
    return torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1).transpose(1, 2)


def gpt_oss_gate_up_bias(b: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate_up_proj_bias [E, 2I] (interleaved) -> [E, 2I] (gate, then up)."""
    return torch.cat([b[..., 0::2], b[..., 1::2]], dim=-1)


def gpt_oss_down(w: torch.Tensor) -> torch.Tensor:
    """gpt-oss's down_proj [E, I, H] -> [E, H, I]."""
    return w.transpose(1, 2)


class ExpertWeights:
    """Collects the MoE tensors of a checkpoint, as the loader reads them, into fused parameters.

    claims(name) says whether a checkpoint tensor is one of these; add(name, part) takes it as a
    tensor or a safetensors slice (`f.get_slice(name)`: only this rank's part is read), on any
    device; finish() returns {parameter name: tensor} and fails on anything incomplete.
    """

    def __init__(self, spec: MoESpec, model_type: str, tp: TensorParallel, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.spec, self.tp, self.device, self.dtype = spec, tp, device, dtype
        self.interleaved = model_type == "gpt_oss"
        self.inter = tp.part(spec.moe_intermediate_size)
        self.shared = tp.part(spec.shared_intermediate_size)
        self.ready: dict[str, torch.Tensor] = {}
        self._experts: dict[str, tuple[torch.Tensor, torch.Tensor, set]] = {}  # prefix -> (w13, w2, parts seen)
        self._shared: dict[str, dict[str, torch.Tensor]] = {}

    def claims(self, name: str) -> bool:
        return any(p.match(name) for p in (_PER_EXPERT, _FUSED, _ROUTER, _SHARED))

    def add(self, name: str, part) -> None:
        if m := _ROUTER.match(name):
            prefix, what = m.groups()
            # DeepSeek's router decides in fp32 (transformers keeps gate.weight and the bias fp32)
            fp32 = self.spec.router == "grouped_sigmoid"
            self.ready[f"{prefix}gate.{what}"] = part[:].to(self.device, torch.float32 if fp32 else self.dtype)
        elif m := _PER_EXPERT.match(name):
            self._add_expert(m.group(1), int(m.group(2)), m.group(3), part)
        elif m := _FUSED.match(name):
            self._add_fused(m.group(1), m.group(2), part)
        elif m := _SHARED.match(name):
            self._add_shared(m.group(1), m.group(2), part)
        else:
            raise ModelLoadError(f"{name} is not a mixture-of-experts tensor")

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype).contiguous()

    def _add_expert(self, prefix: str, expert: int, part: str, w) -> None:
        e, inter = self.spec.num_experts, self.inter.stop - self.inter.start
        if expert >= e:
            raise ModelLoadError(f"{prefix}experts.{expert} is past the config's {e} experts")
        if prefix not in self._experts:
            h = self.spec.hidden_size
            self._experts[prefix] = (torch.empty(e, 2 * inter, h, device=self.device, dtype=self.dtype),
                                     torch.empty(e, h, inter, device=self.device, dtype=self.dtype), set())
        w13, w2, seen = self._experts[prefix]
        if part == "down_proj":
            w2[expert] = w[:, self.inter]                               # [H, I_rank]
        else:
            rows = slice(0, inter) if part == "gate_proj" else slice(inter, 2 * inter)
            w13[expert, rows] = w[self.inter]                           # [I_rank, H]
        seen.add((expert, part))
        if len(seen) == 3 * e:
            self.ready[f"{prefix}experts.gate_up_proj"] = w13
            self.ready[f"{prefix}experts.down_proj"] = w2
            del self._experts[prefix]

    def _add_fused(self, prefix: str, what: str, part) -> None:
        full, (first, end) = self.spec.moe_intermediate_size, (self.inter.start, self.inter.stop)
        if what == "down_proj_bias":
            t = part[:]
        elif self.interleaved:  # gpt-oss: this rank's (gate, up) column pairs, then our layout
            if what == "gate_up_proj":
                t = gpt_oss_gate_up(part[:, :, 2 * first: 2 * end])
            elif what == "gate_up_proj_bias":
                t = gpt_oss_gate_up_bias(part[:, 2 * first: 2 * end])
            else:
                t = gpt_oss_down(part[:, first:end])
        elif what == "down_proj":  # [E, H, I]: this rank's input columns
            t = part[:, :, first:end]
        else:  # [E, 2I, H]: this rank's gate rows, then its up rows
            t = torch.cat([part[:, first:end], part[:, full + first: full + end]], dim=1)
        self.ready[f"{prefix}experts.{what}"] = self._cast(t)

    def _add_shared(self, prefix: str, part: str, w) -> None:
        parts = self._shared.setdefault(prefix, {})
        parts[part] = w[:, self.shared] if part == "down_proj" else w[self.shared]
        if len(parts) == 3:
            gate_up = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=0)  # [2 * S_rank, H]
            self.ready[f"{prefix}shared_experts.gate_up_proj.weight"] = self._cast(gate_up)
            self.ready[f"{prefix}shared_experts.down_proj.weight"] = self._cast(parts["down_proj"])
            del self._shared[prefix]

    def finish(self) -> dict[str, torch.Tensor]:
        """Every fused parameter; ModelLoadError naming what a layer lacks."""
        for prefix, (_, _, seen) in self._experts.items():
            missing = sorted({(e, p) for e in range(self.spec.num_experts)
                              for p in ("gate_proj", "up_proj", "down_proj")} - seen)[:5]
            raise ModelLoadError(f"{prefix}experts lacks tensors, e.g. "
                                 + ", ".join(f"experts.{e}.{p}.weight" for e, p in missing))
        for prefix, parts in self._shared.items():
            raise ModelLoadError(f"{prefix}shared_experts has only {sorted(parts)} of gate_proj, up_proj, down_proj")
        return self.ready
