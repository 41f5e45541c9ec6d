"""A workload's figures from its per-request results: TTFT/ITL/TPOT/end-to-end percentiles,
throughput, errors, cached tokens. Pure arithmetic on what the client recorded; it never sends a
request.
"""

from __future__ import annotations

import numpy as np

from .client import Result
from .workloads import Workload


def pct(values, scale: float = 1e3) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = np.asarray(values, dtype=float) * scale
    return {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99)), "mean": float(v.mean())}


def summarize(w: Workload, results: list[Result], duration: float, hits: dict | None) -> dict:
    ok = [r for r in results if r.error is None]
    out_tokens, prompt = sum(r.completion_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    return {
        "planned": w.planned, "requests": len(results), "time_capped": len(results) < w.planned,
        "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:3], "duration_s": duration,
        "throughput": {"requests_per_s": len(ok) / duration, "output_tokens_per_s": out_tokens / duration,
                       "total_tokens_per_s": (prompt + out_tokens) / duration},
        "ttft_ms": pct([r.ttft for r in ok]), "itl_ms": pct([x for r in ok for x in r.itl]),
        "tpot_ms": pct(tpot), "e2e_ms": pct([r.e2e for r in ok]),
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_fraction": cached / prompt if prompt else 0.0,
        "hit_tokens": hits,
        "ttft_samples_ms": [round(r.ttft * 1e3, 2) for r in ok],
    }
