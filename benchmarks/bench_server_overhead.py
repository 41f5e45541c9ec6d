"""bench_server_overhead: what tierkv-serve adds to an L2 hit, against LLM.generate on the same prompts.

How: --users users, each with a long history (--prefix-tokens random ids, seeded), are visited one
request at a time in a fixed rotation for --rounds rounds. Each round appends an answer
(--answer-tokens fixed random ids, so both paths see the same prompts whatever they generate) and a
question (--question-tokens) to the user's history. L1 holds only --l1-users users' KV, so when a
user comes back the rotation has pushed its history down to L2: every round after the first finds
~prefix tokens in L2 and computes ~answer + question. The same rotation runs twice on the same
model, tier sizes and sampling (greedy, --max-tokens, logprobs=1):
  http  a `tierkv-serve` process; streamed token-id prompts on /v1/completions over one keep-alive
        connection, each body encoded before its timer starts; TTFT = the first chunk's arrival.
  llm   `LLM` in this process, driven by LLM.generate's own loop (add_request, then step() until
        done); TTFT = when step() returns the request's first token.
Each path first gets a cold warm-up request. Reported: TTFT of the hit rounds (p50, mean, each) per
path, hit tokens per tier over those rounds, and http / llm p50 (target <= 1.15, issue 29). For
http also the server's own mean TTFT over those rounds (its /metrics histogram: from the handler's
hand-off to the engine to the first token back in its event loop), which splits the difference
into what comes before and after the engine. Per path, the CPU time of the process serving the
requests (all threads) per hit request: steadier than wall time on a shared machine. With --py-spy,
a py-spy summary of the server during the hit rounds.

    python benchmarks/bench_server_overhead.py           # H200: random-weight Llama-3.1-8B shape, ~3 min
    python benchmarks/bench_server_overhead.py --smoke   # CPU: tiny Llama, < 1 min

Writes benchmarks/results/bench_server_overhead-<machine>.json (--out for another folder). It reads
the server only through its public HTTP API (and py-spy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the server launcher the tests use
import pyspy  # noqa: E402
from common import RESULTS, environment, machine_tag, write_results  # noqa: E402
from serving.client import stats_delta  # noqa: E402
from serving.model import describe, make_model  # noqa: E402
from server_helpers import ServerProcess, metric  # noqa: E402

TARGET = 1.15  # issue 29: TTFT through HTTP <= 1.15x LLM.generate's on a 12K-token L2 hit
BLOCK = 16
H200 = dict(users=8, rounds=3, prefix_tokens=12_000, question_tokens=100, answer_tokens=32, max_tokens=32,
            l1_users=3, max_num_seqs=8)
SMOKE = dict(users=4, rounds=3, prefix_tokens=2_000, question_tokens=100, answer_tokens=16, max_tokens=8,
             l1_users=2, max_num_seqs=4)


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--smoke", action="store_true", help="a tiny Llama on a CPU, small sizes (checks that everything runs)")
    add("--model", type=Path, help="a ready HF model directory (default: make a random-weight Llama: the "
        "Llama-3.1-8B shape on a GPU, the tiny one with --smoke)")
    for k, v in H200.items():
        add(f"--{k.replace('_', '-')}", type=int, help=f"H200 {v}, smoke {SMOKE[k]}")
    add("--paths", default="http,llm", help="comma list of http, llm (default both)")
    add("--py-spy", action="store_true", help="sample the server with py-spy during the hit rounds; its summary "
        "goes to OUT/profiles/server_hit_<machine>-pyspy.txt (needs py-spy: pip install py-spy)")
    add("--server-args", default="", help="more tierkv-serve flags, space separated")
    add("--timeout", type=float, default=600.0, help="seconds for the server to start, and for one request")
    add("--seed", type=int, default=0)
    add("--tmp", type=Path, help="directory for the made model (default: system temp)")
    add("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.smoke else H200).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.py_spy and not pyspy.available():
        p.error("--py-spy needs the py-spy binary on PATH: pip install py-spy")
    bad = set(a.paths.split(",")) - {"http", "llm"}
    if bad:
        p.error(f"unknown paths {sorted(bad)}: give http, llm or both")
    if a.l1_users >= a.users:
        p.error("--l1-users must be below --users, or the histories stay in L1 and nothing hits L2")
    return a


def make_prompts(a, vocab: int) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
    """A cold warm-up prompt (kernels compile outside the timings), and (round, user, prompt) in
    visiting order: round r's prompt is round r-1's plus an answer and a question. Ids are random in
    [100, vocab), seeded, so no two prompts share a block unless one extends the other."""
    import numpy as np

    rng = np.random.default_rng(a.seed)

    def ids(n: int) -> list[int]:
        return rng.integers(100, vocab, n).tolist()

    warm = ids(a.prefix_tokens + a.question_tokens)
    history = [ids(a.prefix_tokens) for _ in range(a.users)]
    rotation = []
    for r in range(a.rounds):
        for u in range(a.users):
            if r:
                history[u] = history[u] + ids(a.answer_tokens)
            history[u] = history[u] + ids(a.question_tokens)
            rotation.append((r, u, history[u]))
    return warm, rotation


def sizes(a, kv_bytes_per_token: int) -> dict:
    """L1 holds --l1-users of the longest histories, L2 all of them twice over; the context fits the
    longest prompt and its answer."""
    longest = a.prefix_tokens + a.rounds * (a.answer_tokens + a.question_tokens) + a.max_tokens
    blocks = math.ceil(longest / BLOCK) + 1
    return dict(l1=a.l1_users * blocks * BLOCK * kv_bytes_per_token,
                l2=2 * a.users * blocks * BLOCK * kv_bytes_per_token,
                max_model_len=256 * math.ceil((longest + 1) / 256))


def summary(timed: list[dict]) -> dict:
    hits = [t["ttft_s"] for t in timed if t["round"] > 0]
    return dict(ttft_p50_s=statistics.median(hits), ttft_mean_s=statistics.fmean(hits), ttft_hits_s=hits,
                ttft_cold_s=[t["ttft_s"] for t in timed if t["round"] == 0])


# ---------------------------------------------------------------------------- http


def http_ttft(client: httpx.Client, url: str, body: bytes, max_tokens: int) -> float:
    """One streamed completion; seconds to its first token's chunk. Every token must arrive."""
    start, first, tokens = time.perf_counter(), None, 0
    with client.stream("POST", url + "/v1/completions", content=body,
                       headers={"Content-Type": "application/json"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream ended in an error after {tokens} tokens: {event['error']}")
            choices = event.get("choices") or ()
            if choices and choices[0].get("logprobs"):
                first = first if first is not None else time.perf_counter() - start
                tokens += len(choices[0]["logprobs"]["tokens"])
    if tokens != max_tokens:
        raise RuntimeError(f"{tokens} of {max_tokens} tokens came back")
    return first


def run_http(a, model_dir: Path, tier: dict, prompts, tmp: Path) -> dict:
    warm, rotation = prompts
    args = ["--model", str(model_dir), "--served-model-name", "bench", "--l1", str(tier["l1"]), "--l2",
            str(tier["l2"]), "--max-model-len", str(tier["max_model_len"]), "--max-num-seqs", str(a.max_num_seqs),
            "--log-level", "warning", "--grace-period", "5", "--flush-timeout", "1", *a.server_args.split()]
    srv = ServerProcess(args, tmp / "server.log")
    try:
        t = time.perf_counter()
        srv.wait_ready(a.timeout)
        start_s = time.perf_counter() - t
        print(f"http: server up in {start_s:.1f} s", flush=True)
        with httpx.Client(timeout=a.timeout) as client:
            def body(prompt):
                return json.dumps({"model": "bench", "prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0,
                                   "ignore_eos": True, "logprobs": 1, "stream": True}).encode()

            def stats():
                return client.get(srv.url + "/v1/cache/stats").json()

            def server_ttft() -> tuple[float, float]:  # the server's own TTFT histogram: sum, count
                text = client.get(srv.url + "/metrics").text
                return tuple(metric(text, f"tierkv_time_to_first_token_seconds_{k}") for k in ("sum", "count"))

            http_ttft(client, srv.url, body(warm), a.max_tokens)
            timed = [dict(round=0, user=u, ttft_s=http_ttft(client, srv.url, body(p), a.max_tokens))
                     for r, u, p in rotation if r == 0]
            before, (s0, n0), cpu0 = stats(), server_ttft(), cpu_seconds(srv.proc.pid)
            spy = contextlib.nullcontext()
            if a.py_spy:
                profile = tmp / "server.pyspy"
                spy = pyspy.record(srv.proc.pid, profile)
            try:
                with spy:
                    timed += [dict(round=r, user=u, ttft_s=http_ttft(client, srv.url, body(p), a.max_tokens))
                              for r, u, p in rotation if r > 0]
            except pyspy.PySpyError as err:  # raised after the rounds: their timings stand
                print(f"http: {err}", flush=True)
                profile = None
            cpu = cpu_seconds(srv.proc.pid) - cpu0
            hits = hits_between(before, stats())
            s1, n1 = server_ttft()
    except Exception:
        print(f"http: a request failed; server log tail:\n{srv.log()[-4000:]}", flush=True)
        raise
    finally:
        if srv.stop() != 0:
            print(f"http: server exited badly; log tail:\n{srv.log()[-1500:]}", flush=True)
    out = dict(server_start_s=start_s, server_args=args, hit_tokens=hits, **summary(timed), requests=timed,
               # what the server itself counts: from its handler's hand-off to the engine to the first
               # token back in its event loop (no JSON parsing, no socket, no client)
               server_ttft_mean_s=(s1 - s0) / (n1 - n0) if n1 > n0 else None, cpu_s_per_hit=cpu / (n1 - n0))
    if a.py_spy:
        out["py_spy"] = save_profile(profile, a.out) if profile is not None else "py-spy failed (see the log)"
    return out


def save_profile(raw: Path, out_dir: Path) -> str:
    path = Path(out_dir) / "profiles" / f"server_hit_{machine_tag()}-pyspy.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(pyspy.summarise(raw, "tierkv-serve during the hit rounds of bench_server_overhead "
                                    f"({environment()['git_commit']})") + "\n")
    return str(path)


# ---------------------------------------------------------------------------- llm


def run_llm(a, model_dir: Path, tier: dict, prompts) -> dict:
    warm, rotation = prompts
    import tierkv

    llm = tierkv.LLM(str(model_dir), l1=tier["l1"], l2=tier["l2"], max_model_len=tier["max_model_len"],
                     max_num_seqs=a.max_num_seqs)
    params = tierkv.SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=1)
    engine = llm.engine

    def ttft(prompt) -> float:
        """LLM.generate's loop, timed at the request's first token."""
        start, first = time.perf_counter(), None
        req = engine.add_request(prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                if first is None and out.request_id == req.request_id and out.token_ids:
                    first = time.perf_counter() - start
        return first

    try:
        ttft(warm)
        timed = [dict(round=0, user=u, ttft_s=ttft(p)) for r, u, p in rotation if r == 0]
        before, cpu0 = engine.cache_stats(), time.process_time()
        hit_rounds = [dict(round=r, user=u, ttft_s=ttft(p)) for r, u, p in rotation if r > 0]
        cpu = time.process_time() - cpu0
        hits = hits_between(before, engine.cache_stats())
    finally:
        llm.close()
    return dict(hit_tokens=hits, **summary(timed + hit_rounds), requests=timed + hit_rounds,
                cpu_s_per_hit=cpu / len(hit_rounds))


def hits_between(before: dict | None, after: dict | None) -> dict | None:
    """Hit tokens per tier between two cache-stats snapshots."""
    delta = stats_delta(before, after)
    return None if delta is None else {tier: d["hit_tokens"] for tier, d in delta.items()}


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used, all its threads (Linux /proc): on a shared machine, steadier
    than wall time for what a path costs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# ---------------------------------------------------------------------------- main


def main(argv=None) -> Path:
    a = parse(argv)
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="bench-server-overhead-", dir=a.tmp))
    try:
        if a.model is not None:
            model = describe(json.loads((a.model / "config.json").read_text()), "dir", a.model)
            build_s = None
        else:
            threads = torch.get_num_threads()
            model, build_s = make_model("tiny" if a.smoke else "llama-3.1-8b", tmp)
            torch.set_num_threads(threads)  # as many as the server's: making a tiny model sets 1
        tier = sizes(a, model.kv_bytes_per_token)
        prompts = make_prompts(a, model.vocab_size)
        print(f"model {model.source} {model.shape}; L1 {tier['l1'] / 2**30:.2f} GiB ({a.l1_users} histories), "
              f"L2 {tier['l2'] / 2**30:.2f} GiB; {a.users} users x {a.rounds} rounds, prefix {a.prefix_tokens}",
              flush=True)
        out = dict(device="cuda" if torch.cuda.is_available() else "cpu", argv=sys.argv[1:] if argv is None else argv,
                   model=dict(source=model.source, **model.shape, vocab_size=model.vocab_size,
                              kv_bytes_per_token=model.kv_bytes_per_token, build_and_save_s=build_s),
                   workload={k: getattr(a, k) for k in H200}, sizes=tier, target_ratio=TARGET, paths={})
        for path in a.paths.split(","):
            t = time.perf_counter()
            out["paths"][path] = (run_http(a, model.path, tier, prompts, tmp) if path == "http"
                                  else run_llm(a, model.path, tier, prompts))
            fig = out["paths"][path]
            own = f", the server's own mean {fig['server_ttft_mean_s'] * 1e3:.1f} ms" if fig.get("server_ttft_mean_s") else ""
            print(f"{path}: hit TTFT p50 {fig['ttft_p50_s'] * 1e3:.1f} ms, mean {fig['ttft_mean_s'] * 1e3:.1f} ms{own}; "
                  f"CPU {fig['cpu_s_per_hit'] * 1e3:.0f} ms a hit request; hit tokens {fig['hit_tokens']} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
        if {"http", "llm"} <= out["paths"].keys():
            out["ratio_http_over_llm_p50"] = out["paths"]["http"]["ttft_p50_s"] / out["paths"]["llm"]["ttft_p50_s"]
            out["ratio_http_over_llm_mean"] = out["paths"]["http"]["ttft_mean_s"] / out["paths"]["llm"]["ttft_mean_s"]
            out["meets_target"] = out["ratio_http_over_llm_p50"] <= TARGET
            print(f"http / llm: p50 {out['ratio_http_over_llm_p50']:.2f}x, mean {out['ratio_http_over_llm_mean']:.2f}x "
                  f"(target <= {TARGET}x)")
        path = write_results("bench_server_overhead", out, a.out)
        print(f"wrote {path}")
        return path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    # `timeout` sends SIGTERM: leave through the finally blocks, so the server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
