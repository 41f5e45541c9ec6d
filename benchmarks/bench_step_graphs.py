"""bench_step_graphs: one engine step eager and as a CUDA graph replay, its host launch time against
its GPU time (issue 40 item 3: mixed steps were launch-bound in bench_rounds).

How: a random-weight Llama-3.1-8B shape (tiny with --smoke) over a paged pool, and the steps of
bench_rounds' saturated hit rounds: B decodes at --context tokens, alone or beside chunks of new
tokens (a request joining with its question). Per step:
  eager host   the host's seconds to launch the forward (median), the GPU idle behind it;
  eager GPU    its GPU seconds when launched far ahead (behind a long sleep kernel): what the GPU
               alone needs;
  graph host / graph GPU   the same through tierkv's StepGraphs (engine/graphs.py): a decode step
               replays a decode graph, a mixed step of up to 512 tokens a mixed one (GPU only);
and eager host / graph GPU: how far an eager step leaves the GPU waiting. Graph and eager logits
are compared (max difference over the largest logit).

    python benchmarks/bench_step_graphs.py            # GPU: the 8B shape, ~1 min
    python benchmarks/bench_step_graphs.py --smoke    # CPU: tiny shape, eager only

Writes benchmarks/results/bench_step_graphs-<machine>.json (--out for another folder).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_latency import LLAMA31_8B, TINY_LLAMA3  # noqa: E402
from common import RESULTS, write_results  # noqa: E402

from tierkv.engine.attention import AttentionMetadata  # noqa: E402
from tierkv.engine.graphs import StepGraphs  # noqa: E402
from tierkv.engine.model import CausalLM  # noqa: E402
from tierkv.engine.model_config import ModelConfig  # noqa: E402

BLOCK = 16
# (decodes, new-token chunks): bench_rounds' steps, 5 requests at once, 132 new tokens a joiner
# (the last, 529 tokens, is past the largest mixed graph: eager either way)
STEPS = ((5, ()), (4, (132,)), (2, (132, 132)), (4, (400,)), (1, (132, 132, 132, 132)))


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny Llama on a CPU (eager only)")
    p.add_argument("--context", type=int, help="cached tokens of every sequence (default 8000; smoke 200)")
    p.add_argument("--iters", type=int, default=20, help="timed launches per step (median)")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    a.context = a.context or (200 if a.smoke else 8000)
    return a


def build(smoke: bool, context: int, seqs: int):
    """(model, pool [layers, blocks, 2, BLOCK, Hkv, D], blocks per sequence) on the device."""
    device = torch.device("cpu" if smoke else "cuda")
    hf = dict(TINY_LLAMA3 if smoke else LLAMA31_8B, model_type="llama", architectures=["LlamaForCausalLM"])
    cfg = ModelConfig.from_hf(hf)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(torch.float32 if smoke else torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.reset_rope()
    per_seq = -(-(context + 1024) // BLOCK)
    pool = torch.randn(cfg.num_layers, seqs * per_seq + 1, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                       dtype=model.lm_head.weight.dtype, device=device)  # random KV: every read is real data
    return model, pool, per_seq


def step_inputs(decodes: int, chunks: tuple, context: int, per_seq: int, vocab: int, device):
    """(ids [T], positions [T], metadata) of `decodes` sequences of one new token and one sequence
    per chunk of that many, every sequence over `context` cached tokens, each in its own blocks."""
    new = [1] * decodes + list(chunks)
    lens = [context + n for n in new]
    tables = torch.stack([torch.arange(b * per_seq, (b + 1) * per_seq, dtype=torch.int32) for b in range(len(new))])
    pos = torch.cat([torch.arange(n - k, n) for k, n in zip(new, lens)])                       # [T]
    row = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new))                  # [T]
    slots = tables[row, pos // BLOCK].long() * BLOCK + pos % BLOCK                            # [T]
    cu = torch.tensor([0] + new).cumsum(0).to(torch.int32)                                    # [B + 1]
    meta = AttentionMetadata(slot_mapping=slots.to(device), block_tables=tables.to(device),
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                             cu_seqlens_q=cu.to(device), logits_indices=(cu[1:] - 1).long().to(device),
                             is_decode=not chunks)
    return torch.randint(0, vocab, (len(pos),), device=device), pos.to(device), meta


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(launch, device: torch.device, iters: int) -> dict:
    """Median host seconds to launch, and (CUDA) median GPU seconds launched live and launched
    far ahead of the GPU."""
    host, live = [], []
    for _ in range(iters):
        sync(device)
        start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        end = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if start is not None:
            start.record()
        t = time.perf_counter()
        launch()
        host.append(time.perf_counter() - t)
        if end is not None:
            end.record()
        sync(device)
        if start is not None:
            live.append(start.elapsed_time(end) / 1e3)
    out = dict(host_s=statistics.median(host), gpu_live_s=statistics.median(live) if live else None, gpu_s=None)
    if device.type == "cuda":  # the host far ahead: a long sleep kernel first, then the launches queue up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e8))
        start.record()
        for _ in range(5):
            launch()
        end.record()
        sync(device)
        out["gpu_s"] = start.elapsed_time(end) / 5e3
    return out


@torch.inference_mode()
def main(argv=None) -> dict:
    a = parse(argv)
    seqs = max(d + len(c) for d, c in STEPS)
    model, pool, per_seq = build(a.smoke, a.context, seqs)
    device = pool.device
    model.compile_kernels(pool[0])
    graphs = StepGraphs(model, pool, block_size=BLOCK, max_model_len=per_seq * BLOCK, max_batch_size=8,
                        max_step_tokens=512)
    t = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t
    print(f"{'8B' if not a.smoke else 'tiny'} shape on {device}; graphs: {len(graphs.graphs)} decode, "
          f"{len(graphs.mixed_graphs)} mixed, captured in {capture_s:.2f} s "
          f"({graphs.disabled_reason or graphs.mixed_disabled_reason or 'on'})", flush=True)
    rows = []
    for decodes, chunks in STEPS:
        ids, pos, meta = step_inputs(decodes, chunks, a.context, per_seq, model.config.vocab_size, device)

        def eager():
            meta.plans = {}  # each launch plans its batch, as the runner's fresh metadata does
            return model(ids, pos, pool, meta)

        row = dict(decodes=decodes, chunks=list(chunks), tokens=len(pos), eager=timed(eager, device, a.iters))
        ref = eager()
        replayed = graphs.run(ids, pos, pool, meta)
        if replayed is not None:
            row["graph"] = timed(lambda: graphs.run(ids, pos, pool, meta), device, a.iters)
            row["graph_vs_eager_max_diff"] = float((replayed - ref).abs().max() / ref.abs().max())
            if row["graph"]["gpu_s"]:
                row["eager_host_over_graph_gpu"] = row["eager"]["host_s"] / row["graph"]["gpu_s"]
        rows.append(row)
        e, g = row["eager"], row.get("graph")
        ms = lambda x: "-" if x is None else f"{x * 1e3:.2f} ms"  # noqa: E731
        print(f"  {decodes} decodes + chunks {list(chunks)} ({len(pos)} tokens): eager host {ms(e['host_s'])}, "
              f"GPU {ms(e['gpu_s'])}; graph host {ms(g and g['host_s'])}, GPU {ms(g and g['gpu_s'])}", flush=True)
    figures = dict(argv=list(sys.argv[1:] if argv is None else argv), context=a.context, capture_s=capture_s,
                   decode_graphs=len(graphs.graphs), mixed_graphs=len(graphs.mixed_graphs), steps=rows)
    path = write_results("bench_step_graphs", figures, a.out)
    print(f"wrote {path}")
    return figures


if __name__ == "__main__":
    main()
