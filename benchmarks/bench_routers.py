"""Routers over replicas of tierkv-serve that share one Redis L3: the prefix-hit fraction and
request rate of a multi-round chat workload through vllm-router's kv_aware (fed by tierkv's
KV-cache events), cache_aware and round_robin, beside one replica that holds every conversation
(the most any router can get). Writes benchmarks/results/routers-<machine>.json.

    python benchmarks/bench_routers.py            # CPU: 3 replicas of the bundled model, about a minute

Hit fraction = cached prompt tokens / prompt tokens, summed over the responses' usage
(`prompt_tokens_details.cached_tokens`): what the user saves, blocks read from the shared L3
included. Of it, the L3 fraction is what the replicas read out of the L3 (their
tierkv_tier_blocks_out_total{tier="l3"}), and the local fraction the rest: the prefix the replica
that served the request held itself, in L1 or L2. The local fraction is what a router decides;
the shared L3 gives a badly routed request most of its prefix back, at the price of the read.
Each policy starts from empty caches (every replica's /flush_cache, the L3's FLUSHALL) and a new
router. tests/test_routers.py runs the same fleet and asserts on it. Nothing here reads a
server's state but through HTTP and Redis.

The fleet on one GPU (--gpu; issue 40 item 5): --replicas (4) tierkv-serve processes of a
random-weight Qwen3-0.6B-shaped model (made here, saved outside the tree; no tokenizer, so the
workload is in token ids) share the GPU, each with its own L1 and pinned L2 (GPU_REPLICA_ARGS;
the replicas' kernels are time-sliced on the GPU, not run side by side: no MPS), one Redis L3
and their KV-cache events, behind vllm-router: kv_aware against round_robin on TokenWorkload, a
closed-loop multi-round chat (32 users at once, each sending its next round when its answer has
arrived; 8K tokens each by the last round), sized so that the conversations' KV (~27 GiB)
overflows one replica (L1 8 GiB, L2 10 GiB, which holds a copy of L1's blocks) and fits the
fleet's four. Per policy: requests/s,
output tok/s, p50/p90 TTFT (all rounds, and the hit rounds, 1 on, alone: round 0 is cold under
any router) and the hit fractions as above; the kv_aware / round_robin ratios (the anchor: llm-d's
event-fed routing published 2x the throughput of random routing, p90 TTFT 0.54 s against 92.6 s;
a TTFT of 92.6 s is queueing, which this closed loop, one request per user at a time, bounds). Writes
routers_fleet-<machine>.json and a PNG beside it.

    # here, once: redis-server, the router's and the server's wheels into .fleet/ (~32 MB)
    bash scripts/device_fleet.sh
    # device (run tool, carry [".fleet"], one call, ~6-8 min):
    TIERKV_COMMIT=<sha> bash scripts/gpu_check.sh fleet
    # the same code path on a CPU: a tiny random Qwen3, 2 replicas, a few requests (~1 min;
    # its JSON goes to a temporary folder unless --out names one)
    python benchmarks/bench_routers.py --smoke
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from importlib.metadata import version
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the server and Redis launchers the tests use
from common import write_results  # noqa: E402
from routers.fleet import REPLICA_ARGS, Fleet, Router  # noqa: E402
from routers.workloads import BLOCK_SIZE, TokenWorkload, Turn, Workload  # noqa: E402
from serving.figures import pct  # noqa: E402

POLICIES = ("kv_aware", "cache_aware", "round_robin")
# --gpu: each replica's share of the H200 (weights ~1.2 GB; L1 8 GiB = 75K tokens of the model's
# 112 KiB a token, room to run 9 of TokenWorkload's 8K conversations at once) and of host memory
# (pinned L2 10 GiB: write-through copies every full L1 block there, so a replica holds about what
# its L2 holds); the Redis L3 (the whole workload, ~27 GiB) takes the rest of the 128 GiB
GPU_REPLICA_ARGS = ("--l1", "8GiB", "--l2", "10GiB", "--max-model-len", "8192", "--block-size", str(BLOCK_SIZE))
GPU_POLICIES = ("kv_aware", "round_robin")
# --smoke: the --gpu code path on a CPU, with bench_throughput's tiny Qwen3 (512 B a token)
TINY_VOCAB = 512  # bench_throughput.TINY_QWEN3's
SMOKE_REPLICA_ARGS = ("--l1", "4MiB", "--l2", "4MiB", "--max-model-len", "512", "--block-size", str(BLOCK_SIZE),
                      "--device", "cpu")


def summary(turns: list[Turn], wall_s: float, before: list[dict], after: list[dict]) -> dict:
    """Hit fractions of the prompt tokens: all cached ones (`hit_fraction`, what the usage says),
    those read from the shared L3 (`l3_fraction`: blocks the replicas read out of it) and the rest,
    which the replica that served the request held itself (`local_fraction`, L1 or L2)."""
    ok = [t for t in turns if t.error is None]
    prompt, cached = sum(t.prompt_tokens for t in ok), sum(t.cached_tokens for t in ok)
    delta = [{k: a[k] - b[k] for k in a} for b, a in zip(before, after)]
    from_l3 = BLOCK_SIZE * sum(d["l3_read"] for d in delta)
    frac = (lambda n: n / prompt) if prompt else (lambda n: 0.0)
    return {
        "requests": len(turns), "failed": len(turns) - len(ok), "errors": sorted({t.error for t in turns if t.error}),
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_fraction": frac(cached),
        "local_fraction": frac(cached - from_l3), "l3_fraction": frac(from_l3),
        "wall_s": wall_s, "requests_per_s": len(ok) / wall_s, "prompt_tokens_per_s": prompt / wall_s,
        "mean_latency_s": sum(t.seconds for t in ok) / len(ok) if ok else None,
        "per_replica_requests": [int(d["requests"]) for d in delta],
        **streamed(ok, wall_s),
    }


def streamed(ok: list[Turn], wall_s: float) -> dict:
    """What streamed requests add (TokenWorkload): output tokens/s, TTFT percentiles in seconds over
    every round and over the hit rounds alone (round 0 is cold under any router); {} otherwise."""
    if not any(t.ttft is not None for t in ok):
        return {}
    return {"output_tokens_per_s": sum(t.completion_tokens for t in ok) / wall_s,
            "ttft_s": pct([t.ttft for t in ok], scale=1.0),
            "ttft_hit_rounds_s": pct([t.ttft for t in ok if t.round > 0], scale=1.0)}


def measure(fleet: Fleet, url: str, work: Workload | TokenWorkload, budget_s: float = float("inf")) -> dict:
    """The workload from empty caches through `url`, summarised; rounds not begun within `budget_s`
    are not sent (`complete` says whether every round was)."""
    fleet.reset()
    # 0 unless a write from the last run reached Redis after the flush (it would hand this one hits)
    left = fleet.redis.client().dbsize()
    before = fleet.counters()
    t0 = time.perf_counter()
    turns = work.play(url, fleet.model, deadline=time.monotonic() + budget_s)
    wall = time.perf_counter() - t0
    fleet.settle()
    out = summary(turns, wall, before, fleet.counters())
    out["complete"], out["l3_keys_at_start"] = len(turns) == work.conversations * work.rounds, left
    return out


def compare(fleet: Fleet, work: Workload | TokenWorkload, workdir: Path, policies=POLICIES, one_server: bool = True,
            budget_s: float = float("inf"), done: Callable[[dict], object] | None = None) -> dict:
    """Each vllm-router policy over the whole fleet, and one replica alone (`one_server`), each given
    `budget_s` seconds for its rounds; `done` gets the results so far after each."""
    out = {}
    for policy in policies:
        with Router("vllm", policy, fleet.live, fleet.model, workdir / f"router-{policy}.log") as router:
            out[policy] = measure(fleet, router.url, work, budget_s)
            if policy == "kv_aware":  # what the events told it the chosen replicas held
                out[policy]["router_credited_tokens"] = sum(router.credited())
        if done:
            done(out)
    if one_server:
        out["one_server"] = measure(fleet, fleet.live[0].url, work, budget_s)
        if done:
            done(out)
    return out


def table(results: dict) -> str:
    rows = [f"{'':12} {'hit':>6} {'local':>6} {'L3':>6} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>8} {'p90':>6} "
            f"{'hit p90':>7} {'failed':>6}  requests per replica"]
    for name, r in results.items():
        ttft, hit = r.get("ttft_s") or {}, r.get("ttft_hit_rounds_s") or {}
        cells = [r.get("output_tokens_per_s"), ttft.get("p50"), ttft.get("p90"), hit.get("p90")]
        tok, p50, p90, hp90 = (f"{v:.2f}" if v is not None else "-" for v in cells)
        rows.append(f"{name:12} {r['hit_fraction']:6.3f} {r['local_fraction']:6.3f} {r['l3_fraction']:6.3f} "
                    f"{r['requests_per_s']:6.2f} {tok:>7} {p50:>8} {p90:>6} {hp90:>7} {r['failed']:6d}  "
                    f"{r['per_replica_requests']}")
    return "\n".join(rows)


def make_model(tmp: Path, smoke: bool) -> Path:
    """A random-weight Qwen3 saved under `tmp` (outside the tree): the 0.6B shape in bf16, built on
    the GPU, or bench_throughput's tiny one in fp32 on the CPU for --smoke. No tokenizer."""
    import torch
    from transformers import Qwen3Config

    from bench_throughput import QWEN3_06B, TINY_QWEN3, release_memory, save_random_model

    shape = TINY_QWEN3 if smoke else dict(QWEN3_06B, max_position_embeddings=8192)
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("--gpu serves replicas of a Qwen3-0.6B shape on a GPU; use --smoke on a CPU")
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    path = tmp / ("qwen3-tiny-random" if smoke else "qwen3-0.6b-random")
    model, _ = save_random_model(Qwen3Config(**shape), path, torch.device(device), dtype)
    del model
    release_memory()
    return path


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--gpu", action="store_true", help="the fleet on one GPU: a Qwen3-0.6B shape, TokenWorkload")
    mode.add_argument("--smoke", action="store_true", help="--gpu's code path on a CPU: a tiny model, a few requests")
    p.add_argument("--replicas", type=int, default=None, help="default 3; --gpu 4; --smoke 2")
    p.add_argument("--conversations", type=int, default=None, help="users (default: the workload's)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--context-tokens", type=int, default=None, help="--gpu: each conversation's own context")
    p.add_argument("--policies", default=None, help="comma-separated vllm-router policies (default: all three; "
                   "--gpu and --smoke: kv_aware,round_robin)")
    p.add_argument("--l1", default=None, help="--gpu: each replica's L1 (default 8GiB)")
    p.add_argument("--l2", default=None, help="--gpu: each replica's pinned L2 (default 10GiB)")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="seconds each policy may spend starting rounds (default: no limit; gpu_check.sh: 150)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    fleet_mode = a.gpu or a.smoke
    if a.smoke and a.out is None:  # a smoke run's figures are no results
        a.out = Path(tempfile.gettempdir()) / "bench_routers-smoke"
    if fleet_mode:
        work = TokenWorkload(conversations=4, rounds=2, system_tokens=32, context_tokens=64, question_tokens=12,
                             answer_tokens=4, vocab=TINY_VOCAB) if a.smoke else TokenWorkload()
        args = list(SMOKE_REPLICA_ARGS if a.smoke else GPU_REPLICA_ARGS)
        for flag, value in (("--l1", a.l1), ("--l2", a.l2)):
            if value is not None:
                args[args.index(flag) + 1] = value
        policies = GPU_POLICIES
    else:
        if a.context_tokens or a.l1 or a.l2:
            p.error("--context-tokens, --l1 and --l2 are --gpu's (the CPU fleet runs REPLICA_ARGS)")
        work, args, policies = Workload(), list(REPLICA_ARGS), POLICIES
    work = replace(work, **{k: v for k, v in (("conversations", a.conversations), ("rounds", a.rounds),
                                              ("context_tokens", a.context_tokens)) if v is not None})
    policies = tuple(a.policies.split(",")) if a.policies else policies
    replicas = a.replicas or (2 if a.smoke else 4 if a.gpu else 3)
    with tempfile.TemporaryDirectory(prefix="bench_routers-") as tmp:
        if fleet_mode:
            t0 = time.perf_counter()
            args = ["--model", str(make_model(Path(tmp), a.smoke)), *args]
            print(f"model made in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        fleet = Fleet(Path(tmp), replicas, args=tuple(args), work=work)
        print(f"{replicas} replicas up and warm in {time.perf_counter() - t0:.1f} s", flush=True)
        name = "routers_fleet" if fleet_mode else "routers"
        written = []  # the JSON after each policy: a run cut short keeps what it measured
        try:
            compare(fleet, work, Path(tmp), policies, one_server=not fleet_mode, budget_s=a.budget_s,
                    done=lambda results: written.append(report(results, work, replicas, a.out, args, name)))
        finally:
            fleet.stop()
    return written[-1]


def report(results: dict, work: Workload | TokenWorkload, replicas: int, out: Path | None = None,
           replica_args=REPLICA_ARGS, name: str = "routers") -> Path:
    """Print the table and write the JSON (benchmarks/results/<name>-<machine>.json by default);
    with streamed figures, a PNG of them beside it."""
    print(table(results), flush=True)
    figures = {"replicas": replicas, "workload": asdict(work), "replica_args": list(replica_args),
               "router": "vllm-router " + version("vllm-router"), "results": results}
    if isinstance(work, TokenWorkload):
        figures["workload_kv_tokens"] = work.kv_tokens()
        kv, rr = results.get("kv_aware"), results.get("round_robin")
        if kv and rr:  # the ratios the issue asks for: above 1 for throughput, below 1 for TTFT favour kv_aware
            figures["kv_aware_vs_round_robin"] = {
                "throughput": ratio(kv["requests_per_s"], rr["requests_per_s"]),
                "output_tokens_per_s": ratio(kv.get("output_tokens_per_s"), rr.get("output_tokens_per_s")),
                "p90_ttft": ratio(kv["ttft_s"]["p90"], rr["ttft_s"]["p90"]),
                "p90_ttft_hit_rounds": ratio(kv["ttft_hit_rounds_s"]["p90"], rr["ttft_hit_rounds_s"]["p90"])}
    path = write_results(name, figures, out)
    if isinstance(work, TokenWorkload):
        plot(results, path.with_suffix(".png"))
    return path


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where a side has no figure."""
    return a / b if a is not None and b else None


def plot(results: dict, path: Path) -> None:
    """Throughput and TTFT (p50 and p90, all rounds) per policy, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(names, [results[n]["output_tokens_per_s"] for n in names], color="tab:blue")
    left.set_ylabel("output tokens / s")
    x = np.arange(len(names))
    for i, q in enumerate(("p50", "p90")):
        right.bar(x + (i - 0.5) * 0.4, [results[n]["ttft_s"][q] or 0 for n in names], 0.4, label=f"TTFT {q}")
    right.set_xticks(x, names)
    right.set_ylabel("seconds")
    right.legend()
    fig.suptitle("tierkv-serve replicas behind vllm-router")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    print(main())
