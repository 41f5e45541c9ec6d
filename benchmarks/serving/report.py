"""What a run leaves behind: the JSON (floors and ratios added before each write), the printed
table and the PNG of TTFT CDFs. It formats figures and never computes a new measurement.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from common import write_results

from .floors import add_floors
from .presets import GiB
from .probes import probe_name
from .ratios import ratios
from .workloads import WORKLOADS


def human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def fmt(v, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(out: dict) -> None:
    print(f"\n{'workload':14s} {'config':11s} {'req/s':>7s} {'out tok/s':>9s} {'TTFT p50/p90/p99 ms':>22s} "
          f"{'ITL p50/p99':>12s} {'TPOT':>6s} {'cached':>6s} {'hit l1/l2/l3':>13s} {'x floor':>7s} {'err':>4s}")
    for c, figures in out["configs"].items():
        for w, s in figures["workloads"].items():
            t, i, hits = s["ttft_ms"], s["itl_ms"], s["hit_tokens"]
            total = sum(hits.values()) if hits else 0
            split = "/".join(f"{hits[k] / total:.0%}" for k in ("l1", "l2", "l3")) if total else "-"
            print(f"{w:14s} {c:11s} {s['throughput']['requests_per_s']:7.2f} "
                  f"{s['throughput']['output_tokens_per_s']:9.0f} "
                  f"{fmt(t['p50']):>6s}/{fmt(t['p90']):>6s}/{fmt(t['p99']):>7s} "
                  f"{fmt(i['p50'], '.1f'):>5s}/{fmt(i['p99'], '.1f'):>6s} {fmt(s['tpot_ms']['p50'], '.1f'):>6s} "
                  f"{s['cached_fraction']:6.0%} {split:>13s} "
                  f"{fmt((s.get('floor') or {}).get('ttft_over_floor', {}).get('p50'), '.1f'):>7s} {s['errors']:4d}")
    for c, figures in out["configs"].items():
        for name, p in figures["probes"].items():
            if "skipped" in p:
                print(f"probe {name} in {c}: skipped ({p['skipped']})")
                continue
            line = f"probe {name:>4s} {c:11s} cold {fmt(p['cold']['ttft_ms'])} ms"
            for kind in ("l1_hit", "l2_hit"):
                if kind in p:
                    q = p[kind]
                    line += (f" | {kind} {fmt(q['ttft_ms'], '.1f')} ms (floor {fmt(q.get('floor_ms'), '.1f')} ms, "
                             f"{fmt(q.get('ttft_over_floor'), '.2f')}x; hit {q['hit_tokens']})")
            print(line)
    for k, v in out["ratios"].items():
        if k != "all_pairs":
            print(f"ratio {k}: {json.dumps(rounded(v))}")
    for config, err in out["failed_configs"].items():
        print(f"config {config} failed: {err}")


def rounded(v):
    if isinstance(v, float):
        return round(v, 3)
    return {k: rounded(x) for k, x in v.items()} if isinstance(v, dict) else v


def label_log_axis(axis, lo: float, hi: float) -> None:
    """Readable labels on a log axis showing lo..hi: the default labels minor ticks too when they span
    under a decade ('2x10^2 3x10^2 4x10^2' run into each other), so only major ticks get a plain
    label, at powers of ten where the view holds three of them, else at 1-2-5 (or finer) steps."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    axis.set_minor_formatter(NullFormatter())
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if lo <= 0:  # a log axis shows no zero: leave matplotlib's ticks
        return
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    if sum(lo <= 10.0**e <= hi for e in decades) >= 3:
        axis.set_major_locator(LogLocator(base=10, numticks=6))  # numticks: every other decade on a wide span
        return
    for steps, least in (((1, 2, 5), 3), ((1, 1.5, 2, 3, 5, 7), 2)):
        ticks = [s * 10.0**e for e in decades for s in steps if lo <= s * 10.0**e <= hi]
        if len(ticks) >= least:
            axis.set_major_locator(FixedLocator(ticks))
            return
    axis.set_major_locator(MaxNLocator(nbins=3))  # a span too narrow for any of those steps


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w for w in WORKLOADS if any(w in c["workloads"] for c in out["configs"].values())]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    for ax, w in zip(axes[0], names):
        for c, figures in out["configs"].items():
            xs = np.sort(figures["workloads"].get(w, {}).get("ttft_samples_ms", []))
            if len(xs):
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=c)
        ax.set_xscale("log")
        if ax.lines:
            label_log_axis(ax.xaxis, *ax.get_xlim())  # the view, margins included: ticks may sit there
        ax.set_title(f"{w} (KV {out['sizes']['kv_over_l1'].get(w, 0):.1f}x L1)")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=8)
    fig.suptitle(f"bench_serving: TTFT CDF per config ({out['model']['source']}, {out['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(out: dict, raw: dict, kvb: int, a) -> Path:
    add_floors(out, raw, kvb, probe_name(a.probe_tokens))
    out["ratios"] = ratios(out, probe_name(a.probe_tokens))
    path = write_results("bench_serving", out, a.out)
    if not a.no_plot:
        plot(out, path.with_suffix(".png"))
    return path
