"""What a run leaves behind, per workload: the JSON (ratios added before each write), the printed
summary and the PNG of goodput and p99 TTFT against the offered rate, one line per config. It
formats figures and never computes a new measurement.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from common import write_results

from .presets import H200, GiB
from .ratios import ratios


def human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def fmt(v, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def rounded(v):
    if isinstance(v, float):
        return round(v, 3)
    return {k: rounded(x) for k, x in v.items()} if isinstance(v, dict) else v


def print_summary(out: dict) -> None:
    print(f"\n{out['workload']['name']}: goodput at p99 TTFT <= {out['slo_ms']:.0f} ms")
    print(f"{'config':11s} {'goodput/s':>9s} {'served/s':>8s} {'p99 ms':>7s} {'bound/s':>8s} {'binds':>7s} "
          f"{'/bound':>6s} {'/pcie':>6s} {'points':>6s}  stopped")
    for c, f in out["configs"].items():
        g = f["goodput"]
        print(f"{c:11s} {g['requests_per_s']:9.2f} {fmt(g.get('served_requests_per_s'), '.2f'):>8s} "
              f"{fmt(g.get('p99_ttft_ms')):>7s} {fmt(g.get('bound_requests_per_s'), '.2f'):>8s} "
              f"{g.get('binding') or '-':>7s} {fmt(g.get('served_over_bound'), '.2f'):>6s} "
              f"{fmt(g.get('served_over_pcie_bound'), '.2f'):>6s} {len(f['points']):6d}  {f['stopped']}")
    print(f"ratios: {json.dumps(rounded(out['ratios']))}")
    for config, err in out["failed_configs"].items():
        print(f"config {config} failed: {err}")


def label_log_axis(axis, lo: float, hi: float) -> None:
    """Plain labels at 1-2-5 steps on a log axis (the default labels minor ticks too, and they
    run into each other on spans under a decade)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    axis.set_minor_formatter(NullFormatter())
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if lo > 0:
        decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
        ticks = [s * 10.0**e for e in decades for s in (1, 2, 5) if lo <= s * 10.0**e <= hi]
        if len(ticks) >= 2:
            axis.set_major_locator(FixedLocator(ticks))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    finite = [p["p99_ttft_ms"] / 1e3 for f in out["configs"].values() for p in f["points"] if p["p99_ttft_ms"]]
    top = 1.5 * max(finite + [out["slo_ms"] / 1e3])  # where a point with an infinite p99 is drawn
    for c, f in out["configs"].items():
        pts = sorted(f["points"], key=lambda p: p["offered_rate"])
        if not pts:
            continue
        rates = [p["offered_rate"] for p in pts]
        line, = left.plot(rates, [p["goodput_requests_per_s"] for p in pts], "o-", label=c)
        if f["goodput"]["requests_per_s"]:
            left.axvline(f["goodput"]["requests_per_s"], color=line.get_color(), ls=":", lw=1)
        p99 = [p["p99_ttft_ms"] / 1e3 if p["p99_ttft_ms"] is not None else top for p in pts]
        right.plot(rates, p99, "-", color=line.get_color(), label=c)
        for r, v, p in zip(rates, p99, pts):
            right.plot(r, v, "o" if p["p99_ttft_ms"] is not None else "x", color=line.get_color())
    lim = max([1.0] + [p["offered_rate"] for f in out["configs"].values() for p in f["points"]]) * 1.1
    left.plot([0, lim], [0, lim], color="0.7", lw=1, label="offered")
    left.set(xlabel="offered rate (requests/s)", ylabel="goodput (requests/s within the SLO)",
             title="goodput (dotted: highest rate holding the SLO)")
    right.axhline(out["slo_ms"] / 1e3, color="0.4", ls="--", lw=1, label="SLO")
    right.set_yscale("log")
    right.set(xlabel="offered rate (requests/s)", ylabel="p99 TTFT (s)", title="p99 TTFT (x: requests cut or failed)")
    if right.lines:
        label_log_axis(right.yaxis, *right.get_ylim())
    for ax in (left, right):
        ax.legend(fontsize=8)
    fig.suptitle(f"bench_serving {out['workload']['name']}: {out['model']['source']}, {out['device']}, "
                 f"KV {out['sizes']['kv_over_l1'] or 0:.1f}x L1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(out: dict, a) -> Path:
    out["ratios"] = ratios(out["workload"]["name"], out["configs"], out["limits"], out["model"]["kv_bytes_per_token"])
    name = out["workload"]["name"]
    if name == "long_doc" and not a.smoke and a.ld_doc_tokens != H200["ld_doc_tokens"]:
        name += f"_{a.ld_doc_tokens // 1000}k"  # a 32K-document run keeps the 8K one's file
    path = write_results(f"bench_serving_{name}", out, a.out)
    if not a.no_plot:
        plot(out, path.with_suffix(".png"))
    return path
