"""Batch-1 paged decode over short contexts (128-4096 tokens, Llama-3.1-8B layer): every launch
(splits, tokens per tile, warps, stages) timed in CUDA graphs, as the engine's decode runs.

The measurement behind kernels/decode.py choose_launch for few programs (results:
benchmarks/results/sweep_decode_short-h200.json). GPU only; ~2.5 min on an H200.
    python3 benchmarks/sweep_decode_short.py [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as bk  # noqa: E402  (the pool builder and graph timer the kernel benchmark uses)

from tierkv.kernels import decode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    out_dir = ap.parse_args().out
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for length in (128, 256, 384, 512, 1024, 2048, 4096):
        kv, tables, lens, _, _ = bk.paged_pool(1, length, gen)
        q = torch.randn(1, bk.HQ, bk.D, device="cuda", dtype=bk.DT, generator=gen)
        scale = bk.D**-0.5
        ref = decode.paged_decode(q, kv, tables, lens, scale).float()
        rows = []  # (us, splits, block_n, warps, stages, max abs diff)
        for splits, block_n, warps, stages in itertools.product((1, 2, 3, 4, 6, 8, 16, 33), (16, 32, 64, 128),
                                                                (2, 4, 8), (2, 3, 4)):
            if splits > 1 and splits * block_n > 2 * length:
                continue  # most splits would be empty
            fn = lambda: decode._paged_decode(q, kv, tables, lens, scale, num_splits=splits,  # noqa: E731
                                              block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                err = (fn().float() - ref).abs().max().item()
                rows.append((bk.graph_ms(fn, 20) * 1e3, splits, block_n, warps, stages, err))
            except Exception:  # a launch that does not compile or fit is left out
                continue
        rows.sort()
        chosen = decode.decode_launch(1, bk.HKV, tables.shape[1] * bk.PAGE, bk.D, q.device)
        print(f"L={length:5d} chosen {chosen}  best:", [f"{r[0]:.2f}us s{r[1]} n{r[2]} w{r[3]} st{r[4]}" for r in rows[:4]],
              flush=True)
        results.append(dict(length=length, current=chosen, rows=rows))
    with open(os.path.join(out_dir, "sweep_decode_short-h200.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
