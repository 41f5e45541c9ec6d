"""The comparisons a workload's sweep is read by: each config's goodput against every other's at
the same p99 TTFT SLO, the workload's headline pair, each config's served rate against its bound
at its goodput point, the targets they are read against, and for a disk config the most its disk
could give over recomputing (bounds.disk_ceiling). It only reads figures already computed.
"""

from __future__ import annotations

from .bounds import disk_ceiling, recompute_cost


def ratio(x, y):
    return x / y if x is not None and y not in (None, 0) else None


# the pair each workload is about: (with, against)
HEADLINE = {"multi_round": ("l1+l2", "l1"), "long_doc": ("l1+l2+disk", "l1+l2"),
            "shared_prefix": ("l1+l2", "l1"), "unique": ("l1", "off")}

TARGETS = {"multi_round": "l1+l2 goodput >= 3x l1 at the same p99 TTFT SLO; l1+l2 served >= 0.5x its PCIe bound",
           "long_doc": "l1+l2+disk goodput >= 1.3x l1+l2 at 8K-token documents, >= 2x at 32K (documents outgrow "
                       "L1+L2), and its p99 TTFT at every rate both ran no worse than l1+l2's; disk_ceiling: the most "
                       "this disk can give over recomputing, from the run's cold probes and disk read bandwidth",
           "unique": "l1 goodput >= 0.98x off (caching costs <= 2% when every lookup misses)"}


def ratios(workload: str, configs: dict, limits: dict | None = None, kv_bytes_per_token: int | None = None) -> dict:
    good = {c: f["goodput"]["requests_per_s"] for c, f in configs.items() if "goodput" in f}
    r = {"goodput_pairs": {f"{c}_vs_{b}": ratio(good[c], good[b]) for c in good for b in good if c != b},
         "at_goodput": {c: {k: configs[c]["goodput"].get(k) for k in ("served_over_bound", "binding",
                                                                       "served_over_pcie_bound")} for c in good}}
    new, base = HEADLINE[workload]
    if new in good and base in good:
        r["headline"] = {"pair": f"{new}_vs_{base}", "goodput_ratio": ratio(good[new], good[base]),
                         "p99_ttft_ms_at_common_rates": p99_at_common_rates(configs[new], configs[base])}
    ceiling = disk_ceiling_of(configs.get("l1+l2+disk"), limits, kv_bytes_per_token)
    if ceiling is not None:
        r["disk_ceiling"] = ceiling
    return r


def disk_ceiling_of(disk: dict | None, limits: dict | None, kv_bytes_per_token: int | None) -> dict | None:
    """The disk config's goodput ceiling over recomputing (bounds.disk_ceiling) from its two cold
    probes and the disk's raw read bandwidth measured in the run; None where one is missing."""
    if not disk or not limits or not limits.get("disk_read_bytes_per_s") or not kv_bytes_per_token:
        return None
    cost = recompute_cost(disk.get("cold_probe") or {}, disk.get("cold_probe_short") or {})
    if cost is None:
        return None
    return disk_ceiling(disk["cold_probe"]["tokens"], *cost, kv_bytes_per_token / limits["disk_read_bytes_per_s"])


def p99_at_common_rates(new: dict, base: dict) -> list[dict]:
    """p99 TTFT of both configs at each offered rate both ran (same --start-rate: the same grid),
    and whether `new` held it no worse than `base`."""
    def by_rate(figures):
        return {round(p["offered_rate"], 3): p["p99_ttft_ms"] for p in figures.get("points", [])}

    a, b = by_rate(new), by_rate(base)
    return [{"offered_rate": rate, "p99_ms": a[rate], "base_p99_ms": b[rate], "no_worse": a[rate] <= b[rate]}
            for rate in sorted(a.keys() & b.keys())]
