"""One sweep point's figures from what the client recorded: TTFT (from each arrival) / ITL / TPOT /
end-to-end percentiles, throughput, goodput, the SLO verdict, cached tokens and the cache's
per-tier change. Pure arithmetic; it never sends a request.
"""

from __future__ import annotations

import math

import numpy as np

from .client import Result


def pct(values, scale: float = 1e3) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = np.asarray(values, dtype=float) * scale
    return {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99)), "mean": float(v.mean())}


def p99_of_arrivals(results: list[Result]) -> float:
    """p99 TTFT in seconds over every arrival of the point, where one that failed or was cut before
    its first token counts as infinitely late (inf then: the SLO cannot hold); 0 with no arrival."""
    ttfts = [r.ttft if r.ttft is not None else math.inf for r in results]
    return float(np.percentile(ttfts, 99, method="higher")) if ttfts else 0.0


def summarize(rate: float, seconds: float, results: list[Result], span: float, late: float,
              delta: dict | None, slo_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    out_tokens, prompt = sum(r.completion_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    p99 = p99_of_arrivals(results)
    return {
        "offered_rate": rate, "seconds": seconds, "arrivals": len(results), "arrival_rate": len(results) / seconds,
        "completed": len(ok), "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:3],
        "span_s": span, "client_late_ms": late * 1e3,
        "slo_held": p99 <= slo_s, "p99_ttft_ms": p99 * 1e3 if math.isfinite(p99) else None,
        "throughput": {"requests_per_s": len(ok) / span, "output_tokens_per_s": out_tokens / span,
                       "total_tokens_per_s": (prompt + out_tokens) / span},
        "goodput_requests_per_s": sum(r.ttft <= slo_s for r in ok) / span,  # finished with TTFT within the SLO
        "ttft_ms": pct([r.ttft for r in ok]), "itl_ms": pct([x for r in ok for x in r.itl]),
        "tpot_ms": pct(tpot), "e2e_ms": pct([r.e2e for r in ok]),
        "wait_ms": pct([r.wait for r in ok]),  # arrival -> sent (waiting for an idle conversation)
        # Little's law: requests in flight on average, and those past their first token (decoding)
        "mean_in_flight": sum(r.e2e for r in ok) / span,
        "mean_decoding": sum(r.e2e - r.ttft for r in ok) / span,
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_fraction": cached / prompt if prompt else 0.0,
        "output_tokens": out_tokens, "cache": delta,
    }
