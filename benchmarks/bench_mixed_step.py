"""bench_mixed_step: the attention of a mixed step (decodes beside a prompt chunk over cached
histories) as the engine's CUDA graphs replay it, Llama-3.1-8B layer shape, H100/H200 via the device
tool: the one prefill launch the engine makes, the same launch with every sequence on its tall tiles
(before kernels/prefill.py short_rows), the decodes and the chunk launched apart, SDPA for the same
parts, and the HBM floor of the KV bytes at the d2d copy bandwidth of this run; --sweep adds a grid
of packed tiles and splits. Every output is checked against SDPA's. GPU only; ~40 s (~90 s with
--sweep). Writes OUT/bench_mixed_step-<machine>.json.
    python3 benchmarks/bench_mixed_step.py [--out DIR] [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as bk  # noqa: E402  (the pool builder, SDPA and graph timer the kernel benchmark uses)
from common import environment, machine_tag  # noqa: E402

from tierkv.engine.graphs import MIXED_TOKENS, mixed_shape_for, mixed_shapes  # noqa: E402
from tierkv.kernels import decode, prefill  # noqa: E402

# (decodes, chunk tokens, cached tokens each): decodes first and one prompt chunk last, as the
# scheduler orders a step (bench_rounds' hit rounds: 4 decodes and a 140-token chunk over 8K-token
# histories)
MIXED_STEPS = [(4, 140, 8000), (1, 140, 8000), (2, 140, 32000), (16, 128, 4096), (60, 64, 2048)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--sweep", action="store_true", help="also time a grid of packed tiles and splits")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mixed_step needs a CUDA GPU")
    copy_gbps = bk.copy_bandwidth()
    print(f"d2d copy: {copy_gbps:.0f} GB/s (read + written)", flush=True)
    rows = bench_mixed_step(copy_gbps, args.sweep)
    path = os.path.join(args.out, f"bench_mixed_step-{machine_tag()}.json")
    with open(path, "w") as f:
        json.dump(dict(environment=environment(), git_commit=os.environ.get("TIERKV_COMMIT"),
                       d2d_copy_gbps=copy_gbps, mixed_step=rows), f, indent=1)
    print("wrote", path)


def bench_mixed_step(copy_gbps: float, sweep: bool) -> list[dict]:
    """Attention of a mixed step (decodes beside one prompt chunk) laid out as a mixed-step graph
    replays it: the graph's T' >= T tokens and sequences (graphs.mixed_shape_for), one padding
    sequence of the T' - T spare tokens over itself (block 0), empty ones after it. Contenders, all
    replayed in CUDA graphs: the one prefill launch the engine makes (and its tile sweep), the same
    launch with the decodes on its tall tiles too (prefill.short_rows off), the decodes through
    paged_decode plus the chunk alone through paged_prefill (two launches, unpadded), SDPA for the
    same two parts, and the HBM floor of the KV bytes read."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    scale = bk.D**-0.5
    for decodes, chunk, ctx in MIXED_STEPS:
        live = decodes + 1
        t = decodes + chunk
        # the graph the engine replays it in (its padding sequence among the `seqs`)
        tokens, seqs = mixed_shape_for(mixed_shapes(live, MIXED_TOKENS[-1]), t, live)
        pad = tokens - t
        kv, tables, _, k, v = bk.paged_pool(live, ctx + chunk, gen)
        lens_live = [ctx + 1] * decodes + [ctx + chunk]
        q = torch.randn(tokens, bk.HQ, bk.D, device="cuda", dtype=bk.DT, generator=gen)
        # the graph's batch: live sequences, the padding one (block 0), empty ones
        table = torch.zeros(seqs, tables.shape[1], dtype=torch.int32, device="cuda")
        table[:live] = tables
        lens = torch.tensor(lens_live + [pad] + [0] * (seqs - live - 1), dtype=torch.int32, device="cuda")
        cu = torch.tensor([0] + list(range(1, decodes + 1)) + [t] + [tokens] * (seqs - live), dtype=torch.int32,
                          device="cuda")
        engine = lambda: prefill._paged_prefill(q, kv, table, cu, lens, scale)  # noqa: E731
        # the same launch with every sequence on the launch's tiles (before short_rows)
        tall = lambda: prefill._paged_prefill(q, kv, table, cu, lens, scale, short=False)  # noqa: E731
        launch = prefill.choose_launch(tokens, seqs, bk.HQ, bk.HKV, table.shape[1] * bk.PAGE, bk.D, q.device)
        # two launches: the decodes' own kernel over their rows, the chunk alone
        qd, qc = q[:decodes], q[decodes:t]
        cu_c = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
        lens_d, lens_c = lens[:decodes], lens[decodes:live]

        def two_launches():
            out = torch.empty_like(q[:t])
            if decodes:
                out[:decodes] = decode.paged_decode(qd, kv, tables[:decodes], lens_d, scale)
            out[decodes:] = prefill._paged_prefill(qc, kv, tables[decodes:], cu_c, lens_c, scale)
            return out
        # SDPA: the decodes folded (their query heads as rows), the chunk bottom-right causal
        kd, vd = k[:decodes, :, : ctx + 1], v[:decodes, :, : ctx + 1]            # [d, Hkv, ctx + 1, D]
        qf = qd.view(decodes, bk.HKV, bk.HQ // bk.HKV, bk.D)
        qs = qc.view(1, chunk, bk.HQ, bk.D).transpose(1, 2)                            # [1, Hq, chunk, D]
        kc = k[decodes:].repeat_interleave(bk.HQ // bk.HKV, 1)
        vc = v[decodes:].repeat_interleave(bk.HQ // bk.HKV, 1)                         # [1, Hq, ctx + chunk, D]
        mask = causal_lower_right(chunk, ctx + chunk)

        def sdpa_parts():
            outs = [bk.sdpa(qf, kd, vd, scale=scale).reshape(decodes, bk.HQ, bk.D)] if decodes else []
            outs.append(bk.sdpa(qs, kc, vc, attn_mask=mask, scale=scale).transpose(1, 2).reshape(chunk, bk.HQ, bk.D))
            return torch.cat(outs)
        want = sdpa_parts().float()
        err = (engine()[:t].float() - want).abs().max().item()
        err_two = (two_launches().float() - want).abs().max().item()
        err_tall = (tall()[:t].float() - want).abs().max().item()
        kv_bytes = 2 * (decodes * (ctx + 1) + ctx + chunk) * bk.HKV * bk.D * kv.element_size()
        t_engine, t_tall = bk.graph_ms(engine), bk.graph_ms(tall)
        t_two, t_sdpa = bk.graph_ms(two_launches), bk.graph_ms(sdpa_parts)
        t_floor = kv_bytes / (copy_gbps * bk.GB) * 1e3
        row = dict(decodes=decodes, chunk=chunk, context=ctx, graph_tokens=tokens, graph_seqs=seqs,
                   kv_bytes=kv_bytes, launch=dataclasses.asdict(launch), short_rows=prefill.short_rows(launch),
                   engine_ms=t_engine, all_tall_tiles_ms=t_tall, two_launches_ms=t_two, sdpa_parts_ms=t_sdpa,
                   hbm_floor_ms=t_floor,
                   max_abs_diff_vs_sdpa=err, two_launches_max_abs_diff_vs_sdpa=err_two,
                   all_tall_tiles_max_abs_diff_vs_sdpa=err_tall, speedup_vs_all_tall=t_tall / t_engine,
                   ratio_vs_sdpa=t_sdpa / t_engine, two_launches_ratio_vs_sdpa=t_sdpa / t_two,
                   ratio_vs_floor=t_floor / t_engine)
        if sweep:
            row["sweep"] = []
            for bm in (16, 32, 64, 128):
                for mult in (0.5, 1, 2, 4):
                    splits = max(1, int(launch.num_splits * mult))
                    cfg = dict(block_m=bm, pack=True, splits=splits)
                    try:
                        us = 1e3 * bk.graph_ms(lambda: prefill._paged_prefill(
                            q, kv, table, cu, lens, scale, block_m=bm, block_n=64, pack=True, num_splits=splits), 20)
                    except Exception as e:  # a config that does not compile (or fit) is recorded, not fatal
                        row["sweep"].append(dict(cfg, error=str(e)[:200]))
                        continue
                    row["sweep"].append(dict(cfg, us=us))
            best = min((r for r in row["sweep"] if "us" in r), key=lambda r: r["us"])
            row["sweep_best"] = best
        rows.append(row)
        print(f"mixed step {decodes} decodes + {chunk}-token chunk over {ctx} (graph {tokens}x{seqs}): engine "
              f"{1e3 * t_engine:6.1f} us  all tall tiles {1e3 * t_tall:6.1f} us  two launches {1e3 * t_two:6.1f} us  "
              f"sdpa {1e3 * t_sdpa:6.1f} us  floor "
              f"{1e3 * t_floor:5.1f} us  tile {launch.block_m}x{launch.block_n} pack {launch.pack} splits "
              f"{launch.num_splits}  (max|diff| {err:.1e} / {err_two:.1e})"
              + (f"  sweep best {row['sweep_best']}" if sweep else ""), flush=True)
    return rows


if __name__ == "__main__":
    main()
