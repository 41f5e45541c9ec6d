"""bench_throughput: offline generation throughput, tierkv vs transformers continuous batching, one run.

Workload (nano-vllm's bench.py): --num-prompts (256) prompts of random token ids, input and output
lengths uniform in [100, 1024] (seeded), greedy, EOS ignored, so every request generates exactly
its output length. Model: Qwen3-0.6B shape (--family: a MoE shape, see FAMILIES), random weights, bf16 on the GPU, saved once as a HF
directory that both engines load. Figure: output tokens / wall seconds of the generate call.

tierkv: `LLM(model=dir).generate(token ids, SamplingParams(temperature=0, max_tokens=out,
ignore_eos=True))`, timed after a short warm-up (Triton compilation).
peer:   transformers continuous batching with attn "paged|sdpa", driven the way `generate_batch`
drives it (`continuous_batching_context_manager` + `add_request`), because `generate_batch` takes
one max_new_tokens for all requests and this workload has one per request; EOS disabled (-1);
timed after its own warm-up. If that API is missing or fails: `model.generate` in padded batches
of 64 (rows run to the batch's longest output; only the workload's own tokens are counted).
--peer-prompts runs the peer on the first K prompts only (the JSON records exactly what ran).

Roofline (HBM bandwidth only): the scheduler of the timed run is wrapped to record every step.
A step must read all weights once plus the KV of every sequence in it up to its last new token:
    step_bytes = weight_bytes + kv_bytes_per_token * sum_i(num_computed_i + num_new_i)
    roofline_s = sum over steps of step_bytes / hbm_bw,   fraction = roofline_s / measured seconds
weight_bytes counts every parameter once (the tied embedding is read whole by the LM head);
hbm_bw = bytes read + written by a large device-to-device copy, measured in this run (on the H200
it beats SDPA's contiguous-KV read figure, so it is the better ceiling of the two). Prefill FLOPs
are ignored, so the whole-run fraction is pessimistic; the decode-only fraction (pure decode
steps, each timed between consecutive schedule calls: the engine syncs once per step) is the
one the target (>= 70%, issue 40) is about.

    python benchmarks/bench_throughput.py [--num-prompts 256] [--peer-prompts K] [--out DIR]
    python benchmarks/bench_throughput.py --smoke --out /tmp/x     # tiny model on CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine_tag, write_results
from profiling import StepWindow, print_profile

import tierkv

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=4096)
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                  max_position_embeddings=512)
# --family: (transformers config class, shape, tiny shape, name). The MoE shapes keep the real
# layer's sizes with fewer layers: both engines hold the weights on one GPU at once, and the
# checkpoint is written to the machine's disk.
FAMILIES = {
    "qwen3": ("Qwen3Config", QWEN3_06B, TINY_QWEN3, "Qwen3-0.6B shape"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=12,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=4096),
        dict(TINY_QWEN3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
        "Qwen3-30B-A3B shape, 12 of its 48 layers"),
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=6, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 3, vocab_size=201088, tie_word_embeddings=False,
        max_position_embeddings=4096),
        dict(TINY_QWEN3, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False),
        "gpt-oss-20b shape, 6 of its 24 layers"),
}


ATTN = {"gpt_oss": "eager"}  # transformers' attention for the family: gpt-oss's sinks have no sdpa path
NAME = {family: "bench_throughput" if family == "qwen3" else f"bench_throughput_{family}" for family in FAMILIES}


# ---------------------------------------------------------------------------- shared helpers
# (bench_latency.py imports these)


def device_and_dtype(smoke: bool) -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available() and not smoke:
        return torch.device("cuda"), torch.bfloat16
    # tiny shapes on a CPU: one thread, as intra-op threads cost more than they save there (and
    # crawl on a loaded machine); fp32, as bf16 matmuls on a CPU are slow and prove nothing
    torch.set_num_threads(1)
    return torch.device("cpu"), torch.float32


def hbm_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read + written (CUDA events on a GPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch / allocator warm-up
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        seconds = time.perf_counter() - t
    return 2 * nbytes * reps / seconds


def save_random_model(config, path: Path, device: torch.device, dtype: torch.dtype,
                      attn: str = "sdpa") -> tuple[torch.nn.Module, dict]:
    """Build a random-weight HF model of `config` directly on `device` in `dtype` (HF's own init:
    normal(0, 0.02), on the GPU in well under a second even at 8B), save it as safetensors in
    `path`, and return it with the byte counts the roofline needs."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.eval().requires_grad_(False)
    model.save_pretrained(path, max_shard_size="5GB")
    # parameters() yields a tied embedding once; an untied input embedding only gathers a few
    # rows per step, so it is not part of what a step must read
    weight = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.tie_word_embeddings:
        weight -= model.get_input_embeddings().weight.nbytes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
    return model, dict(weight_bytes_per_step=weight, kv_bytes_per_token=kv_per_token,
                       num_parameters=sum(p.numel() for p in model.parameters()))


def release_memory() -> None:
    """Collect dropped models and give cached GPU memory back, so the next engine sizes its KV
    pool from memory that is really free (callers `del` their references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- tierkv


def run_tierkv(model_dir: Path, device, dtype, prompts, out_lens, warm, a, sizes: dict, bw: float,
               prefix_caching: bool) -> dict:
    llm = tierkv.LLM(model=str(model_dir), device=str(device), dtype=dtype, enable_prefix_caching=prefix_caching,
                     max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, l2=a.l2,
                     write_policy=a.write_policy)
    params = [tierkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(warm, tierkv.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)

    # record each step as the scheduler hands it to the runner: (start time, is decode, sequences,
    # KV tokens read = each sequence's context up to its last new token)
    steps: list[tuple[float, bool, int, int]] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        t = time.perf_counter()
        step = schedule()
        if len(step):
            kv = sum(r.num_computed + n for r, n in zip(step.requests, step.num_new))
            steps.append((t, step.is_decode, len(step), kv))
        return step

    # and the GPU time of each step: events queued before and after its launch (no sync)
    runner, run = llm.engine.runner, llm.engine.runner.run
    events: list[tuple[bool, torch.cuda.Event, torch.cuda.Event]] = []

    def timed_run(step, previous=None):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launched = run(step, previous)
        end.record()
        events.append((step.is_decode, start, end))
        return launched

    scheduler.schedule = recording_schedule
    if device.type == "cuda":
        runner.run = timed_run
    preempted = scheduler.num_preemptions
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    scheduler.schedule, runner.run = schedule, run
    torch.cuda.synchronize() if device.type == "cuda" else None
    gpu_decode_s = sum(s.elapsed_time(e) for d, s, e in events if d) / 1e3
    gpu_other_s = sum(s.elapsed_time(e) for d, s, e in events if not d) / 1e3

    produced = sum(len(o.token_ids) for o in outs)
    ends = [s[0] for s in steps[1:]] + [t0 + seconds]
    step_s = [end - s[0] for s, end in zip(steps, ends)]
    roof_s = [(sizes["weight_bytes_per_step"] + sizes["kv_bytes_per_token"] * s[3]) / bw for s in steps]
    decode = [i for i, s in enumerate(steps) if s[1]]
    decode_wall = sum(step_s[i] for i in decode)
    result = dict(
        prefix_caching=prefix_caching, l2_blocks=llm.cache.l2.num_blocks if llm.cache.l2 else 0,
        write_policy=llm.engine.config.write_policy,  # as resolved: tierkv's default unless --write-policy
        seconds=seconds, output_tokens=produced, output_tok_s=produced / seconds,
        all_requests_full_length=all(len(o.token_ids) == n for o, n in zip(outs, out_lens)),
        steps=len(steps), decode_steps=len(decode), preemptions=scheduler.num_preemptions - preempted,
        mean_decode_batch=statistics.fmean(steps[i][2] for i in decode) if decode else 0.0,
        roofline_seconds=sum(roof_s), roofline_tok_s=produced / sum(roof_s),
        roofline_fraction=sum(roof_s) / seconds,
        decode_seconds=decode_wall, decode_roofline_seconds=sum(roof_s[i] for i in decode),
        decode_roofline_fraction=sum(roof_s[i] for i in decode) / decode_wall if decode_wall else None,
        # GPU time from each decode step's launch to its end (queued work included): against the
        # steps' wall time it says whether the host or the GPU sets the pace
        decode_gpu_seconds=gpu_decode_s or None,
        other_steps_seconds=seconds - decode_wall, other_steps_gpu_seconds=gpu_other_s or None,
        decode_gpu_roofline_fraction=sum(roof_s[i] for i in decode) / gpu_decode_s if gpu_decode_s else None,
    )
    if a.profile and device.type == "cuda":
        # the same workload again, tracing decode steps in its steady state (the batch full, the
        # contexts mixed), which is what the roofline fraction above is about
        trace = Path(a.out or RESULTS) / f"throughput_trace-{machine_tag()}.json.gz"
        window = StepWindow(first=len(steps) // 3, count=a.profile_steps, trace_path=trace, top=20)

        def profiled_run(step, previous=None):
            launched = run(step, previous)
            window.step()
            return launched

        runner.run = profiled_run
        llm.generate(warm_like(prompts), params, use_tqdm=False)
        runner.run = run
        result["profile"] = window.summary
        if window.summary is not None:
            print_profile(window.summary, f"{a.profile_steps} steps from step {window.first} of the workload")
    llm.close()
    del llm, outs
    release_memory()
    return result


def warm_like(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts with their first token changed, so that the cache holds none of them."""
    return [[(p[0] + 1) % 1000] + p[1:] for p in prompts]


# ---------------------------------------------------------------------------- the peer


def run_peer(model_dir: Path, prompts, out_lens, device, dtype, attn: str = "sdpa") -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=f"paged|{attn}")
    model = model.to(device).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(out_lens), eos_token_id=-1, pad_token_id=0)
    produced, error = 0, None
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        # the hints generate_batch itself would compute (they size the peer's paged cache)
        hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(out_lens),
                              num_requests=len(prompts))
        options = {}
        if attn == "eager":
            from transformers import ContinuousBatchingConfig

            # eager attention materialises [heads, batch tokens, context] scores the paged cache's
            # sizing does not count: at its default 90% of free memory, gpt-oss's loop ran 8 GiB
            # short on the H200. Half still holds every prompt and its output many times over.
            options["continuous_batching_config"] = ContinuousBatchingConfig(max_memory_percent=0.5)
        with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=5,
                                                       workload_hints=hints, **options) as manager:
            t0 = time.perf_counter()  # after the manager's warm-up (CUDA graph capture)
            ids = {manager.add_request(input_ids=p, max_new_tokens=n, eos_token_id=-1)
                   for p, n in zip(prompts, out_lens)}
            while ids:
                res = manager.get_result(timeout=1)
                if res is not None and res.is_finished() and res.request_id in ids:
                    ids.discard(res.request_id)
                    produced += len(res.generated_tokens)
                    error = error or res.error
                elif res is None and not manager.is_running():
                    raise RuntimeError("the continuous batching thread died")
            seconds = time.perf_counter() - t0
        if error is not None and produced < sum(out_lens):
            # its generation loop failed (gpt-oss: eager attention's [heads, batch tokens, context]
            # scores found no room beside the paged cache it sized to the free memory: 8 GiB short)
            raise RuntimeError(f"its requests ended in an error: {error}")
        peer = f"transformers continuous batching (generate_batch's manager), paged|{attn}"
    except Exception as e:  # an API that moved or broke: fall back, and say so
        print(f"continuous batching failed ({type(e).__name__}: {e}); falling back to generate", flush=True)
        peer, error = f"transformers generate, padded static batches, {attn}", f"{type(e).__name__}: {e}"
        model.set_attn_implementation(attn)
        release_memory()  # the failed manager's paged cache
        seconds, produced = generate_padded(model, prompts, out_lens, device)
    result = dict(peer=peer, prompts=len(prompts), seconds=seconds, output_tokens=produced,
                  output_tok_s=produced / seconds, all_requests_full_length=produced == sum(out_lens), error=error)
    del model
    release_memory()
    return result


@torch.inference_mode()
def generate_padded(model, prompts, out_lens, device, batch: int = 64) -> tuple[float, int]:
    t0, produced = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        chunk, lens = prompts[i : i + batch], out_lens[i : i + batch]
        width = max(map(len, chunk))  # left padding, as decoder-only generate wants
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max(lens),
                       min_new_tokens=max(lens), pad_token_id=0)
        produced += sum(lens)  # the workload's tokens; the padding rows' extra tokens are waste
    return time.perf_counter() - t0, produced


# ---------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3", help="the model's family and shape")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--peer-prompts", type=int, default=None, help="run the peer on the first K prompts (all)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--prefix-caching-off-too", action="store_true",
                   help="also time tierkv with prefix caching off (random prompts: its cost when it cannot help)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--l2", default=None, help="tierkv's L2 size (0: off); default: tierkv's own default")
    p.add_argument("--write-policy", default=None, help="tierkv's write policy; default: tierkv's own (write_back "
                   "without an L3; the run records what it resolved to)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, 8 short prompts: checks the script")
    p.add_argument("--profile", action="store_true",
                   help="run the workload again and trace --profile-steps of its steady state with torch.profiler")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="results directory (benchmarks/results)")
    a = p.parse_args()
    if a.smoke:
        a.num_prompts, a.min_len, a.max_len, a.warmup_prompts = 8, 8, 32, 2

    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device, dtype = device_and_dtype(a.smoke)
    config_class, shape, tiny, model_name = FAMILIES[a.family]
    config = getattr(transformers, config_class)(**(tiny if a.smoke else shape))
    rng = random.Random(a.seed)
    in_lens = [rng.randint(a.min_len, a.max_len) for _ in range(a.num_prompts)]
    out_lens = [rng.randint(a.min_len, a.max_len) for _ in range(a.num_prompts)]
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in in_lens]
    # tierkv's warm-up (Triton compilation): prompts of the real lengths with other random ids,
    # so the timed run gets no prefix hits from it
    warm = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in in_lens[: a.warmup_prompts]]

    bw = hbm_bandwidth(device, 2**24 if a.smoke else 2**31)
    figures = dict(
        workload=dict(model=f"{model_name}, random weights" if not a.smoke else f"tiny {a.family} (smoke)",
                      dtype=str(dtype), num_prompts=a.num_prompts, len_range=[a.min_len, a.max_len], seed=a.seed,
                      input_tokens=sum(in_lens), output_tokens=sum(out_lens), greedy=True, ignore_eos=True,
                      l2=a.l2 if a.l2 is not None else "tierkv's default",
                      write_policy=a.write_policy or "tierkv's default"),
        hbm_bandwidth_gbps=bw / 1e9,
        roofline_formula="step bytes = weight_bytes + kv_bytes_per_token * sum(context read by each sequence); "
                         "roofline_s = sum(step bytes) / hbm_bw (d2d copy, read+write); fraction = roofline_s / wall_s",
        targets=dict(ratio_vs_peer=35.0, decode_roofline_fraction=0.7, prefix_caching_cost=0.02),
    )
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        model, sizes = save_random_model(config, Path(tmp), device, dtype, attn=ATTN.get(a.family, "sdpa"))
        del model
        release_memory()
        figures["model_sizes"] = sizes
        runs = [True, False] if a.prefix_caching_off_too else [True]
        figures["tierkv"] = [run_tierkv(Path(tmp), device, dtype, prompts, out_lens, warm, a, sizes, bw, on)
                             for on in runs]
        ours = figures["tierkv"][0]
        if len(runs) == 2:
            figures["prefix_caching_cost"] = figures["tierkv"][1]["output_tok_s"] / ours["output_tok_s"] - 1
        path = write_results(NAME[a.family], figures, a.out)  # kept even if the peer never ends
        if not a.no_peer:
            k = a.peer_prompts or a.num_prompts
            figures["peer"] = run_peer(Path(tmp), prompts[:k], out_lens[:k], device, dtype, ATTN.get(a.family, "sdpa"))
            figures["ratio_vs_peer"] = ours["output_tok_s"] / figures["peer"]["output_tok_s"]
            path = write_results(NAME[a.family], figures, a.out)

    rows = [(f"tierkv (prefix caching {'on' if r['prefix_caching'] else 'off'})", a.num_prompts, r)
            for r in figures["tierkv"]]
    rows += [(figures["peer"]["peer"][:48], figures["peer"]["prompts"], figures["peer"])] if "peer" in figures else []
    print(f"\n{'engine':<48} {'prompts':>7} {'out tok':>8} {'s':>7} {'tok/s':>9}")
    for name, n, r in rows:
        print(f"{name:<48} {n:7d} {r['output_tokens']:8d} {r['seconds']:7.2f} {r['output_tok_s']:9.1f}")
    targets = figures["targets"]
    if "peer" in figures:
        print(f"ratio tierkv / peer: {figures['ratio_vs_peer']:.2f}x (target >= {targets['ratio_vs_peer']:.0f}x)")
    print(f"HBM bw (d2d copy) {bw / 1e9:.0f} GB/s; roofline {ours['roofline_tok_s']:.0f} tok/s; "
          f"fraction whole run {ours['roofline_fraction']:.1%}, decode steps "
          f"{ours['decode_roofline_fraction'] or 0:.1%} (target >= {targets['decode_roofline_fraction']:.0%}; "
          f"GPU time of those steps {ours['decode_gpu_seconds'] or 0:.2f} s of {ours['decode_seconds']:.2f} s wall); "
          f"mean decode batch {ours['mean_decode_batch']:.1f}; "
          f"all requests full length: {ours['all_requests_full_length']}")
    if "prefix_caching_cost" in figures:
        print(f"prefix caching cost (tok/s off / on - 1): {figures['prefix_caching_cost']:+.1%} (target <= 2%)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
