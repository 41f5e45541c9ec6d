"""bench_latency: batch-1 decode speed on a Llama-3.1-8B-shaped model vs its bandwidth roofline and HF.

Model: Llama-3.1-8B shape (hidden 4096, MLP 14336, 32 layers, 32 q / 8 kv heads, vocab 128256,
llama3 RoPE scaling), random weights built directly on the GPU in bf16 and saved as safetensors to
a temporary directory that tierkv loads (transformers runs on the same weights, in memory, first;
it is freed before tierkv loads, so two 16 GB copies never coexist).

One request: --prompt-len (128) random token ids, --output-len (256) tokens, greedy, EOS ignored.
Decode tok/s = (n - 1) / (time of the last token - time of the first token), so prefill and the
first token are excluded; tierkv is driven through `llm.engine` (add_request, then step), which
returns one token per step at batch 1, and each token is timed as its step returns. Median over
--repeats runs, each on a fresh random prompt, after a warm-up (Triton compilation).

Roofline: decode of one token must read every weight once (the untied input embedding only a row)
plus the KV of the context; at the mean decode context c = prompt_len + output_len / 2:
    roofline_tok_s = hbm_bw / (weight_bytes + kv_bytes_per_token * c),  fraction = tok_s / roofline
with hbm_bw the bytes read + written by a device-to-device copy measured in this run.
Peer: HF `generate` (sdpa, default dynamic cache, batch 1) on the same prompt; its decode tok/s is
(n - 1) / (time of generate(n tokens) - time of generate(1 token)), the same definition.
--compare-cublas loads tierkv a second time with its decode graphs' linear layers on cuBLAS instead
of the Triton GEMV (kernels/matvec.py) and times the same prompts: the GEMV's gain end to end.

    python benchmarks/bench_latency.py [--prompt-len 128] [--output-len 256] [--no-peer] [--compare-cublas]
                                       [--out DIR]
    python benchmarks/bench_latency.py --smoke --out /tmp/x      # tiny Llama on CPU, seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import (
    device_and_dtype,
    hbm_bandwidth,
    release_memory,
    save_random_model,
)
from common import RESULTS, machine_tag, write_results
from profiling import print_profile, profile_run

import tierkv

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                  rope_scaling=dict(LLAMA3_ROPE), rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_LLAMA3 = dict(LLAMA31_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                   rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=512))


def llama_setup(smoke: bool):
    """(LlamaConfig, device, dtype) of the Llama-3.1-8B shape (tiny on CPU with --smoke), with
    transformers' logging and progress bars quiet."""
    from transformers import LlamaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device, dtype = device_and_dtype(smoke)
    return LlamaConfig(**(TINY_LLAMA3 if smoke else LLAMA31_8B)), device, dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def hf_decode_tok_s(model, prompt: list[int], n: int, device: torch.device, repeats: int) -> dict:
    """HF generate, batch 1: (n - 1) / (t(n tokens) - t(1 token)), each time a median of `repeats`."""
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)

    def timed(k: int) -> float:
        sync(device)
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=k,
                             min_new_tokens=k, pad_token_id=0)  # min_new_tokens: EOS cannot end it early
        sync(device)
        assert out.shape[1] == len(prompt) + k
        return time.perf_counter() - t

    timed(4)  # warm-up
    t1 = statistics.median(timed(1) for _ in range(repeats))
    tn = statistics.median(timed(n) for _ in range(repeats))
    return dict(peer="transformers generate, sdpa, dynamic cache, batch 1", seconds_1_token=t1,
                seconds_n_tokens=tn, decode_tok_s=(n - 1) / (tn - t1))


def tierkv_decode(llm: tierkv.LLM, prompt: list[int], n: int) -> dict:
    """One request through the engine's step loop; each token is timed when its step returns."""
    engine = llm.engine
    params = tierkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    req = engine.add_request(prompt, params)
    stamps = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == req.request_id:
                stamps += [time.perf_counter()] * len(out.new_token_ids)
    if len(stamps) != n:
        raise RuntimeError(f"tierkv produced {len(stamps)} tokens, expected {n}")
    return dict(ttft_s=stamps[0] - t0, decode_tok_s=(n - 1) / (stamps[-1] - stamps[0]))


def warm_and_time(llm: tierkv.LLM, prompts: list[list[int]], n: int) -> list[dict]:
    """prompts[0] as a warm-up at full length (the decode kernel's launch config, and so its
    compilation, can change as the context grows), then each other prompt timed."""
    tierkv_decode(llm, prompts[0], n)
    return [tierkv_decode(llm, prompt, n) for prompt in prompts[1:]]


def cublas_decode(path: str, device: torch.device, dtype: torch.dtype, prompts: list[list[int]], n: int) -> dict:
    """tierkv loaded again with cuBLAS for the decode graphs' one-row linears, the same prompts."""
    from tierkv.kernels import matvec

    matvec.GEMV_IN_GRAPHS = False  # read at graph capture, which the LLM does as it loads
    try:
        llm = tierkv.LLM(model=path, device=str(device), dtype=dtype)
        runs = warm_and_time(llm, prompts, n)
        llm.close()
        del llm
    finally:
        matvec.GEMV_IN_GRAPHS = True
    return dict(decode_tok_s=statistics.median(r["decode_tok_s"] for r in runs), runs=runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--compare-cublas", action="store_true",
                   help="also time tierkv with cuBLAS for the one-row linears in its decode graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny Llama-3.1-shaped model on CPU: checks the script")
    p.add_argument("--profile", action="store_true", help="also trace 64 decode tokens with torch.profiler")
    p.add_argument("--out", type=Path, default=None, help="results directory (benchmarks/results)")
    a = p.parse_args()
    if a.smoke:
        a.prompt_len, a.output_len = 16, 16

    config, device, dtype = llama_setup(a.smoke)
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(a.prompt_len)] for _ in range(a.repeats + 1)]
    n = a.output_len

    bw = hbm_bandwidth(device, 2**24 if a.smoke else 2**31)
    model_name = "tiny Llama-3.1 (smoke)" if a.smoke else "Llama-3.1-8B shape, random weights"
    figures = dict(workload=dict(model=model_name, dtype=str(dtype), batch=1, prompt_len=a.prompt_len, output_len=n,
                                 repeats=a.repeats, greedy=True, ignore_eos=True, seed=a.seed),
                   hbm_bandwidth_gbps=bw / 1e9, targets=dict(roofline_fraction=0.85, ratio_vs_peer=15.0))
    with tempfile.TemporaryDirectory(prefix="bench-latency-") as tmp:
        t = time.perf_counter()
        model, sizes = save_random_model(config, Path(tmp), device, dtype)
        figures["model_sizes"] = sizes
        figures["build_and_save_s"] = time.perf_counter() - t
        print(f"built and saved {sizes['num_parameters'] / 1e6:.1f}M parameters in {figures['build_and_save_s']:.1f} s",
              flush=True)
        if not a.no_peer:
            figures["peer"] = hf_decode_tok_s(model, prompts[1], n, device, a.repeats)
        del model
        release_memory()  # the HF copy goes before tierkv loads its own

        llm = tierkv.LLM(model=tmp, device=str(device), dtype=dtype)
        # tierkv's own defaults serve the run; record what they resolved to
        figures["tierkv_config"] = dict(l2_blocks=llm.cache.l2.num_blocks if llm.cache.l2 is not None else 0,
                                        write_policy=llm.engine.config.write_policy)
        runs = warm_and_time(llm, prompts, n)
        if a.profile and device.type == "cuda":  # one request's 64 tokens under the profiler
            trace = Path(a.out or RESULTS) / f"latency_trace-{machine_tag()}.json.gz"
            figures["profile"] = profile_run(lambda: tierkv_decode(llm, prompts[1][::-1], 64), trace)
            figures["profile"]["kernels_per_token"] = figures["profile"]["kernel_launches"] / 64
            print_profile(figures["profile"], "64 tokens at batch 1")
        llm.close()
        llm = None  # its weights and pool are let go of
        if a.compare_cublas:
            release_memory()  # the first LLM's weights and pool go before the second loads
            figures["tierkv_cublas"] = cublas_decode(tmp, device, dtype, prompts, n)

    # each decode step reads the weights and the KV of the context; average over the decode
    mean_context = a.prompt_len + n / 2
    step_bytes = sizes["weight_bytes_per_step"] + sizes["kv_bytes_per_token"] * mean_context
    tok_s = statistics.median(r["decode_tok_s"] for r in runs)
    figures["tierkv"] = dict(decode_tok_s=tok_s, ttft_s=statistics.median(r["ttft_s"] for r in runs), runs=runs)
    figures["roofline"] = dict(formula="hbm_bw / (weight_bytes + kv_bytes_per_token * (prompt_len + output_len / 2))",
                               mean_context=mean_context, step_bytes=step_bytes, tok_s=bw / step_bytes)
    figures["roofline_fraction"] = tok_s / figures["roofline"]["tok_s"]
    if "tierkv_cublas" in figures:
        figures["tierkv_cublas"]["roofline_fraction"] = (figures["tierkv_cublas"]["decode_tok_s"]
                                                         / figures["roofline"]["tok_s"])
        figures["gemv_vs_cublas"] = tok_s / figures["tierkv_cublas"]["decode_tok_s"]
    if "peer" in figures:
        figures["peer"]["roofline_fraction"] = figures["peer"]["decode_tok_s"] / figures["roofline"]["tok_s"]
        figures["ratio_vs_peer"] = tok_s / figures["peer"]["decode_tok_s"]
    path = write_results("bench_latency", figures, a.out)

    print(f"\n{'batch-1 decode':<24} {'tok/s':>9} {'of roofline':>12}")
    print(f"{'tierkv':<24} {tok_s:9.1f} {figures['roofline_fraction']:12.1%}")
    if "tierkv_cublas" in figures:
        r = figures["tierkv_cublas"]
        print(f"{'tierkv, cuBLAS linears':<24} {r['decode_tok_s']:9.1f} {r['roofline_fraction']:12.1%}"
              f"   (GEMV / cuBLAS {figures['gemv_vs_cublas']:.3f}x)")
    if "peer" in figures:
        r = figures["peer"]
        print(f"{'transformers generate':<24} {r['decode_tok_s']:9.1f} {r['roofline_fraction']:12.1%}")
        print(f"ratio tierkv / transformers: {figures['ratio_vs_peer']:.2f}x (target >= 15x)")
    print(f"roofline {figures['roofline']['tok_s']:.0f} tok/s = {bw / 1e9:.0f} GB/s (d2d copy) / "
          f"{step_bytes / 1e9:.3f} GB per step (target >= 85%); tierkv TTFT {figures['tierkv']['ttft_s'] * 1e3:.1f} ms")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
