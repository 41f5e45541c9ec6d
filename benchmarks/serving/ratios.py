"""The comparisons between configurations: each against l1 and against off, the headline pair of
each workload, the L2-hit probe against its floor, and the targets they are read against. It
only reads figures already computed.
"""

from __future__ import annotations


def ratio(x, y):
    return x / y if x is not None and y not in (None, 0) else None


def compare(s_new: dict, s_base: dict) -> dict:
    return {"throughput": ratio(s_new["throughput"]["requests_per_s"], s_base["throughput"]["requests_per_s"]),
            "p50_ttft_ratio": ratio(s_new["ttft_ms"]["p50"], s_base["ttft_ms"]["p50"]),
            "p99_ttft_ratio": ratio(s_new["ttft_ms"]["p99"], s_base["ttft_ms"]["p99"])}


HEADLINE = {"multi_round": ("l1+l2", "l1"), "long_doc": ("l1+l2+disk", "l1"), "shared_prefix": ("l1+l2", "l1")}


def ratios(out: dict, probe: str) -> dict:
    """The issue's key numbers, and every config against l1 and against off."""
    configs, r = out["configs"], {"all_pairs": {}}
    names = {w for c in configs.values() for w in c["workloads"]}
    for w in sorted(names):
        have = {c: configs[c]["workloads"][w] for c in configs if w in configs[c]["workloads"]}
        r["all_pairs"][w] = {f"{c}_vs_{b}": compare(have[c], have[b]) for b in ("l1", "off") if b in have
                             for c in have if c != b}
        new, base = HEADLINE.get(w, ("", ""))
        if new in have and base in have:
            cmp = compare(have[new], have[base])
            r[w] = {f"{new}_vs_{base}_throughput": cmp["throughput"], "p50_ttft_ratio": cmp["p50_ttft_ratio"],
                    "p99_ttft_ratio": cmp["p99_ttft_ratio"]}
    if "unique" in names and {"l1", "off"} <= set(configs) and "unique" in configs["off"]["workloads"]:
        on_vs_off = compare(configs["l1"]["workloads"]["unique"], configs["off"]["workloads"]["unique"])["throughput"]
        r["unique"] = {"on_vs_off": on_vs_off, "on_slower_by": 1 - on_vs_off if on_vs_off else None}
    for name in (probe, "100k"):
        for c in ("l1+l2", "l1+l2+disk", "external"):
            p = (configs.get(c) or {}).get("probes", {}).get(name) or {}
            hit, l1_hit = p.get("l2_hit") or {}, p.get("l1_hit") or {}
            if not hit.get("ttft_over_floor"):
                continue
            suffix = "" if name == probe else "_100k"
            r[f"l2_hit_ttft_over_floor{suffix}"] = hit["ttft_over_floor"]
            # what the L2 hit costs beyond an L1 hit of the same prompt, against the PCIe time of its bytes
            pcie_ms = hit["loaded_bytes"]["l2"] / out["limits"]["h2d_bytes_per_s"] * 1e3
            extra = hit["ttft_ms"] - l1_hit["ttft_ms"] if l1_hit.get("ttft_ms") else None
            r[f"l2_hit_probe{suffix}"] = dict(config=c, tokens=hit["tokens"], ttft_ms=hit["ttft_ms"],
                                              floor_ms=hit["floor_ms"], l1_hit_ttft_ms=l1_hit.get("ttft_ms"),
                                              over_l1_hit_vs_pcie_time=ratio(extra, pcie_ms))
            break
    return r


TARGETS = {"l2_hit_ttft_over_floor": "<= 1.5 (12K tokens)",
           "multi_round": "l1+l2 >= 3x l1 throughput at p99 TTFT ratio <= 1, p50 TTFT ratio <= 0.25",
           "unique": "on_vs_off >= 0.98 (caching costs <= 2% when every lookup misses)"}
