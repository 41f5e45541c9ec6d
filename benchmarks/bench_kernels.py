"""bench_kernels: tierkv's paged kernels vs torch on the same data, in one run (H200 via the device tool).

decode:  paged_decode vs SDPA on the same K/V made contiguous, Llama-3.1-8B layer shape; GB/s of KV
         read, ratio to SDPA and to the d2d copy bandwidth measured in this run, timed eagerly and
         replayed in CUDA graphs (GPU time alone, as the engine's decode runs); where the launch
         splits, its split kernel and its merge also timed apart in graphs.
decode_mixed: a serving batch of mixed lengths against the copy bandwidth, with a grid of launches.
prefill: paged_prefill of one sequence (cold, and long chunks over a cached prefix) as the engine
         calls it, and its Triton kernel alone, vs SDPA causal on contiguous K/V, TFLOP/s and ratio.
extend:  paged_prefill of a few new tokens over a long cached prefix (a prefix-cache hit) vs SDPA
         with a bottom-right causal mask on contiguous K/V, vs the one-split 128-row launch it
         replaces, and vs the HBM floor (the KV bytes at the d2d copy bandwidth of this run).
blocks:  16-token block moves L1<->L2 (Triton gather/scatter, staged or zero-copy) vs one contiguous
         pinned copy of the same bytes, and vs one cudaMemcpyAsync per contiguous run.
Writes benchmarks/results/bench_kernels-<machine>.json (or --out DIR) and a PNG. Prints a table.
Usage: python benchmarks/bench_kernels.py [--out DIR] [--quick] [--sweep decode,prefill,extend] [--only ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench, do_bench_cudagraph

from tierkv.kernels import block_copy, decode, dense, prefill, reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_tag  # noqa: E402

HQ, HKV, D, PAGE, DT = 32, 8, 128, 16, torch.bfloat16   # Llama-3.1-8B layer, bf16, 16-token blocks
DECODE_SHAPES = [(1, 131072), (8, 32768), (32, 8192), (128, 2048)]
# a serving batch of mixed lengths (bench_throughput's steady state: 139 sequences of 100-2048
# tokens on average, tables as wide as a 4096-token max_model_len)
MIXED_BATCH, MIXED_LENS, MIXED_WIDTH = 139, (100, 2048), 4096
# (new tokens, cached tokens) of one sequence: cold prompts, and chunks of a 100K-token prefill
PREFILL_SHAPES = [(4096, 0), (8192, 0), (16384, 0), (32768, 0), (8192, 32768), (8192, 90112)]
# (sequences, new tokens each, cached tokens each): prefix-cache hits of one request, and a batch
EXTEND_SHAPES = [(1, n, ctx) for ctx in (12288, 102400) for n in (1, 3, 16, 128)] + [(8, 16, 8192)]
GB = 1e9


FAST_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def sdpa(*args, **kwargs):
    """torch SDPA restricted to its fused backends (the math one would be neither fair nor fit)."""
    with sdpa_kernel(FAST_SDPA):
        return F.scaled_dot_product_attention(*args, **kwargs)


def ms(fn, reps=50) -> float:
    return do_bench(fn, warmup=10, rep=reps, return_mode="median")


def graph_ms(fn, reps=50) -> float:
    """GPU time of `fn` replayed in a CUDA graph: without the host's launch cost, which for a
    short extend (tens of µs of GPU work) is larger than the kernel itself."""
    return do_bench_cudagraph(fn, rep=reps, return_mode="median")


def copy_bandwidth() -> float:
    """d2d copy of 2 GiB: GB/s of bytes read + written (the HBM ceiling in this run)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * (2 << 30) / (t * 1e-3) / GB


def paged_pool(batch: int, length: int, gen: torch.Generator):
    """A shuffled paged pool holding `batch` sequences of `length` tokens, and the same K/V contiguous."""
    per_seq = triton.cdiv(length, PAGE)
    n = batch * per_seq
    kv = torch.randn(n, 2, PAGE, HKV, D, device="cuda", dtype=DT, generator=gen)
    tables = torch.randperm(n, device="cuda", generator=gen).to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    # contiguous copy for SDPA: [B, Hkv, L, D]
    pages = kv[tables.long()]                                   # [B, per_seq, 2, PAGE, Hkv, D]
    k = pages[:, :, 0].reshape(batch, per_seq * PAGE, HKV, D)[:, :length].transpose(1, 2).contiguous()
    v = pages[:, :, 1].reshape(batch, per_seq * PAGE, HKV, D)[:, :length].transpose(1, 2).contiguous()
    del pages
    return kv, tables, lens, k, v


def bench_decode(copy_gbps: float, sweep: bool) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, length in DECODE_SHAPES:
        kv, tables, lens, k, v = paged_pool(batch, length, gen)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=DT, generator=gen)
        scale = D**-0.5
        kv_bytes = 2 * batch * length * HKV * D * kv.element_size()
        ours = lambda: decode.paged_decode(q, kv, tables, lens, scale)  # noqa: E731
        # SDPA two ways, the faster one is the peer: GQA flag, and query heads folded into rows
        q4 = q.view(batch, HQ, 1, D)
        sdpa_gqa = lambda: sdpa(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
        qf = q.view(batch, HKV, HQ // HKV, D)
        sdpa_fold = lambda: sdpa(qf, k, v, scale=scale)  # noqa: E731
        err = (ours().float() - sdpa_fold().reshape(batch, HQ, D).float()).abs().max().item()
        t_ours, t_fold = ms(ours), ms(sdpa_fold)
        try:
            t_gqa = ms(sdpa_gqa)
        except RuntimeError:  # no fused backend takes enable_gqa here
            t_gqa = float("inf")
        t_sdpa = min(t_gqa, t_fold)
        row = dict(
            batch=batch, seq_len=length, kv_bytes=kv_bytes, max_abs_diff_vs_sdpa=err,
            tierkv_ms=t_ours, sdpa_ms=t_sdpa, sdpa_gqa_ms=t_gqa, sdpa_folded_ms=t_fold,
            tierkv_gbps=kv_bytes / (t_ours * 1e-3) / GB, sdpa_gbps=kv_bytes / (t_sdpa * 1e-3) / GB,
            splits_and_block_n=decode.choose_launch(batch, HKV, tables.shape[1] * PAGE, D, q.device),
        )
        row["ratio_vs_sdpa"] = t_sdpa / t_ours
        row["ratio_vs_copy"] = row["tierkv_gbps"] / copy_gbps
        # GPU time alone, replayed in CUDA graphs as the engine runs decode: a 1x128K decode is
        # ~0.14 ms of GPU work, where the eager figure above also holds the host's launch jitter
        try:
            g_ours = graph_ms(ours)
            g_sdpa = min(graph_ms(sdpa_fold), graph_ms(sdpa_gqa) if t_gqa != float("inf") else float("inf"))
            row.update(tierkv_graph_ms=g_ours, sdpa_graph_ms=g_sdpa, ratio_vs_sdpa_graph=g_sdpa / g_ours,
                       ratio_vs_copy_graph=kv_bytes / (g_ours * 1e-3) / GB / copy_gbps)
            if row["splits_and_block_n"][0] > 1:
                # the split kernel and the merge apart (the merge alone reads partials left unwritten):
                # how much of the gap to SDPA is the merge and the step between the two kernels
                split_ms = graph_ms(lambda: decode._paged_decode(q, kv, tables, lens, scale, kernels=("split",)))
                row.update(split_graph_ms=split_ms, split_vs_sdpa_graph=g_sdpa / split_ms,
                           split_vs_copy_graph=kv_bytes / (split_ms * 1e-3) / GB / copy_gbps,
                           merge_graph_ms=graph_ms(lambda: decode._paged_decode(q, kv, tables, lens, scale,
                                                                                kernels=("merge",))))
        except Exception as e:  # an SDPA backend that cannot be captured: keep the eager figures
            row["graph_error"] = str(e)[:200]
        if sweep:
            row["sweep"] = sweep_decode(q, kv, tables, lens, scale, kv_bytes)
        rows.append(row)
        print(f"decode B={batch:4d} L={length:6d}: tierkv {row['tierkv_gbps']:7.0f} GB/s  sdpa "
              f"{row['sdpa_gbps']:7.0f} GB/s  x{row['ratio_vs_sdpa']:.2f} sdpa  "
              f"{100 * row['ratio_vs_copy']:.0f}% copy  (max|diff| {err:.1e})"
              + (f"  graphs: x{row['ratio_vs_sdpa_graph']:.2f} sdpa {100 * row['ratio_vs_copy_graph']:.0f}% copy"
                 if "tierkv_graph_ms" in row else "")
              + (f" (split kernel alone x{row['split_vs_sdpa_graph']:.2f} sdpa, "
                 f"merge {row['merge_graph_ms'] * 1e3:.1f} us)" if "split_graph_ms" in row else ""), flush=True)
        del kv, tables, k, v
        torch.cuda.empty_cache()
    return rows


def bench_decode_mixed(copy_gbps: float) -> dict:
    """A serving decode batch: MIXED_BATCH sequences of lengths uniform in MIXED_LENS (seeded),
    block tables MIXED_WIDTH tokens wide as a CUDA graph sized for max_model_len holds them, the
    shape of bench_throughput's steady state, where this kernel took 83% of the GPU time (H100,
    2bdd8bb) and the uniform shapes above say too little. No SDPA peer (it would read the padding):
    KV bytes per second against the copy, in CUDA graphs, for the chosen launch and for each
    (splits, tokens per tile) of a small grid."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    lengths = torch.randint(MIXED_LENS[0], MIXED_LENS[1] + 1, (MIXED_BATCH,), generator=gen, device="cuda")
    per_seq = MIXED_WIDTH // PAGE
    kv = torch.randn(MIXED_BATCH * per_seq, 2, PAGE, HKV, D, device="cuda", dtype=DT, generator=gen)
    tables = torch.randperm(kv.shape[0], device="cuda", generator=gen).to(torch.int32).view(MIXED_BATCH, per_seq)
    lens = lengths.to(torch.int32)
    q = torch.randn(MIXED_BATCH, HQ, D, device="cuda", dtype=DT, generator=gen)
    scale = D**-0.5
    kv_bytes = 2 * int(lengths.sum()) * HKV * D * kv.element_size()
    chosen = decode.choose_launch(MIXED_BATCH, HKV, MIXED_WIDTH, D, q.device)
    t = graph_ms(lambda: decode.paged_decode(q, kv, tables, lens, scale))
    row = dict(batch=MIXED_BATCH, lengths=list(MIXED_LENS), table_tokens=MIXED_WIDTH, kv_bytes=kv_bytes,
               splits_and_block_n=chosen, tierkv_graph_ms=t,
               ratio_vs_copy_graph=kv_bytes / (t * 1e-3) / GB / copy_gbps, grid=[])
    for splits in (1, 2, 4, 8):
        for block_n in (32, 64, 128):
            try:
                g = graph_ms(lambda: decode._paged_decode(q, kv, tables, lens, scale, num_splits=splits,
                                                          block_n=block_n))
                row["grid"].append(dict(splits=splits, block_n=block_n, graph_ms=g,
                                        ratio_vs_copy=kv_bytes / (g * 1e-3) / GB / copy_gbps))
            except Exception as e:  # a launch that does not compile is recorded, not fatal
                row["grid"].append(dict(splits=splits, block_n=block_n, error=str(e)[:200]))
    best = max((r for r in row["grid"] if "graph_ms" in r), key=lambda r: r["ratio_vs_copy"])
    print(f"decode mixed B={MIXED_BATCH} L={MIXED_LENS}: tierkv {row['ratio_vs_copy_graph']:.0%} of copy in graphs "
          f"(launch {chosen}); best of the grid {best['ratio_vs_copy']:.0%} at {best['splits']} splits, "
          f"{best['block_n']} tokens a tile", flush=True)
    return row


def sweep_decode(q, kv, tables, lens, scale, kv_bytes) -> list[dict]:
    out = []
    base = decode.choose_launch(q.shape[0], HKV, tables.shape[1] * PAGE, D, q.device)[0]
    for block_n in (32, 64, 128):
        for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 3)):
            for mult in (0.5, 1, 2):
                splits = max(1, int(base * mult))
                try:
                    t = ms(lambda: decode._paged_decode(q, kv, tables, lens, scale, num_splits=splits,
                                                        block_n=block_n, num_warps=warps, num_stages=stages), 20)
                except Exception as e:  # a config that does not compile is recorded, not fatal
                    out.append(dict(block_n=block_n, warps=warps, stages=stages, splits=splits, error=str(e)[:200]))
                    continue
                out.append(dict(block_n=block_n, warps=warps, stages=stages, splits=splits,
                                gbps=kv_bytes / (t * 1e-3) / GB))
    best = max((r for r in out if "gbps" in r), key=lambda r: r["gbps"])
    print(f"   sweep best: {best}", flush=True)
    return out


def bench_prefill(sweep: bool) -> list[dict]:
    """One sequence: n new tokens over ctx cached ones. tierkv is the engine's path for a
    one-sequence step (paged_prefill told the context: cuDNN for long chunks, kernels/dense.py);
    the Triton kernel alone is timed too. Peer: SDPA on contiguous K/V, causal (ctx = 0) or with a
    bottom-right causal mask (ctx > 0), the fastest fused backend and GQA form."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for n, ctx in PREFILL_SHAPES:
        length = ctx + n
        kv, tables, lens, k, v = paged_pool(1, length, gen)
        q = torch.randn(n, HQ, D, device="cuda", dtype=DT, generator=gen)
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        scale = D**-0.5
        flops = 4 * HQ * D * n * (ctx + n / 2)                  # QK^T and PV, causal half of the new part
        ours = lambda: prefill.paged_prefill(q, kv, tables, cu, lens, scale, context=ctx)  # noqa: E731
        triton_only = lambda: prefill.paged_prefill(q, kv, tables, cu, lens, scale)  # noqa: E731
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ours()
        torch.cuda.synchronize()
        first_ms = 1e3 * (time.perf_counter() - t0)             # a new shape: cuDNN builds its plan
        qs = q.transpose(0, 1).unsqueeze(0)                     # [1, Hq, n, D]
        mask = dict(is_causal=True) if ctx == 0 else dict(attn_mask=causal_lower_right(n, length))
        # peer: SDPA with enable_gqa, and with K/V expanded to Hq heads; the faster one counts
        ke = k.repeat_interleave(HQ // HKV, 1)                  # [1, Hq, L, D]
        ve = v.repeat_interleave(HQ // HKV, 1)
        sdpa_exp = lambda: sdpa(qs, ke, ve, scale=scale, **mask)  # noqa: E731
        sdpa_gqa = lambda: sdpa(qs, k, v, scale=scale, enable_gqa=True, **mask)  # noqa: E731
        want = sdpa_exp()[0].transpose(0, 1).float()
        err = (ours().float() - want).abs().max().item()
        err_triton = (triton_only().float() - want).abs().max().item()
        t_ours, t_triton, t_exp = ms(ours, 30), ms(triton_only, 30), ms(sdpa_exp, 30)
        try:
            t_gqa = ms(sdpa_gqa, 30)
        except RuntimeError:
            t_gqa = float("inf")
        t_sdpa = min(t_exp, t_gqa)
        row = dict(tokens=n, context=ctx, dense_path=dense.applies(q, kv, 1, ctx, None),
                   tierkv_ms=t_ours, tierkv_first_call_ms=first_ms, triton_ms=t_triton, sdpa_ms=t_sdpa,
                   sdpa_expanded_ms=t_exp, sdpa_gqa_ms=t_gqa, max_abs_diff_vs_sdpa=err,
                   triton_max_abs_diff_vs_sdpa=err_triton,
                   tierkv_tflops=flops / (t_ours * 1e-3) / 1e12, triton_tflops=flops / (t_triton * 1e-3) / 1e12,
                   sdpa_tflops=flops / (t_sdpa * 1e-3) / 1e12, ratio_vs_sdpa=t_sdpa / t_ours)
        # GPU time alone, each replayed in a CUDA graph: the eager figures above also hold the host's
        # launch cost, which at 4K (~0.3 ms of attention) is about as long as the GPU's work
        try:
            g_ours, g_sdpa = graph_ms(ours, 30), graph_ms(sdpa_exp if t_exp <= t_gqa else sdpa_gqa, 30)
            row.update(tierkv_graph_ms=g_ours, sdpa_graph_ms=g_sdpa, ratio_vs_sdpa_graph=g_sdpa / g_ours)
        except Exception as e:  # a path that cannot be captured: keep the eager figures
            row["graph_error"] = str(e)[:200]
        if sweep and n == 16384 and ctx == 0:
            row["sweep"] = []
            for bm, bn, warps, stages in ((128, 64, 4, 3), (128, 64, 4, 4), (256, 64, 8, 2), (256, 64, 8, 3),
                                          (256, 64, 8, 4), (256, 128, 8, 2), (256, 32, 8, 3), (256, 32, 8, 4)):
                try:
                    t = graph_ms(lambda: prefill._paged_prefill(q, kv, tables, cu, lens, scale, block_m=bm, block_n=bn,
                                                          num_warps=warps, num_stages=stages), 20)
                    row["sweep"].append(dict(bm=bm, bn=bn, warps=warps, stages=stages,
                                             tflops=flops / (t * 1e-3) / 1e12))
                except Exception as e:
                    row["sweep"].append(dict(bm=bm, bn=bn, warps=warps, stages=stages, error=str(e)[:200]))
            print(f"   sweep: {row['sweep']}", flush=True)
        rows.append(row)
        print(f"prefill N={n:6d} ctx={ctx:6d}: tierkv {row['tierkv_tflops']:6.1f} TFLOP/s (triton "
              f"{row['triton_tflops']:6.1f}, first call {first_ms:.1f} ms)  sdpa {row['sdpa_tflops']:6.1f}"
              f"  x{row['ratio_vs_sdpa']:.2f}  (max|diff| {err:.1e})"
              + (f"  graphs: x{row['ratio_vs_sdpa_graph']:.2f}" if "tierkv_graph_ms" in row else ""), flush=True)
        del kv, tables, k, v, ke, ve
        torch.cuda.empty_cache()
    return rows


def bench_extend(copy_gbps: float, sweep: bool) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    scale = D**-0.5
    for batch, new, ctx in EXTEND_SHAPES:
        length = ctx + new
        kv, tables, lens, k, v = paged_pool(batch, length, gen)
        q = torch.randn(batch * new, HQ, D, device="cuda", dtype=DT, generator=gen)
        cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * new
        kv_bytes = 2 * batch * length * HKV * D * kv.element_size()
        ours = lambda: prefill.paged_prefill(q, kv, tables, cu, lens, scale)  # noqa: E731
        # the launch this replaces: 128-row tiles, one head a program, no split
        before = lambda: prefill._paged_prefill(q, kv, tables, cu, lens, scale, block_m=128, block_n=64,  # noqa: E731
                                                num_splits=1, pack=False)
        # peer: SDPA over [B, H, L, D] with new token i seeing keys <= ctx + i (bottom-right causal)
        qs = q.view(batch, new, HQ, D).transpose(1, 2)                      # [B, Hq, new, D]
        mask = causal_lower_right(new, length)
        ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)   # [B, Hq, L, D]
        sdpa_exp = lambda: sdpa(qs, ke, ve, attn_mask=mask, scale=scale)  # noqa: E731
        sdpa_gqa = lambda: sdpa(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)  # noqa: E731
        want = sdpa_exp().transpose(1, 2).reshape(batch * new, HQ, D).float()
        err = (ours().float() - want).abs().max().item()
        err_before = (before().float() - want).abs().max().item()
        # GPU time (CUDA graphs) for every contender; ours also eagerly, launch cost included
        t_ours, t_before, t_exp = graph_ms(ours), graph_ms(before), graph_ms(sdpa_exp)
        t_ours_eager = ms(ours)
        try:
            t_gqa = graph_ms(sdpa_gqa)
        except RuntimeError:  # no fused backend takes enable_gqa with this mask here
            t_gqa = float("inf")
        t_sdpa = min(t_exp, t_gqa)
        t_floor = kv_bytes / (copy_gbps * GB) * 1e3
        launch = prefill.choose_launch(batch * new, batch, HQ, HKV, tables.shape[1] * PAGE, D, q.device)
        # where the launch compiles short tiles in (prefill.short_rows), the kernel without them:
        # what carrying that second path costs the tall one (no sequence here is short)
        t_tall_only = (graph_ms(lambda: prefill._paged_prefill(q, kv, tables, cu, lens, scale, short=False))
                       if prefill.short_rows(launch) else None)
        row = dict(batch=batch, new_tokens=new, context=ctx, kv_bytes=kv_bytes, launch=dataclasses.asdict(launch),
                   without_short_tiles_ms=t_tall_only,
                   tierkv_ms=t_ours, tierkv_eager_ms=t_ours_eager, one_split_128_rows_ms=t_before, sdpa_ms=t_sdpa, sdpa_expanded_ms=t_exp,
                   sdpa_gqa_ms=t_gqa, hbm_floor_ms=t_floor, max_abs_diff_vs_sdpa=err,
                   one_split_max_abs_diff_vs_sdpa=err_before,
                   ratio_vs_sdpa=t_sdpa / t_ours, speedup_vs_one_split=t_before / t_ours,
                   ratio_vs_floor=t_floor / t_ours, tierkv_gbps=kv_bytes / (t_ours * 1e-3) / GB)
        if sweep:
            row["sweep"] = sweep_extend(q, kv, tables, cu, lens, scale, launch)
        rows.append(row)
        print(f"extend B={batch} new={new:4d} ctx={ctx:6d}: tierkv {1e3 * t_ours:7.1f} us "
              f"(eager {1e3 * t_ours_eager:6.1f})  one-split "
              f"{1e3 * t_before:7.1f} us  sdpa {1e3 * t_sdpa:7.1f} us  floor {1e3 * t_floor:6.1f} us  "
              f"x{row['ratio_vs_sdpa']:.2f} sdpa  {100 * row['ratio_vs_floor']:.0f}% floor  "
              f"splits {launch.num_splits} tile {launch.block_m}x{launch.block_n} pack {launch.pack}"
              + (f"  without short tiles {1e3 * t_tall_only:7.1f} us" if t_tall_only else "") +
              f"  (max|diff| {err:.1e})", flush=True)
        del kv, tables, k, v, ke, ve
        torch.cuda.empty_cache()
    return rows


def sweep_extend(q, kv, tables, cu, lens, scale, launch) -> list[dict]:
    out = []
    for bm, bn, pack in ((16, 64, True), (16, 128, True), (32, 64, True), (64, 64, True), (16, 64, False)):
        for warps in (2, 4):
            for mult in (0.5, 1, 2):
                splits = max(1, int(launch.num_splits * mult))
                cfg = dict(block_m=bm, block_n=bn, pack=pack, warps=warps, splits=splits)
                try:
                    t = graph_ms(lambda: prefill._paged_prefill(q, kv, tables, cu, lens, scale, block_m=bm, block_n=bn,
                                                          pack=pack, num_warps=warps, num_splits=splits), 20)
                except Exception as e:  # a config that does not compile (or fit) is recorded, not fatal
                    out.append(dict(cfg, error=str(e)[:200]))
                    continue
                out.append(dict(cfg, us=1e3 * t))
    best = min((r for r in out if "us" in r), key=lambda r: r["us"])
    print(f"   sweep best: {best}", flush=True)
    return out


def bench_blocks(quick: bool) -> dict:
    """Llama-3.1-8B blocks (32 layers x 64 KiB per layer-block = 2 MiB per block)."""
    layers, slots, n = 32, 4096, 256 if quick else 1024
    pool = torch.randn(layers, slots, 2, PAGE, HKV, D, device="cuda").to(DT)
    ids = torch.randperm(slots, device="cuda")[:n]
    nbytes = n * pool[:, 0].numel() * pool.element_size()
    host = torch.empty((n, layers, 2, PAGE, HKV, D), dtype=DT, pin_memory=True)
    flat_host = host.view(-1)
    stage = torch.empty(host.shape, dtype=DT, device="cuda")
    flat_dev = stage.view(-1)
    gbps = lambda t: nbytes / (t * 1e-3) / GB  # noqa: E731
    res = dict(blocks=n, bytes=nbytes, block_bytes_per_layer=pool[0, 0].numel() * 2)
    res["d2h_contiguous_gbps"] = gbps(ms(lambda: flat_host.copy_(flat_dev, non_blocking=True), 10))
    res["h2d_contiguous_gbps"] = gbps(ms(lambda: flat_dev.copy_(flat_host, non_blocking=True), 10))
    res["d2h_triton_gather_then_copy_gbps"] = gbps(ms(lambda: (block_copy.gather_blocks(pool, ids, stage),
                                                               flat_host.copy_(flat_dev, non_blocking=True)), 10))
    res["h2d_copy_then_triton_scatter_gbps"] = gbps(ms(lambda: (flat_dev.copy_(flat_host, non_blocking=True),
                                                                block_copy.scatter_blocks(stage, pool, ids)), 10))
    try:  # the GPU reading/writing pinned host memory directly over PCIe
        res["d2h_triton_zero_copy_gbps"] = gbps(ms(lambda: block_copy.gather_blocks(pool, ids, host), 10))
        res["h2d_triton_zero_copy_gbps"] = gbps(ms(lambda: block_copy.scatter_blocks(host, pool, ids), 10))
    except Exception as e:
        res["zero_copy_error"] = str(e)[:300]
    res["d2d_triton_gather_gbps"] = 2 * gbps(ms(lambda: block_copy.gather_blocks(pool, ids, stage)))
    res["d2d_reference_gather_gbps"] = 2 * gbps(ms(lambda: reference.gather_blocks(pool, ids, stage)))
    # one cudaMemcpyAsync per contiguous run (a 64 KiB layer-block), on a subset: 32 blocks x 32 layers
    few = ids[:32].tolist()
    per_run_bytes = 32 * pool[:, 0].numel() * pool.element_size()

    def per_run():
        for i, s in enumerate(few):
            for layer in range(layers):
                host[i, layer].copy_(pool[layer, s], non_blocking=True)

    res["d2h_memcpy_per_run_gbps"] = per_run_bytes / (ms(per_run, 10) * 1e-3) / GB
    for key in list(res):
        if key.endswith("_gbps") and key.startswith(("d2h_", "h2d_")) and "contiguous" not in key:
            base = res["d2h_contiguous_gbps"] if key.startswith("d2h") else res["h2d_contiguous_gbps"]
            res[key.replace("_gbps", "_ratio_vs_contiguous")] = res[key] / base
    for key, val in res.items():
        if key.endswith(("_gbps", "_contiguous")):
            print(f"blocks {key:45s} {val:8.2f}", flush=True)
    del pool, stage
    torch.cuda.empty_cache()
    return res


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    dec = result["decode"]
    labels = [f"{r['batch']}x{r['seq_len'] // 1024}K" for r in dec]
    x = range(len(dec))
    a.bar([i - 0.2 for i in x], [r["tierkv_gbps"] for r in dec], 0.4, label="tierkv paged_decode")
    a.bar([i + 0.2 for i in x], [r["sdpa_gbps"] for r in dec], 0.4, label="SDPA, contiguous KV")
    a.axhline(result["d2d_copy_gbps"], color="k", ls="--", label="d2d copy (read+write)")
    a.set_xticks(list(x), labels)
    a.set_ylabel("GB/s of KV read")
    a.set_title("decode, 32q/8kv heads, d=128, bf16")
    a.legend(fontsize=8)
    pre = result["prefill"]
    x = range(len(pre))
    b.bar([i - 0.2 for i in x], [r["tierkv_tflops"] for r in pre], 0.4, label="tierkv paged_prefill")
    b.bar([i + 0.2 for i in x], [r["sdpa_tflops"] for r in pre], 0.4, label="SDPA causal, contiguous")
    b.set_xticks(list(x), [f"{r['tokens'] // 1024}K" + (f"+{r['context'] // 1024}K" if r["context"] else "")
                           for r in pre])
    b.set_ylabel("TFLOP/s")
    b.set_title("prefill, one sequence (new + cached tokens)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--quick", action="store_true", help="fewer blocks in the block-copy test")
    ap.add_argument("--sweep", default="", help="comma list of decode,prefill,extend: also sweep launch configs")
    ap.add_argument("--only", default="decode,decode_mixed,prefill,extend,blocks")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU")
    machine = machine_tag()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    result = dict(
        benchmark="bench_kernels", machine=machine, gpu=torch.cuda.get_device_name(),
        torch=torch.__version__, triton=triton.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # the device's .git may lag the tree it runs: the caller names the commit it sent
        git_commit=os.environ.get("TIERKV_COMMIT") or os.environ.get("GIT_COMMIT", commit), host=platform.node(),
    )
    result["d2d_copy_gbps"] = copy_bandwidth()
    print(f"d2d copy: {result['d2d_copy_gbps']:.0f} GB/s (read + written)", flush=True)
    parts = args.only.split(",")
    sweeps = args.sweep.split(",")
    sections = dict(decode=lambda: bench_decode(result["d2d_copy_gbps"], "decode" in sweeps),
                    decode_mixed=lambda: bench_decode_mixed(result["d2d_copy_gbps"]),
                    prefill=lambda: bench_prefill("prefill" in sweeps),
                    extend=lambda: bench_extend(result["d2d_copy_gbps"], "extend" in sweeps),
                    blocks=lambda: bench_blocks(args.quick))
    for name, run in sections.items():
        if name not in parts:
            continue
        try:  # one broken section must not lose the others' figures
            result[name] = run()
        except Exception as e:
            import traceback

            traceback.print_exc()
            result[f"{name}_error"] = repr(e)[:500]
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_kernels-{machine}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if "decode" in result and "prefill" in result:
        plot(result, os.path.join(args.out, f"bench_kernels-{machine}.png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
