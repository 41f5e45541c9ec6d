"""bench_long_context: a 100K-token prompt on a Llama-3.1-8B-shaped model, from every tier.

One run, bf16, random weights saved as safetensors (the model of bench_latency):
1. Cold prefill: TTFT of a --tokens (100K) random prompt through `tierkv.LLM` (one output
   token), against transformers' forward over the same prompt (sdpa, logits of the last token
   only, the same weights); target <= 1.0x transformers' time.
2. The same prompt again with its KV in L1, in L2 (`cache.evict("l1")`; and, in an engine of its
   own under write_back, right after that eviction, which only then copies the blocks down:
   `l2_after_write_back_evict`), and on the disk tier
   (L1 and L2 evicted, page cache dropped): TTFT each and speed-up over cold. Each hit is timed
   alone: the engine writes through to the disk tier in background threads, and the L1 and L2
   hits wait until it has taken the prompt (`cache.flush`; the warm-up's blocks too, before the
   cold run), since those writes contend for the GIL with the engine's thread. The L1 hit is also
   timed right after the cold run, with the writes still in flight (`l1_writes_in_flight`, and
   `writes_left_s`: how long the flush then waited), which shows what that contention costs.
   Load-or-recompute decides per tier; the disk case runs three times: as the engine chooses
   on its first read of the disk (speed unknown: a probe), as it chooses once that speed is
   measured (the end read while the start is recomputed), and forced to load (recompute
   estimate off, long prefetch deadline), so the JSON shows what loading alone would cost.
   Each hit is set against its physical floor measured in this run: an L2 hit's bytes over the
   pinned host->device bandwidth plus the compute of its uncached tail (the L1 hit's TTFT); a
   disk hit's best split between reading the end at the disk's raw read speed and recomputing
   the start at the cold per-token time, plus that tail. The same L2 hit is measured for a
   --short-tokens (12K) prompt, the multi-round serving case, and with --profile traced.
   Targets: L2 <= 1.5x its floor (12K and 100K) and >= 30x faster than cold; disk <= 1.3x its
   floor; no tier slower than cold.
3. A context 4x the L1 budget: L1 set to a quarter of the prompt's KV, so prefill and decode
   stream the older blocks from L2 layer by layer. Decode tok/s against the PCIe bound:
   bytes streamed per step (from the cache's counter) / pinned host->device bandwidth measured
   in this run (one large copy-engine transfer); target >= 80%.
4. With --serve: the 100K-token prompt through `tierkv-serve` with that small L1 (HTTP, token
   ids), checking the answer arrives.
Writes bench_long_context-<gpu>.json and a PNG of TTFT by tier.

With --kv-offload-dtype fp8_e4m3, L2 and the disk tier hold fp8 blocks (half the bytes; L1 stays
bf16) and the results go to bench_long_context_fp8_e4m3-<gpu>.json: the floors count the bytes
that really move. The fp8 speed-up of an L2 or disk hit is its TTFT against the same hit of a
run without the flag; run both at --tokens 100000 and at --tokens 12000 (the disk hit is timed at
--tokens only).

    python benchmarks/bench_long_context.py [--tokens 100000] [--kv-offload-dtype fp8_e4m3] [--serve] [--out DIR]
    python benchmarks/bench_long_context.py --smoke --out /tmp/x      # tiny Llama on CPU
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_latency import llama_setup, sync
from bench_throughput import release_memory, save_random_model
from common import write_results
from limits import disk_read_bandwidth, drop_page_cache, h2d_bandwidth

import tierkv
from tierkv.tiers.disk import THREADS as DISK_THREADS


@torch.inference_mode()
def hf_prefill_seconds(model, prompt: list[int], device: torch.device) -> float:
    """transformers forward over the whole prompt at once, logits of the last token only."""
    ids = torch.tensor([prompt], device=device)
    model(ids[:, :1024], logits_to_keep=1)  # warm-up
    sync(device)
    t = time.perf_counter()
    model(ids, logits_to_keep=1)
    sync(device)
    return time.perf_counter() - t


def ttft(llm: tierkv.LLM, prompt: list[int]) -> dict:
    """Time to the first (only) token, the prefix tokens the cache served, and from which tier."""
    before = {t: v["hit_tokens"] for t, v in llm.cache.stats()["tiers"].items()}
    t = time.perf_counter()
    out = llm.generate(prompt, tierkv.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
    seconds = time.perf_counter() - t
    after = llm.cache.stats()["tiers"]
    return dict(ttft_s=seconds, cached_tokens=out.cached_tokens,
                hit_tokens_by_tier={t: after[t]["hit_tokens"] - before[t] for t in after})


def l2_hit(llm: tierkv.LLM, prompt: list[int], h2d: float | None, profile_to: Path | None = None) -> dict:
    """Cold, L1 hit and L2 hit of `prompt`, and the L2 hit against its physical floor: its bytes
    (in L2's format: fp8 with --kv-offload-dtype) over the pinned host -> device bandwidth plus the
    compute of what is not cached (measured as the L1 hit's TTFT: the same new tokens attending
    over the same prefix, nothing to load). The hits run once the disk tier has the prompt."""
    runs = dict(cold=ttft(llm, prompt))
    # the same L1 hit twice: while the disk tier still takes the cold run's blocks, then alone
    runs["l1_writes_in_flight"] = ttft(llm, prompt)
    t = time.perf_counter()
    assert llm.cache.flush(timeout=600), "the disk tier did not take the prefix within 10 minutes"
    runs["l1_writes_in_flight"]["writes_left_s"] = time.perf_counter() - t
    runs["l1"] = ttft(llm, prompt)
    llm.cache.evict("l1")
    runs["l2"] = ttft(llm, prompt)
    if h2d:
        l2_bytes = runs["l2"]["hit_tokens_by_tier"]["l2"] * llm.cache.l2.layout.bytes_per_block / llm.cache.block_size
        runs["l2"]["floor_s"] = l2_bytes / h2d + runs["l1"]["ttft_s"]
        runs["l2"]["over_floor"] = runs["l2"]["ttft_s"] / runs["l2"]["floor_s"]
    if profile_to is not None and torch.cuda.is_available():  # the same hit again, under the profiler
        llm.cache.evict("l1")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            runs["l2_profiled_s"] = ttft(llm, prompt)["ttft_s"]
        prof.export_chrome_trace(str(profile_to))
    return runs


def disk_floor(runs: dict, disk_bps: float, bytes_per_token: float, tokens: int) -> float:
    """The fastest a disk hit of `tokens` cached tokens can be: read the end at the disk's raw
    speed while recomputing the start at the cold prefill's per-token time, split where both take
    as long; plus the compute of the uncached tail (the L1 hit's TTFT)."""
    read_s = tokens * bytes_per_token / disk_bps  # the whole prefix from disk
    compute_s = runs["cold"]["ttft_s"] * tokens / (tokens + 1)  # the whole prefix recomputed
    return read_s * compute_s / (read_s + compute_s) + runs["l1"]["ttft_s"]


def tier_runs(model_dir: str, prompt: list[int], short: list[int], disk: Path, device, dtype, kv_bytes: int,
              h2d: float | None, profile_to: Path | None, offload: str | None = None) -> dict:
    """Cold, then L1, L2 and disk hits of the same prompt, in one engine; and an L2 hit of a
    shorter prompt (the multi-round serving case), profiled when asked. `offload`: the
    kv_offload_dtype of L2 and the disk tier (None: bf16 like L1)."""
    l2 = 2 * kv_bytes + 2**30
    llm = tierkv.LLM(model_dir, device=str(device), dtype=dtype, l2=l2, kv_offload_dtype=offload,
                     l3=[f"file://{disk}?size={3 * kv_bytes + 2**30}"], write_policy="write_through")
    # warm-up on another prefix, long enough for every kernel configuration a 100K prefill uses
    # (chunks of the step budget, attention over a long prefix) to compile outside the timings
    ttft(llm, [t // 2 for t in prompt[:20000]])
    ttft(llm, [t // 2 for t in prompt[:20000]] + [1, 2, 3])  # and a short extend over it
    assert llm.cache.flush(timeout=600), "the disk tier did not take the warm-up within 10 minutes"
    short_runs = l2_hit(llm, short, h2d, profile_to)
    runs = l2_hit(llm, prompt, h2d)
    runs["short"] = short_runs
    scheduler = llm.engine.scheduler
    # disk: the first read from it (its speed unmeasured: a probe, the rest recomputed);
    # disk_measured: again, now judged by the measured speed (the end read while the start computes)
    for name, forced in (("disk", False), ("disk_measured", False), ("disk_forced_load", True)):
        llm.cache.evict("l1")
        llm.cache.evict("l2")
        estimate, deadline = scheduler.recompute_seconds_per_token, scheduler.prefetch_deadline_s
        if forced:  # load whatever the disk holds, however long it takes
            scheduler.recompute_seconds_per_token, scheduler.prefetch_deadline_s = None, 600.0
        cold_disk = drop_page_cache()
        runs[name] = ttft(llm, prompt)
        runs[name]["page_cache_dropped"] = cold_disk
        runs[name]["recompute_seconds_per_token"] = estimate
        scheduler.recompute_seconds_per_token, scheduler.prefetch_deadline_s = estimate, deadline
    runs["disk_store"] = llm.cache.stats()["l3_stores"]
    runs["stored_block_bytes_over_l1"] = llm.cache.l2.layout.bytes_per_block / llm.cache.layout.bytes_per_block
    llm.close()
    return runs


def write_back_run(model_dir: str, prompt: list[int], device, dtype, kv_bytes: int, cold_s: float,
                   offload: str | None = None) -> dict:
    """The L2 hit right after `cache.evict("l1")` under write_back (issue 29's case): the prompt's
    blocks are copied down to L2 only by that eviction, so the hit's loads follow those copies
    (a load into a slot waits for the copy out of it). L1 and L2 only; the speed-up is against
    tier_runs' cold run of the same prompt and model."""
    llm = tierkv.LLM(model_dir, device=str(device), dtype=dtype, l2=kv_bytes + 2**30, write_policy="write_back",
                     kv_offload_dtype=offload)
    ttft(llm, [t // 2 for t in prompt[:20000]])  # kernels compile on another prefix...
    llm.cache.evict("l1")
    llm.cache.synchronize()  # ... whose write-back ends before the timed runs
    llm.cache.evict("l2")
    computed = ttft(llm, prompt)
    llm.cache.evict("l1")  # the copies down start now; the hit comes right after
    run = ttft(llm, prompt)
    run.update(speedup_vs_cold=cold_s / run["ttft_s"], cold_in_this_engine_s=computed["ttft_s"])
    llm.close()
    return run


def streamed_run(model_dir: str, prompt: list[int], device, dtype, kv_bytes: int, decode_tokens: int,
                 h2d: float | None, offload: str | None = None) -> dict:
    """L1 = a quarter of the prompt's KV: prefill and decode stream the rest from L2."""
    l1 = kv_bytes // 4
    llm = tierkv.LLM(model_dir, device=str(device), dtype=dtype, l1=l1, l2=2 * kv_bytes + 2**30,
                     kv_offload_dtype=offload)
    engine, cache = llm.engine, llm.cache
    params = tierkv.SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    req = engine.add_request(prompt, params)
    stamps, streamed = [], []
    while engine.has_unfinished():
        outs = engine.step()
        if any(o.request_id == req.request_id and o.new_token_ids for o in outs):
            stamps.append(time.perf_counter())
            streamed.append(cache.streamer.bytes_read)
    assert len(stamps) == decode_tokens, f"{len(stamps)} tokens instead of {decode_tokens}"
    steps = len(stamps) - 1
    decode_s = stamps[-1] - stamps[0]
    bytes_per_step = (streamed[-1] - streamed[0]) / max(steps, 1)
    out = dict(l1_bytes=cache.l1.num_blocks * cache.layout.bytes_per_block, kv_bytes=kv_bytes,
               context_over_l1=kv_bytes / (cache.l1.num_blocks * cache.layout.bytes_per_block),
               ttft_s=stamps[0] - t0, decode_tok_s=steps / decode_s, streamed_bytes_per_step=bytes_per_step)
    if h2d:
        out["pcie_bound_tok_s"] = h2d / bytes_per_step
        out["fraction_of_pcie_bound"] = out["decode_tok_s"] / out["pcie_bound_tok_s"]
    llm.close()
    return out


def serve_run(model_dir: str, prompt: list[int], l1: int, l2: int, port: int = 8123,
              offload: str | None = None) -> dict:
    """The prompt through tierkv-serve (small L1, so it streams): HTTP status, tokens, seconds."""
    cmd = ["tierkv-serve", "--model", model_dir, "--port", str(port), "--l1", str(l1), "--l2", str(l2),
           "--log-level", "warning"] + (["--kv-offload-dtype", offload] if offload else [])
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"tierkv-serve exited: {server.stderr.read()[-2000:]}")
                time.sleep(0.5)
        body = json.dumps({"model": Path(model_dir).name, "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
        t = time.perf_counter()
        request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=900) as resp:
            answer = json.load(resp)
        seconds = time.perf_counter() - t
        return dict(status=200, seconds=seconds, usage=answer["usage"],
                    completion_tokens=answer["usage"]["completion_tokens"])
    finally:
        server.terminate()
        server.wait(60)


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = figures["tiers"]
    names = ["cold", "l1", "l2", "disk", "disk_measured", "disk_forced_load"]
    labels = ["cold\n(recompute)", "L1 hit", "L2 hit", "disk hit\n(first read)", "disk hit\n(speed known)",
              "disk hit\n(forced load)"]
    values = [runs[n]["ttft_s"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.bar(labels, values, color=["#888", "#2a7", "#3a8fd8", "#d89a3a", "#b8862a", "#c55"])
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f} s", ha="center", va="bottom")
    if "peer" in figures:
        ax.axhline(figures["peer"]["prefill_s"], ls="--", c="k", lw=1, label="transformers prefill")
        ax.legend()
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{figures['workload']['tokens']:,}-token prompt, {figures['workload']['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--short-tokens", type=int, default=12_000, help="prompt of the short L2-hit case")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--profile", action="store_true", help="torch.profiler trace of the short L2 hit, in --out")
    p.add_argument("--disk", type=Path, default=None, help="directory for the disk tier (default: a temp dir)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--serve", action="store_true", help="also send the prompt through tierkv-serve")
    p.add_argument("--no-streamed", action="store_true", help="skip part 3 (the context 4x the L1 budget)")
    p.add_argument("--no-write-back", action="store_true", help="skip the L2 hit right after an eviction under "
                   "write_back (part 2)")
    p.add_argument("--kv-offload-dtype", default=None, metavar="fp8_e4m3",
                   help="hold L2 and disk blocks in this format (L1 stays bf16; tierkv checks the value); "
                   "default: bf16 everywhere")
    p.add_argument("--smoke", action="store_true", help="tiny Llama on CPU: checks the script")
    p.add_argument("--out", type=Path, default=None, help="results directory (benchmarks/results)")
    a = p.parse_args()
    if a.smoke:
        a.tokens, a.decode_tokens, a.short_tokens = 600, 8, 200

    config, device, dtype = llama_setup(a.smoke)
    rng = random.Random(0)
    prompt = [rng.randrange(config.vocab_size) for _ in range(a.tokens)]
    figures = dict(workload=dict(model="Llama-3.1-8B shape, random weights" if not a.smoke else "tiny Llama (smoke)",
                                 dtype=str(dtype), tokens=a.tokens, decode_tokens=a.decode_tokens,
                                 kv_offload_dtype=a.kv_offload_dtype),
                   targets=dict(cold_vs_peer="<= 1.0", l2_speedup=">= 30", l2_over_floor="<= 1.5 (12K and 100K)",
                                every_tier_vs_cold="<= 1.0", disk_over_floor="<= 1.3",
                                streamed_decode_fraction_of_pcie_bound=">= 0.8"))
    short = [rng.randrange(config.vocab_size) for _ in range(min(a.short_tokens, a.tokens))]
    h2d = h2d_bandwidth(2**30) if device.type == "cuda" else None
    figures["pinned_h2d_gbps"] = h2d / 1e9 if h2d else None
    figures["workload"]["short_tokens"] = len(short)
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        model_dir, disk = Path(tmp) / "model", a.disk or Path(tmp) / "disk"
        disk.mkdir(parents=True, exist_ok=True)
        disk_bps, how = disk_read_bandwidth(disk, 2**31 if device.type == "cuda" else 2**26,
                                             threads=DISK_THREADS)  # as the disk tier reads
        figures["disk_raw_read_gbps"], figures["disk_raw_read_kind"] = disk_bps / 1e9, how
        t = time.perf_counter()
        model, sizes = save_random_model(config, model_dir, device, dtype)
        figures["model_sizes"], figures["build_and_save_s"] = sizes, time.perf_counter() - t
        kv_bytes = sizes["kv_bytes_per_token"] * a.tokens
        if not a.no_peer:
            figures["peer"] = dict(peer="transformers forward, sdpa, logits_to_keep=1",
                                   prefill_s=hf_prefill_seconds(model, prompt, device))
            print(f"transformers prefill of {a.tokens} tokens: {figures['peer']['prefill_s']:.2f} s", flush=True)
        del model
        release_memory()

        profile_to = (a.out or Path(tmp)) / "l2_hit_trace.json" if a.profile else None
        runs = tier_runs(str(model_dir), prompt, short, disk, device, dtype, kv_bytes, h2d, profile_to,
                         a.kv_offload_dtype)
        cold = runs["cold"]["ttft_s"]
        for name in ("l1", "l1_writes_in_flight", "l2", "disk", "disk_measured", "disk_forced_load"):
            runs[name]["speedup_vs_cold"] = cold / runs[name]["ttft_s"]
        # the disk holds the bytes of L2's format: fp8 blocks are about half of bf16's
        stored_ratio = figures["stored_block_bytes_over_l1"] = runs.pop("stored_block_bytes_over_l1")
        floor = disk_floor(runs, disk_bps, sizes["kv_bytes_per_token"] * stored_ratio, a.tokens - 1)
        for name in ("disk", "disk_measured", "disk_forced_load"):
            runs[name]["floor_s"] = floor
            runs[name]["over_floor"] = runs[name]["ttft_s"] / floor
        figures["tiers"] = runs
        if "peer" in figures:
            figures["cold_vs_peer"] = cold / figures["peer"]["prefill_s"]
        figures["slowest_tier_vs_cold"] = max(runs[n]["ttft_s"] for n in ("l1", "l2", "disk", "disk_measured")) / cold
        release_memory()
        if not a.no_write_back:
            runs["l2_after_write_back_evict"] = write_back_run(str(model_dir), prompt, device, dtype, kv_bytes, cold,
                                                               a.kv_offload_dtype)
            release_memory()
        if not a.no_streamed:
            figures["streamed"] = streamed_run(str(model_dir), prompt, device, dtype, kv_bytes, a.decode_tokens,
                                               h2d, a.kv_offload_dtype)
        if a.serve:
            figures["serve"] = serve_run(str(model_dir), prompt, kv_bytes // 4, 2 * kv_bytes + 2**30,
                                         offload=a.kv_offload_dtype)

    name = "bench_long_context" + (f"_{a.kv_offload_dtype}" if a.kv_offload_dtype else "")
    path = write_results(name, figures, a.out)
    plot(figures, path.with_suffix(".png"))
    print(f"\n{'prompt of ' + format(a.tokens, ','):<26} {'TTFT s':>9} {'vs cold':>9}  served from")
    for name, r in runs.items():
        if name in ("disk_store", "short"):
            continue
        floor = f"  {r['over_floor']:.2f}x its floor {r['floor_s']:.3f} s" if "floor_s" in r else ""
        print(f"{name:<26} {r['ttft_s']:9.2f} {cold / r['ttft_s']:8.1f}x  {r['hit_tokens_by_tier']}{floor}")
    for name, r in runs["short"].items():
        if isinstance(r, dict):
            floor = f"  {r['over_floor']:.2f}x its floor {r['floor_s']:.3f} s" if "floor_s" in r else ""
            print(f"{len(short):,}-token {name:<20} {r['ttft_s']:9.3f} s{floor}")
    if "peer" in figures:
        print(f"cold / transformers prefill: {figures['cold_vs_peer']:.2f}x (target <= 1.0)")
    if "streamed" in figures:
        s = figures["streamed"]
        line = f"streamed decode, context {s['context_over_l1']:.1f}x L1: {s['decode_tok_s']:.2f} tok/s"
        if "fraction_of_pcie_bound" in s:
            line += f" = {s['fraction_of_pcie_bound']:.0%} of the PCIe bound {s['pcie_bound_tok_s']:.2f} tok/s (target >= 80%)"
        print(line)
    if "serve" in figures:
        print(f"tierkv-serve: {figures['serve']['completion_tokens']} tokens in {figures['serve']['seconds']:.1f} s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
