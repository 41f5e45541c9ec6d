"""Top-k / top-p filter cases shared by the sampler, Triton-interpreter and GPU tests.

`oracle_keep` is the filters' definition evaluated directly (fp64, all pairs, no sort), to judge
the sort-based reference. `safe_top_p` picks top_p values halfway between two cumulative masses,
so no fp32 summation order can move a token across the boundary: implementations that sum the
mass differently (a cumsum after a sort, chunked sums in a kernel) must then agree exactly.
"""

from __future__ import annotations

import torch


def oracle_keep(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """[B, V] bool: x stays iff count(row > x) < k (k < 1 or >= V: off) and the fp64 softmax
    mass of row > x is < p (p >= 1: off). O(V^2) per row: for V up to a few thousand."""
    x = logits.double().cpu()
    probs = x.softmax(dim=-1)
    batch, vocab = x.shape
    keep = torch.ones(batch, vocab, dtype=torch.bool)
    for b in range(batch):
        greater = x[b][None, :] > x[b][:, None]          # [V, V]: [i, j] = x_j > x_i
        if top_k is not None and 1 <= int(top_k[b]) < vocab:
            keep[b] &= greater.sum(dim=1) < int(top_k[b])
        if top_p is not None and float(top_p[b]) < 1:
            keep[b] &= greater.double() @ probs[b] < float(top_p[b])
    return keep


def value_groups(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mass (fp64) of each distinct value of `row` [V], largest value first, and the mass before it
    (on row's device: a GPU groups a 152K vocabulary in a blink, a CPU in a tenth of a second)."""
    x = row.double()
    values, inverse = torch.unique(x, sorted=True, return_inverse=True)   # ascending
    mass = torch.zeros(len(values), dtype=torch.float64, device=x.device).index_add_(0, inverse, x.softmax(dim=0))
    mass = mass.flip(0)                                                   # largest value first
    return mass, mass.cumsum(0) - mass


def safe_top_p(logits: torch.Tensor, generator: torch.Generator, min_gap: float = 1e-5) -> torch.Tensor:
    """[B] fp32 top_p, each halfway between the mass before some group of tied values and the mass
    after it (so that group is the last one kept), chosen at random among groups of mass >= 2 * min_gap;
    every cumulative mass of the row is then at least min_gap away from p."""
    out = []
    for row in logits:
        mass, before = value_groups(row)
        eligible = torch.nonzero(mass >= 2 * min_gap)[:, 0]
        # a row without such a group (all mass spread thin) would have no safe p at all
        assert len(eligible) > 0, "no group of tied values carries 2 * min_gap of the mass"
        j = eligible[torch.randint(len(eligible), (1,), generator=generator).item()]
        out.append(float(before[j] + mass[j] / 2))
    return torch.tensor(out, dtype=torch.float32)
