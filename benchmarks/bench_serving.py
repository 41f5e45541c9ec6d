"""bench_serving: the goodput of tierkv-serve under open-loop load, per cache configuration, against
the bounds of PCIe, disk and compute measured in the same run.

How: for each workload, one `tierkv-serve` per configuration (l1: `--l2 0` | l1+l2 | l1+l2+disk: a
file L3 with direct=1, O_DIRECT | off: prefix caching disabled), started once; against it a warm-up,
one isolated cold request, the priming of the cache with the workload's prefixes, then a sweep.
Each sweep point sends requests at Poisson arrival times (seeded) at one offered rate for
--point-seconds (or long enough to expect --min-point-requests arrivals), then waits up to
--drain-seconds for them to finish (what is left is cut and misses the SLO). Rates double from a
start (the rate at which all-miss requests, one at a time, keep the server busy; --start-rate)
while p99 TTFT, over every arrival and measured from its arrival, holds the SLO (--slo, 2 s),
halve while it does not, then --bisections midpoints between the highest pass and the lowest
fail. Goodput = the highest offered rate that held the SLO.
State between points is carried over (the cache, the live conversations), as in a server whose
load changes; there is no reset. Requests are token-id prompts on /v1/completions, streamed,
greedy, ignore_eos, logprobs=0 (every token its own event, as its id on a server without a
tokenizer), so TTFT is the first token's arrival and ITL the gaps.

Workloads (serving/workloads.py; sizes by flags, H200 defaults, --smoke for a CPU):
  multi_round    LMCache's multi-round QA: --mr-users live conversations (shared system prompt +
                 own context + rounds of question and answer); each Poisson arrival is the next round
                 of the conversation idle longest, a conversation never has two rounds in flight (an
                 arrival finding none idle waits, and the wait counts in its TTFT), the answer joins
                 the history, and a conversation that did --mr-rounds rounds is replaced by a new one.
  long_doc       LMCache's long-document QA: each arrival a question on one of --ld-docs documents
                 drawn uniformly; L2 holds a quarter of them, so they outgrow L1+L2 (the disk holds all).
  shared_prefix  SGLang's generated shared prefix: each arrival a question behind one of --sp-groups
                 system prompts drawn uniformly.
  unique         random prompts that never share a block: what caching costs (compare off and l1).
Each workload's KV is --kv-over-l1 (4) x L1 (L1 at least two of its largest requests); its L2 is
--XX-l2-over-kv x its KV (1.25 for multi_round and shared_prefix: the whole working set; 0.25 for
long_doc). Each server is sized for its workload.

Reported per workload x config x rate: TTFT (from arrival) / ITL / TPOT / e2e percentiles, the wait
for an idle conversation, throughput, goodput, hit tokens and bytes moved per tier (GET
/v1/cache/stats before and after each point), and the point's bound (serving/bounds.py): per
request, compute = uncached tokens x cold prefill s/token + its share of batched decode steps;
PCIe = L2 bytes loaded / pinned host->device bandwidth; disk = disk bytes read / raw disk read
bandwidth + disk bytes written / raw disk write bandwidth; bound = 1 / the largest (they run side
by side); served / bound. The bandwidths are measured here (a 4 GiB pinned copy; a 2 GiB file
written and fsynced, then read with O_DIRECT), the compute costs by each
server's isolated cold request. Writes bench_serving_<workload>-<machine>.json (after every
config, so a run cut short keeps what finished) and a PNG: goodput and p99 TTFT against the
offered rate, one line per config.

    # H200, one call each (the first is the issue's priority: ~6.5 min, at most ~7.8 by its budget)
    python benchmarks/bench_serving.py --make-model llama-3.1-8b --workloads multi_round --configs l1,l1+l2 --budget-s 450
    python benchmarks/bench_serving.py --make-model llama-3.1-8b --workloads long_doc --configs l1+l2,l1+l2+disk --budget-s 540
    python benchmarks/bench_serving.py --make-model llama-3.1-8b --workloads shared_prefix --configs l1,l1+l2 --budget-s 540
    python benchmarks/bench_serving.py --smoke --make-model tiny --out /tmp/bs    # CPU, l1+l2+disk, ~1.5 min
    # add --profile-seconds 2 for one more point per config at its goodput rate with the server's
    # profiler on (~35 s more a config): the trace lands in --out, a summary of it in the JSON
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --smoke        # one external server

H200 wall time (estimated from the committed closed-loop run: model build 27 s, server starts
17-46 s, cold prefill ~37 us a token): imports, model and limits ~45 s; then per sweep a server
start (20-45 s), warm-up, cold probe and priming (~15 s; +up to 20 s of disk writes settling),
and 3-6 points of 20 s plus a drain (~22 s a point that holds, up to 30 s one that misses):
~2.5-3.5 min a sweep. The default run (3 workloads x 3 configs) is ~25 min, more than one device
call: run one workload per call as above. --budget-s shares the time fairly among the sweeps
left (a server gets no longer than its share to start, and a point that would end past its
sweep's share is not started; 15 s of it are kept for the last server's stop and the files), so
a call ends within the budget plus ~20 s (interpreter start and imports come before its clock).

This file is the entry point (the command line and the loops over workloads and configs); the
parts live in benchmarks/serving/, one concept a module. It measures from the client side only
and must never read server state beyond the public HTTP API (/health, /v1/models,
/v1/completions, /v1/cache/stats).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the server launcher the tests use
from common import RESULTS, machine_tag  # noqa: E402
from serving.bounds import disk_bandwidth, h2d_bandwidth  # noqa: E402
from serving.model import model_info  # noqa: E402
from serving.presets import H200, SMOKE  # noqa: E402
from serving.ratios import TARGETS  # noqa: E402
from serving.report import human, print_summary, save  # noqa: E402
from serving.servers import CONFIGS, external_sizes, tier_sizes, with_server  # noqa: E402
from serving.session import run_session  # noqa: E402
from serving.workloads import FLAG_PREFIX, SOURCES, WORKLOADS  # noqa: E402

RESERVE_S = 15.0  # of the budget, kept for stopping the last server and writing the results


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--url", help="an already running OpenAI-compatible server: one config, 'external'")
    add("--api-key")
    add("--served-model-name", help="'model' in requests to --url (default: the first of its /v1/models)")
    add("--make-model", choices=("llama-3.1-8b", "tiny"), help="build a random-weight Llama and serve it")
    add("--server-model", help="a ready HF model directory for the servers (default: the bundled SmolLM2)")
    add("--configs", help=f"comma list of {', '.join(CONFIGS)} (default {H200['configs']}; smoke {SMOKE['configs']})")
    add("--workloads", help=f"comma list of {', '.join(WORKLOADS)} (default {H200['workloads']})")
    add("--smoke", action="store_true", help="tiny sizes for a CPU (checks that everything runs)")
    add("--slo", type=float, default=2.0, help="p99 TTFT SLO in seconds (default 2)")
    add("--point-seconds", type=float, help="arrivals per sweep point last this long (H200 20)")
    add("--min-point-requests", type=int, help="or longer, until this many are expected at the point's rate: a p99 "
        "of 6 arrivals is their slowest one (H200 30)")
    add("--drain-seconds", type=float, help="after a point's arrivals, wait this long for them, then cut (H200 10)")
    add("--max-points", type=int, help="sweep points per config at most (H200 6)")
    add("--bisections", type=int, default=1, help="midpoints tried between the highest pass and the lowest fail")
    add("--start-rate", type=float, help="first offered rate, requests/s (default: from the cold probe)")
    add("--budget-s", type=float, default=0.0, help="whole-run time limit in seconds, shared among the sweeps "
        "(default 0: none)")
    add("--settle-seconds", type=float, help="after priming, wait at most this for disk writes to stop (H200 20)")
    add("--kv-over-l1", type=float, default=4.0, help="L1 = the workload's KV / this (default 4)")
    add("--l1", help="L1 bytes (e.g. 4GiB), overriding --kv-over-l1")
    add("--l2", help="L2 bytes, overriding the workload's l2-over-kv")
    add("--l3-size", help="disk L3 budget (default 2x the workload's KV)")
    add("--max-num-seqs", type=int, default=64, help="server flag; fewer CUDA graphs to capture at start")
    add("--enforce-eager", action="store_true", help="server flag: no CUDA graphs (faster start)")
    add("--server-args", default="", help="more tierkv-serve flags, space separated")
    add("--warm-tokens", type=int, help="warm-up prompt length (H200 9000)")
    add("--disk-probe-bytes", type=int, help="raw disk write and read probe file size (H200 2 GiB)")
    add("--h2d-bytes", type=int, help="pinned host->device copy size (H200 4 GiB)")
    add("--tmp", type=Path, help="directory for the model, the disk L3 and the probe file (default: system temp)")
    for dest in (k for k in H200 if k.split("_")[0] in FLAG_PREFIX.values()):  # --mr-users, --ld-docs, ...
        add(f"--{dest.replace('_', '-')}", type=type(H200[dest]), help=f"H200 {H200[dest]}, smoke {SMOKE[dest]}")
    add("--seed", type=int, default=0)
    add("--timeout", type=float, default=900.0, help="seconds for one request, and for a server to start")
    add("--profile-seconds", type=float, default=0.0, help="after each search, one more point at the goodput rate "
        "with the server's torch profiler on for this long, from a third of the way in: its trace goes to --out, a "
        "summary (GPU and stream busy shares, top kernels, the engine thread's top ops) to the JSON (servers started "
        "here; default 0: off)")
    add("--label", default="", help="free text stored with the results")
    add("--out", type=Path, default=RESULTS)
    add("--no-plot", action="store_true")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if "--api-key" in a.argv[:-1]:  # the JSON gets the command line, never the key
        a.argv[a.argv.index("--api-key") + 1] = "***"
    for k, v in (SMOKE if a.smoke else H200).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.make_model and a.server_model:
        p.error("give --make-model or --server-model, not both")
    bad = [c for c in a.configs.split(",") if c not in CONFIGS]
    bad += [w for w in a.workloads.split(",") if w not in WORKLOADS]
    if bad:
        p.error(f"unknown config or workload: {bad}; configs are {', '.join(CONFIGS)}, workloads {', '.join(WORKLOADS)}")
    if a.slo <= 0 or a.point_seconds <= 0 or a.max_points < 1 or a.min_point_requests < 0:
        p.error("--slo and --point-seconds must be > 0, --max-points >= 1 and --min-point-requests >= 0")
    return a


def main(argv=None) -> list[Path]:
    a = parse(argv)
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-", dir=a.tmp))
    try:
        return run(a, tmp, "cuda" if torch.cuda.is_available() else "cpu")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(a, tmp: Path, device: str) -> list[Path]:
    end = time.perf_counter() + a.budget_s if a.budget_s else math.inf
    model, build_s = model_info(a, tmp)
    kvb, vocab = model.kv_bytes_per_token, model.vocab_size
    configs = ["external"] if a.url else a.configs.split(",")
    h2d, h2d_kind = h2d_bandwidth(a.h2d_bytes)
    disk, disk_write, disk_kind = (disk_bandwidth(tmp, a.disk_probe_bytes) if a.url or any("disk" in c for c in configs)
                                   else (None, None, "not measured: no disk config"))
    limits = dict(h2d_bytes_per_s=h2d, h2d_kind=h2d_kind, disk_read_bytes_per_s=disk,
                  disk_write_bytes_per_s=disk_write, disk_read_kind=disk_kind)
    print(f"model {model.source}: {model.shape}, {kvb} KV bytes a token; host->device {h2d / 1e9:.1f} GB/s "
          f"({h2d_kind}); disk read {disk / 1e9 if disk else 0:.2f} GB/s, write "
          f"{disk_write / 1e9 if disk_write else 0:.2f} GB/s ({disk_kind})", flush=True)
    sweeps_left, paths = len(configs) * len(a.workloads.split(",")), []
    for name in a.workloads.split(","):
        shape = SOURCES[name](a, vocab)
        sizes = external_sizes(a, shape, kvb) if a.url else tier_sizes(a, shape, kvb)
        if not a.url and not a.l3_size:  # the disk is shared with the model files: leave it room
            sizes["l3_bytes"] = min(sizes["l3_bytes"], int(0.6 * shutil.disk_usage(tmp).free))
        max_len = 256 * math.ceil((max(shape.largest_request, a.warm_tokens + 24) + 64) / 256)
        if model.max_position_embeddings and max_len > model.max_position_embeddings:
            print(f"warning: requests need {max_len} positions, beyond the model's {model.max_position_embeddings}")
        print(f"{name}: KV {human(sizes['kv_bytes'])} = {sizes['kv_over_l1'] or 0:.1f}x L1 {human(sizes['l1_bytes'])}; "
              f"L2 {human(sizes['l2_bytes'])}; disk {human(sizes['l3_bytes'])}", flush=True)
        out = dict(
            device=device, label=a.label, argv=a.argv,
            model=dict(source=model.source, **model.shape, vocab_size=vocab, kv_bytes_per_token=kvb,
                       build_and_save_s=build_s),
            limits=limits, slo_ms=a.slo * 1e3,
            sweep=dict(point_seconds=a.point_seconds, min_point_requests=a.min_point_requests,
                       drain_seconds=a.drain_seconds, max_points=a.max_points,
                       bisections=a.bisections, start_rate=a.start_rate or "from the cold probe", budget_s=a.budget_s),
            workload=dict(name=name, shape=shape.shape, kv_tokens=shape.kv_tokens, largest_request=shape.largest_request),
            sizes=sizes, max_model_len=max_len,
            method=dict(requests="/v1/completions, token-id prompts, stream, ignore_eos, temperature 0, logprobs 0",
                        arrivals="Poisson at the offered rate, seeded; TTFT from the arrival",
                        slo="p99 TTFT over every arrival of a point (failed or cut: infinite) <= slo_ms",
                        between_points="no reset: the cache and the live conversations carry over",
                        cache="GET /v1/cache/stats before and after each point: hit tokens, bytes out/in per tier",
                        bound="1 / max(compute, pcie, disk) per request served, serving/bounds.py"),
            target=TARGETS.get(name), configs={}, failed_configs={},
        )
        for config in configs:
            now = time.perf_counter()
            deadline = now + (end - now - RESERVE_S) / sweeps_left
            sweeps_left -= 1
            print(f"{name} / {config}" + (f": {deadline - now:.0f} s of the budget" if math.isfinite(end) else ""),
                  flush=True)
            src = SOURCES[name](a, vocab)  # the same starting state in every config

            # the profiled point needs the server's trace file: only for servers started here
            trace_to = (Path(a.out) / f"bench_serving_{name}-{config.replace('+', '_')}-{machine_tag()}.pt.trace.json.gz"
                        if a.profile_seconds and not a.url else None)
            if trace_to is not None:
                trace_to.parent.mkdir(parents=True, exist_ok=True)

            async def session(url, src=src, deadline=deadline, max_len=max_len, trace_to=trace_to):
                return await run_session(a, url, src, limits, max_len, vocab, deadline, trace_to)

            try:
                figures = (asyncio.run(session(a.url)) if a.url
                           else with_server(a, config, model, sizes, max_len, tmp, session, deadline))
            except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as err:  # the next config may still run
                out["failed_configs"][config] = f"{type(err).__name__}: {err}"[-3000:]
                print(f"{config} failed: {out['failed_configs'][config]}", flush=True)
                continue
            out["configs"][config] = figures
            path = save(out, a)  # after every config: a run cut short keeps what finished
        path = save(out, a)
        print_summary(out)
        print(f"wrote {path}")
        paths.append(path)
    return paths


if __name__ == "__main__":
    # `timeout` sends SIGTERM: leave through the finally blocks, so the servers are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
