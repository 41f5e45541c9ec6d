"""bench_serving: what L1, L2 and a disk L3 buy tierkv-serve on the field's serving workloads.

How: one `tierkv-serve` process per configuration, each replaying the same seeded trace over HTTP:
  off (prefix caching disabled) | l1 | l1+l2 | l1+l2+disk (file L3 with direct=1: O_DIRECT, so disk
  reads bypass the page cache; the page cache is also dropped before each workload where allowed).
Requests are token-id prompts (random ids in [100, vocab), seeded) on /v1/completions, streamed,
greedy, ignore_eos, fixed max_tokens, with logprobs=0: that makes every token its own SSE event
(a model without a tokenizer streams no text; the cost, a log-softmax per step, is the same in every
config), so TTFT is the first token's arrival and ITL the gaps. Each config first gets a warm-up
(kernels compile outside the timings); run lengths are bounded by request counts and by
--max-seconds per workload and --config-seconds per config.
Workloads (each sized by flags; H200 defaults, --smoke for a CPU):
  multi_round    LMCache's multi-round QA: users arrive as a Poisson process, at most
                 --mr-max-active-users at once (new users take finished ones' places); each sends
                 rounds of shared system prompt + own context + growing history + a question, the
                 next round a think time after the answer, which joins the history as returned.
  long_doc       LMCache's long-document QA: documents of ~20K tokens, each asked several short
                 questions, in seeded random order, under a concurrency limit.
  shared_prefix  SGLang's generated shared prefix: groups of questions behind a long system prompt,
                 in random order, under a rate and a concurrency limit.
  unique         random prompts that never share a block: caching on (l1) vs off when every lookup
                 misses (runs in the off and l1 configs only).
Each workload's KV (its distinct tokens x bytes per token from the model config) is made
--kv-over-l1 (4) times L1 (L1 is raised if the largest request needs it); L2 = --l2-over-l1 x L1.

Reported per workload x config: TTFT/ITL/TPOT percentiles, request and token throughput, errors,
hit tokens per tier (GET /v1/cache/stats before and after), usage.cached_tokens, and each hit's
physical floor = L2 bytes / pinned host->device bandwidth + disk bytes / raw disk read bandwidth +
uncached tokens x cold prefill time per token. Those three are measured in the same run (a 4 GiB
pinned copy; a read of a 2 GiB file in the temp dir, evicted from the page cache first; an isolated cold 12K-token request).
The HTTP response does not say which tier served a request's hit, so trace floors split each
request's cached tokens by the workload's aggregate per-tier hit fractions; the isolated probes
(before each trace: cold, then the same prompt from L1, then from L2 after other prompts pushed it
out of L1) get their exact split by diffing /v1/cache/stats around one request.
Writes bench_serving-<machine>.json (after every config, so a timeout keeps what finished) and a
PNG of TTFT CDFs per workload.

    python benchmarks/bench_serving.py --make-model llama-3.1-8b          # the H200 run (~8 min)
    python benchmarks/bench_serving.py --smoke --make-model tiny --out /tmp/bs   # CPU, ~1 min
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --smoke   # one external server

This file is the entry point (the command line and the loop over configs); the parts live in
benchmarks/serving/, one concept a module. It measures from the client side only and must never
read server state beyond the public HTTP API (/health, /v1/models, /v1/completions, /v1/cache/stats).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the server launcher the tests use
from common import RESULTS  # noqa: E402
from serving.floors import disk_read_bandwidth, h2d_bandwidth  # noqa: E402
from serving.model import model_info  # noqa: E402
from serving.presets import H200, SMOKE  # noqa: E402
from serving.ratios import TARGETS  # noqa: E402
from serving.report import fmt, human, print_table, save  # noqa: E402
from serving.replay import run_one  # noqa: E402
from serving.servers import CONFIGS, external_sizes, run_server_config, tier_sizes  # noqa: E402
from serving.workloads import BUILDERS, WORKLOADS  # noqa: E402


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--url", help="an already running OpenAI-compatible server: one config, 'external'")
    add("--api-key")
    add("--served-model-name", help="'model' in requests to --url (default: the first of its /v1/models)")
    add("--make-model", choices=("llama-3.1-8b", "tiny"), help="build a random-weight Llama and serve it")
    add("--server-model", help="a ready HF model directory for the servers (default: the bundled SmolLM2)")
    add("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    # unique first: its on-vs-off figure is the one a time cap must never cut
    add("--workload", default="unique,multi_round,long_doc,shared_prefix", help="comma list of " + ", ".join(WORKLOADS))
    add("--smoke", action="store_true", help="tiny sizes for a CPU (checks that everything runs)")
    add("--kv-over-l1", type=float, default=4.0, help="L1 = median workload KV / this (default 4)")
    add("--l1", help="L1 bytes (e.g. 4GiB), overriding --kv-over-l1")
    add("--l2-over-l1", type=float, default=2.0, help="L2 = this x L1 (default 2: L1+L2 holds ~3/4 of the KV)")
    add("--l2", help="L2 bytes, overriding --l2-over-l1")
    add("--l3-size", help="disk L3 budget (default 2x the largest workload's KV)")
    add("--max-num-seqs", type=int, default=64, help="server flag; fewer CUDA graphs to capture at start")
    add("--enforce-eager", action="store_true", help="server flag: no CUDA graphs (faster start)")
    add("--server-args", default="", help="more tierkv-serve flags, space separated")
    add("--max-seconds", type=float, help="per workload and config: no request starts after this (H200 60)")
    add("--config-seconds", type=float, help="per config, all workloads together (H200 120)")
    add("--probe-tokens", type=int, help="isolated probe prompt length (H200 12000)")
    add("--probe-100k", action="store_true", help="also probe a 100K-token prompt (needs L2 to hold it)")
    add("--warm-tokens", type=int, help="warm-up prompt length (default 9000; smoke 128)")
    add("--disk-probe-bytes", type=int, help="raw disk read probe file size (H200 2 GiB)")
    add("--h2d-bytes", type=int, help="pinned host->device copy size (H200 4 GiB)")
    add("--no-drop-caches", action="store_true", help="never write /proc/sys/vm/drop_caches (implied by --smoke)")
    add("--tmp", type=Path, help="directory for the model, the disk L3 and the probe file (default: system temp)")
    for prefix, keys in (("mr", "users rounds system_tokens context_tokens question_tokens answer_tokens rate "
                                "think_time max_active_users"),
                         ("ld", "docs doc_tokens questions question_tokens answer_tokens concurrency"),
                         ("sp", "groups system_tokens questions question_tokens answer_tokens rate concurrency"),
                         ("uq", "prompts prompt_tokens answer_tokens concurrency")):
        for k in keys.split():
            dest = f"{prefix}_{k}"
            add(f"--{dest.replace('_', '-')}", type=float if isinstance(H200[dest], float) else int,
                help=f"H200 {H200[dest]}, smoke {SMOKE[dest]}")
    add("--seed", type=int, default=0)
    add("--timeout", type=float, default=900.0, help="seconds for one request, and for a server to start")
    add("--label", default="", help="free text stored with the results")
    add("--out", type=Path, default=RESULTS)
    add("--no-plot", action="store_true")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if "--api-key" in a.argv[:-1]:  # the JSON gets the command line, never the key
        a.argv[a.argv.index("--api-key") + 1] = "***"
    preset = SMOKE if a.smoke else H200
    for k, v in preset.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.warm_tokens is None:
        a.warm_tokens = 128 if a.smoke else 9000
    a.no_drop_caches = a.no_drop_caches or a.smoke
    if a.make_model and a.server_model:
        p.error("give --make-model or --server-model, not both")
    bad = [c for c in a.configs.split(",") if c not in CONFIGS]
    bad += [w for w in a.workload.split(",") if w not in WORKLOADS]
    if bad:
        p.error(f"unknown config or workload: {bad}")
    return a


def main(argv=None) -> Path:
    a = parse(argv)
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-", dir=a.tmp))
    try:
        return run(a, tmp, "cuda" if torch.cuda.is_available() else "cpu")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(a, tmp: Path, device: str) -> Path:
    model, build_s = model_info(a, tmp)
    kvb = model.kv_bytes_per_token
    workloads = [BUILDERS[w](a, model.vocab_size) for w in a.workload.split(",")]
    sizes = external_sizes(a, workloads, kvb) if a.url else tier_sizes(a, workloads, kvb)
    need = max(w.largest_request for w in workloads)
    max_len = 256 * math.ceil((max(need, a.probe_tokens + 1, 100_064 if a.probe_100k else 0) + 64) / 256)
    if model.max_position_embeddings and max_len > model.max_position_embeddings:
        print(f"warning: requests need {max_len} positions, beyond the model's {model.max_position_embeddings}")
    if not a.url and not a.l3_size:  # the disk is shared with the model files: leave it room
        sizes["l3_bytes"] = min(sizes["l3_bytes"], int(0.6 * shutil.disk_usage(tmp).free))
    print(f"model {model.source}: {model.shape}, {kvb} KV bytes a token; L1 {human(sizes['l1_bytes'])}, "
          f"L2 {human(sizes['l2_bytes'])}, disk {human(sizes['l3_bytes'])}; KV/L1 "
          + ", ".join(f"{w} {fmt(r, '.1f')}x" for w, r in sizes["kv_over_l1"].items()), flush=True)
    for w, r in sizes["kv_over_l1"].items():
        if w != "unique" and r is not None and not 3 <= r <= 5:
            print(f"warning: {w}'s KV is {r:.1f}x L1 (3-5x intended); resize it or set --l1")
    h2d, h2d_kind = h2d_bandwidth(a.h2d_bytes)
    disk, disk_kind = disk_read_bandwidth(tmp, a.disk_probe_bytes)
    print(f"limits: host->device {h2d / 1e9:.1f} GB/s ({h2d_kind}); disk read {disk / 1e9:.2f} GB/s ({disk_kind})",
          flush=True)
    out = dict(
        device=device, label=a.label, argv=a.argv,
        model=dict(source=model.source, **model.shape, vocab_size=model.vocab_size, kv_bytes_per_token=kvb,
                   build_and_save_s=build_s),
        limits=dict(h2d_bytes_per_s=h2d, h2d_kind=h2d_kind, disk_read_bytes_per_s=disk, disk_read_kind=disk_kind),
        sizes=sizes, max_model_len=max_len,
        workloads={w.name: dict(w.shape, kv_tokens=w.kv_tokens, kv_bytes=w.kv_tokens * kvb, planned=w.planned,
                                largest_request=w.largest_request) for w in workloads},
        method=dict(requests="/v1/completions, token-id prompts, stream, ignore_eos, temperature 0, logprobs 0",
                    ttft="first streamed token", hits="/v1/cache/stats hit_tokens diffed around each workload",
                    floor="l2 bytes / h2d + disk bytes / disk read + uncached tokens x cold prefill s/token"),
        targets=TARGETS, configs={}, failed_configs={},
    )
    raw: dict = {}
    configs = ["external"] if a.url else a.configs.split(",")
    for config in configs:
        print(f"{config}: {', '.join(f'{w.name} {w.planned}' for w in workloads)} requests", flush=True)
        if a.url:
            figures, raw[config] = asyncio.run(run_one(a, config, a.url, workloads, kvb, max_len, model.vocab_size))
        else:
            try:
                figures, raw[config] = run_server_config(a, config, model, sizes, max_len, workloads, tmp)
            except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as err:  # the next config may still run
                out["failed_configs"][config] = f"{type(err).__name__}: {err}"[-3000:]
                print(f"{config} failed: {out['failed_configs'][config]}", flush=True)
                continue
        out["configs"][config] = figures
        save(out, raw, kvb, a)  # after every config: a run cut short keeps what finished
    path = save(out, raw, kvb, a)
    print_table(out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    # `timeout` sends SIGTERM: leave through the finally blocks, so the servers are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
