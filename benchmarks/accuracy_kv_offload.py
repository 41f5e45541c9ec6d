"""accuracy_kv_offload: fp8 KV in L2 (kv_offload_dtype="fp8_e4m3") against unquantised KV, measured.

Each prompt is computed once, evicted from L1 (`cache.evict("l1")`), and generated again with its
prefix served from L2: once with L2 in the model's dtype, once with fp8 L2, in two engines on the
same weights. Reported per run: the first token's logits max-abs error (largest and mean over the
prompts, next to the logits' own std and largest value), how many first tokens agree, greedy
tokens equal position by position over --max-tokens, and where each prompt's tokens first differ
(after that the contexts differ, so later positions say little). Accuracy is not a speed figure:
this script times nothing.

    python benchmarks/accuracy_kv_offload.py                      # the bundled SmolLM2 (text prompts)
    python benchmarks/accuracy_kv_offload.py --model DIR          # any local model directory
    python benchmarks/accuracy_kv_offload.py --llama8b-random     # Llama-3.1-8B shape, random weights (GPU)

Measured on CPU (2 cores), bundled SmolLM2-135M, 4 prompts of ~110 tokens, 32 tokens each: 128/128
greedy tokens equal, first-token logits max-abs error 0.48 (logits' largest 19.6, std 3.4).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results

import tierkv

DOC = ("Tiered caches keep attention keys and values in GPU memory, host memory and disk. "
       "A prefix computed once is never computed again while a tier still holds it. ") * 4
QUESTIONS = ("Where are the keys kept?", "What is never computed twice?", "Summarise the text in one sentence.",
             "Name the three tiers.")


def release_memory() -> None:
    """Collect engines no longer referenced and give their GPU memory back, so that the next one
    sizes L1 from memory that is really free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_tokens_from_l2(llm: tierkv.LLM, prompts: list, params: tierkv.SamplingParams):
    """Compute `prompts`, evict them from L1, then generate each again alone, its prefix served
    from L2: (its tokens, its first token's logits [n, vocab] fp32 on the host). Alone, a prompt's
    uncached tail is one step, whose one logits row is its first token's. `llm` must run eagerly
    (enforce_eager=True): a replayed CUDA graph never calls the forward that records the logits.
    Also used by tests/test_kv_offload.py."""
    llm.generate(prompts, params, use_tqdm=False)
    llm.cache.evict("l1")
    net, steps = llm.engine.lm.model, []
    forward = net.forward

    def recording(*args, **kwargs):  # the real forward; each step's logits are kept
        out = forward(*args, **kwargs)
        steps.append(out.detach().float().cpu())
        return out

    net.forward = recording
    tokens, rows = [], []
    try:
        for prompt in prompts:
            steps.clear()
            # On a GPU, load-or-recompute may judge a short prefix cheaper to recompute (a tiny
            # model always is); accuracy is measured on what L2 serves, so this run always loads.
            llm.engine.scheduler.recompute_seconds_per_token = None
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert out.cached_tokens > 0, "the prompt was not served from L2"
            tokens.append(out.token_ids)
            if not steps:
                raise RuntimeError("no step's logits were recorded: the step ran as a CUDA graph; "
                                   "make the LLM with enforce_eager=True")
            rows.append(steps[0][-1])
    finally:
        net.forward = forward
    assert llm.cache.stats()["tiers"]["l2"]["blocks_out"] > 0
    return tokens, torch.stack(rows)


def served_from_l2(model: str, offload: str | None, prompts: list, max_tokens: int, device: str | None,
                   cache_dir: str | None, l2: str) -> tuple[list[list[int]], torch.Tensor]:
    """first_tokens_from_l2 in a fresh engine with L2 of `offload` (None: the model's dtype)."""
    release_memory()  # the previous engine's
    llm = tierkv.LLM(model, device=device, cache_dir=cache_dir, l2=l2, kv_offload_dtype=offload, enforce_eager=True)
    out = first_tokens_from_l2(llm, prompts, tierkv.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                   ignore_eos=True))
    llm.close()
    return out


def measure(model: str, prompts: list, max_tokens: int, device: str | None, cache_dir: str | None, l2: str) -> dict:
    ref_tokens, ref = served_from_l2(model, None, prompts, max_tokens, device, cache_dir, l2)
    got_tokens, got = served_from_l2(model, "fp8_e4m3", prompts, max_tokens, device, cache_dir, l2)
    err = (ref - got).abs().amax(dim=-1)  # [n]
    equal = sum(a == b for r, g in zip(ref_tokens, got_tokens) for a, b in zip(r, g))
    first_diff = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
                  for r, g in zip(ref_tokens, got_tokens)]
    return dict(prompts=len(prompts), max_tokens=max_tokens,
                first_token_logits_max_abs_err=float(err.max()), first_token_logits_mean_max_abs_err=float(err.mean()),
                logits_std=float(ref.std()), logits_abs_max=float(ref.abs().max()),
                first_token_agree=int((ref.argmax(-1) == got.argmax(-1)).sum()),
                greedy_tokens_equal=int(equal), greedy_tokens=sum(len(r) for r in ref_tokens),
                first_difference=first_diff)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2)")
    p.add_argument("--llama8b-random", action="store_true", help="the Llama-3.1-8B shape with random weights")
    p.add_argument("--prompts", type=int, default=8, help="random-id prompts (models without a tokenizer)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="length of the random-id prompts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default=None)
    p.add_argument("--l2", default="4GiB", help="L2 of both runs: must hold every prompt's KV")
    p.add_argument("--cache-dir", default=None, help="where the bundled model is converted")
    p.add_argument("--out", type=Path, default=None, help="results directory (benchmarks/results)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="accuracy-fp8-") as tmp:
        model, name = a.model, a.model or "bundled SmolLM2-135M-Instruct"
        if a.llama8b_random:
            from bench_latency import llama_setup
            from bench_throughput import save_random_model

            config, device, dtype = llama_setup(smoke=False)
            net, _ = save_random_model(config, Path(tmp) / "model", device, dtype)
            del net
            release_memory()
            model, name = str(Path(tmp) / "model"), "Llama-3.1-8B shape, random weights"
        probe = tierkv.LLM(model, device=a.device, cache_dir=a.cache_dir, l1="64MiB", l2=0)
        if probe.tokenizer is not None and not a.llama8b_random:
            prompts = [DOC + q for q in QUESTIONS]
        else:
            g = torch.Generator().manual_seed(0)
            vocab = probe.engine.lm.config.vocab_size
            prompts = [torch.randint(0, vocab, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.prompts)]
        probe.close()
        del probe
        figures = dict(model=name, l2=a.l2, accuracy=measure(model, prompts, a.max_tokens, a.device, a.cache_dir, a.l2))
    path = write_results("accuracy_kv_offload", figures, a.out)
    r = figures["accuracy"]
    print(f"{name}: first-token logits max-abs error {r['first_token_logits_max_abs_err']:.3f} "
          f"(mean {r['first_token_logits_mean_max_abs_err']:.3f}; logits std {r['logits_std']:.2f}, "
          f"largest {r['logits_abs_max']:.2f}); first tokens agree {r['first_token_agree']}/{r['prompts']}; "
          f"greedy tokens equal {r['greedy_tokens_equal']}/{r['greedy_tokens']}; "
          f"first differences {r['first_difference']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
