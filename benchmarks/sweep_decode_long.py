"""Paged decode of long contexts (1x128K, 1x32K, 2x64K; Llama-3.1-8B layer) in CUDA graphs against
SDPA on the same K/V made contiguous (the faster of its GQA and folded calls), also in graphs.

Two questions behind issue 40 item 4 (>= 1.0x SDPA at 1x128K):
- launches: does any (splits, tokens per tile, warps, stages) read faster than the one chosen?
- layout: the pool is block-major ([blocks, 2, 16, Hkv, D]: a kv head's row of a token is 256 bytes
  among the other heads' rows) and a sequence's blocks lie anywhere. The chosen launch also reads
  the same K/V with its blocks in order, and head-major ([blocks, 2, Hkv, 16, D] in memory, passed
  as strides: the kernel is unchanged), to tell what the layout costs against SDPA's streams.
- the merge's launch: after the split kernel, or while it runs (programmatic dependent launch).
- work stealing: programs that read a fixed share of a long sequence's tiles and take the rest by
  ticket, against fixed splits (with the split kernel also timed alone), for several shares and
  chunk sizes.
Every output is checked against SDPA's. GPU only; ~2 min on an H100 (--no-grid: the chosen
launch's variants only, ~30 s).
    python3 benchmarks/sweep_decode_long.py [--out DIR] [--no-grid] [--shapes 1x131072,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as bk  # noqa: E402  (the pool builder, SDPA and graph timer the kernel benchmark uses)
from common import environment, machine_tag  # noqa: E402

from tierkv.kernels import decode  # noqa: E402

SHAPES = [(1, 131072), (1, 32768), (2, 65536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--no-grid", action="store_true", help="skip the grid of launches")
    ap.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES), help="e.g. 1x131072,2x65536")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    results = [sweep_shape(batch, length, gen, not args.no_grid) for batch, length in shapes]
    path = os.path.join(args.out, f"sweep_decode_long-{machine_tag()}.json")
    with open(path, "w") as f:
        json.dump(dict(environment=environment(), shapes=results), f, indent=1)
    print("wrote", path)


STEAL_LAUNCHES = [(90, 1, 1), (80, 1, 1), (80, 2, 1), (65, 2, 1), (80, 4, 1), (50, 4, 1)]
# split counts tried with stealing (STEAL_LAUNCH's numbers): with the tail evened out, more programs
# than two an SM may no longer leave a straggler behind
STEAL_SPLITS = (24, 40, 48, 64)


def sweep_shape(batch: int, length: int, gen: torch.Generator, grid_too: bool = True) -> dict:
    """The launch grid and the layouts on one shape, each against SDPA."""
    kv, tables, lens, k, v = bk.paged_pool(batch, length, gen)
    q = torch.randn(batch, bk.HQ, bk.D, device="cuda", dtype=bk.DT, generator=gen)
    scale = bk.D**-0.5
    q4, qf = q.view(batch, bk.HQ, 1, bk.D), q.view(batch, bk.HKV, bk.HQ // bk.HKV, bk.D)
    want = bk.sdpa(qf, k, v, scale=scale).reshape(batch, bk.HQ, bk.D).float()
    sdpa_us = 1e3 * min(bk.graph_ms(lambda: bk.sdpa(qf, k, v, scale=scale)),
                        bk.graph_ms(lambda: bk.sdpa(q4, k, v, scale=scale, enable_gqa=True)))

    def timed(pool, table, **launch) -> dict:
        fn = lambda: decode._paged_decode(q, pool, table, lens, scale, **launch)  # noqa: E731
        err = (fn().float() - want).abs().max().item()
        us = bk.graph_ms(fn, 30) * 1e3
        return dict(us=us, vs_sdpa=sdpa_us / us, max_abs_diff_vs_sdpa=err, **launch)

    chosen = decode.decode_launch(batch, bk.HKV, tables.shape[1] * bk.PAGE, bk.D, q.device)
    grid = []
    for splits, block_n, (warps, stages) in ([] if not grid_too else itertools.product(
            sorted({chosen[0] // 2, chosen[0] - 1, chosen[0], chosen[0] + 1, 2 * chosen[0]} - {0}), (64, 128),
            ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3)))):
        try:
            grid.append(timed(kv, tables, num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages))
        except Exception as e:  # a launch that does not compile or fit is recorded, not fatal
            grid.append(dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages,
                             error=str(e)[:200]))
    ok = sorted((r for r in grid if "us" in r), key=lambda r: r["us"])
    in_order = torch.arange(tables.numel(), device="cuda", dtype=torch.int32).view_as(tables)
    ordered = kv[tables.long().flatten()]  # the same K/V, block i of the table at slot i
    # the same shape, [.., Hkv, 16, D] in memory
    head_major = kv.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    head_major_ordered = ordered.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    # the merge launched after the split kernel or while it runs (programmatic dependent launch),
    # each twice, interleaved
    pdl = {}
    for on in (False, True) * 2:
        pdl.setdefault("on" if on else "off", []).append(timed(kv, tables, pdl=on))
    # fixed splits against stealing (the chosen launch's own rule, then forced with other shares)
    split_only = lambda **launch: 1e3 * bk.graph_ms(  # noqa: E731
        lambda: decode._paged_decode(q, kv, tables, lens, scale, kernels=("split",), **launch), 30)
    steal = {}
    for on in (False, True) * 2:
        steal.setdefault("on" if on else "off", []).append(
            dict(timed(kv, tables, steal=on), split_us=split_only(steal=on)))
    for launch in STEAL_LAUNCHES:
        steal[str(launch)] = [dict(timed(kv, tables, steal=True, steal_launch=launch),
                                   split_us=split_only(steal=True, steal_launch=launch))]
    for splits in STEAL_SPLITS:
        steal[f"{splits} splits"] = [dict(timed(kv, tables, steal=True, num_splits=splits),
                                          split_us=split_only(steal=True, num_splits=splits))]
    layouts = dict(engine=timed(kv, tables), blocks_in_order=timed(ordered, in_order),
                   head_major=timed(head_major, tables), head_major_in_order=timed(head_major_ordered, in_order))
    print(f"B={batch} L={length}: sdpa {sdpa_us:.1f} us; chosen launch {chosen}: "
          + ", ".join(f"{name} {r['us']:.1f} us ({r['vs_sdpa']:.3f}x)" for name, r in layouts.items())
          + "; pdl " + ", ".join(f"{m} " + "/".join(f"{r['us']:.1f}" for r in rs) for m, rs in pdl.items())
          + "; steal " + ", ".join(f"{m} " + "/".join(f"{r['us']:.1f} (split {r['split_us']:.1f})" for r in rs)
                                   for m, rs in steal.items())
          + (f"; best of {len(ok)} launches {ok[0]['us']:.1f} us ({ok[0]['vs_sdpa']:.3f}x) "
             + str({k: ok[0][k] for k in ('num_splits', 'block_n', 'num_warps', 'num_stages')}) if ok else ""),
          flush=True)
    return dict(batch=batch, length=length, kv_bytes=2 * batch * length * bk.HKV * bk.D * 2, sdpa_graph_us=sdpa_us,
                chosen=chosen, layouts=layouts, pdl=pdl, steal=steal, launches=ok + [r for r in grid if "error" in r])


if __name__ == "__main__":
    main()
