"""bench_families: the 2026 model families on the H200: batch-1 decode against its roofline, and a
100K-token L2 hit on a sliding-window model against cold prefill and the window groups' share.

Models: random weights of the real shapes, built straight into tierkv's model on the GPU in bf16
(no checkpoint: a 30B model's 61 GB would not fit the machine's disk), served by `tierkv.LLM`
through `Engine(loaded=)`:
- qwen3-30b-a3b: Qwen3-30B-A3B (48 layers, 128 experts, top-8, expert MLP 768);
- gpt-oss-20b: gpt-oss-20b (24 layers alternating 128-token windows and full attention, sinks,
  32 experts, top-4, experts in bf16: tierkv dequantises MXFP4 at load).

1. Decode at batch 1: --decode-tokens greedy tokens after a --prompt-len prompt, tok/s against the
   roofline of one step's bytes (the active parameters: everything but the unused experts and the
   embedding table, which is gathered a row at a time; plus the KV read at the mean context) over the
   HBM bandwidth measured in this run (one large device copy, read + write). Target >= 70%.
2. (--hit, gpt-oss-20b) a --hit-tokens prompt cold (TTFT, one output token), then again with its
   blocks in L2 (`cache.evict("l1")`, write-back copies them down then): TTFT, the speed-up over
   cold (target >= 30x), and the bytes the hit loaded from L2 (the cache's counter) against a full
   load of those blocks and against the window share the issue sets: full layers / layers +
   window layers / layers * window / prefix. And whether the hit's first token is the cold run's,
   with the top-5 log-probabilities of both: on random weights a differing argmax is a near-tie
   unless the shared top-5 differ by more than the cold run's gap between its first two.

    python benchmarks/bench_families.py [--models qwen3-30b-a3b,gpt-oss-20b] [--hit] [--out DIR]
    python benchmarks/bench_families.py --smoke --out /tmp/x     # tiny shapes on CPU: checks the script
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results
from profiling import print_profile, profile_run

import tierkv
from tierkv.engine.loader import LoadedModel
from tierkv.engine.model import CausalLM
from tierkv.engine.model_config import ModelConfig

SHAPES = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=False),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True, swiglu_limit=7.0,
        rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False}),
}
SMOKE = {  # the same families, tiny
    "qwen3-30b-a3b": dict(SHAPES["qwen3-30b-a3b"], vocab_size=512, hidden_size=64, intermediate_size=128,
                          moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_experts=8, num_experts_per_tok=2),
    "gpt-oss-20b": dict(SHAPES["gpt-oss-20b"], vocab_size=512, hidden_size=64, intermediate_size=32,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_local_experts=4, num_experts_per_tok=2, experts_per_token=2, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"] * 2),
}


def random_model(hf: dict, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """tierkv's model of config `hf` with random weights made on `device`: N(0, 0.02) everywhere
    (matrices, biases, sinks, routers: near-uniform routing, as a trained model's averages), norms 1."""
    cfg = ModelConfig.from_hf(hf)
    with torch.device("meta"):
        net = CausalLM(cfg).to(dtype)  # in the model dtype before any byte exists: 30B params in fp32 would not fit
    net = net.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # matrices, biases, sinks, router
                p.normal_(0.0, 0.02, generator=gen)
    net.tie_weights()
    net.reset_rope()
    net.eval().requires_grad_(False)
    return LoadedModel(net, cfg, None, Path("random"), f"random-{hf['model_type']}", device, dtype)


def active_bytes(lm: LoadedModel) -> int:
    """Bytes one batch-1 decode step reads of the weights: all but the embedding table and the
    experts a token does not use (k of E of each MoE layer's experts)."""
    moe, total = lm.config.moe, 0
    for name, p in lm.model.named_parameters():
        if "embed_tokens" in name:
            continue
        share = moe.num_experts_per_tok / moe.num_experts if moe and ".experts." in name else 1.0
        total += int(p.numel() * p.element_size() * share)
    return total


def hbm_bytes_per_s(device: torch.device) -> float:
    """Device copy of 4 GiB, read + write, best of 5."""
    src = torch.empty(2**31, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * 2**32 / best


def decode(llm: tierkv.LLM, lm: LoadedModel, prompt_len: int, n: int, bw: float | None) -> dict:
    rng = random.Random(0)
    prompt = [rng.randrange(lm.config.vocab_size) for _ in range(prompt_len)]
    params = tierkv.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompt], tierkv.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.generate([prompt[::-1]], params, use_tqdm=False)  # warm-up: compile and capture
    t = time.perf_counter()
    first = llm.generate([prompt], tierkv.SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    out = llm.generate([prompt[1:] + prompt[:1]], params, use_tqdm=False)[0]
    total = time.perf_counter() - t
    steps = len(out.token_ids)
    tok_s = (steps - 1) / max(total - ttft, 1e-9)
    weights = active_bytes(lm)
    kv = llm.cache.layout.bytes_per_token * (prompt_len + steps / 2)
    figures = dict(prompt_len=prompt_len, tokens=steps, tok_s=tok_s, ttft_s=ttft, active_weight_bytes=weights,
                   kv_bytes_per_step=kv, first_token=first[0].token_ids[:1])
    if bw is not None:
        roofline = bw / (weights + kv)
        figures.update(hbm_bytes_per_s=bw, roofline_tok_s=roofline, of_roofline=tok_s / roofline)
    return figures


def first_token_agreement(cold: dict, hit: dict) -> dict:
    """How the hit's first-token distribution compares with the cold run's (each a logprobs entry:
    the token and the top 5): the top-5 ids both share, the largest log-probability difference
    among them, and the cold run's gap between its first and second choice (a differing argmax
    within that gap is a near-tie, not different KV)."""
    a, b = dict(cold["top"]), dict(hit["top"])
    shared = sorted(set(a) & set(b))
    top = sorted(a.values(), reverse=True)
    return dict(top5_shared=len(shared), top5_max_logprob_diff=max((abs(a[i] - b[i]) for i in shared), default=None),
                cold_top2_gap=top[0] - top[1] if len(top) > 1 else None)


def l2_hit(llm: tierkv.LLM, tokens: int, vocab: int) -> dict:
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(tokens)]
    # the top 5 log-probabilities of the first token: on random weights the hit's argmax may differ
    # from the cold run's by a near-tie (other kernels, other rounding); the gap says how near
    one = tierkv.SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    llm.generate([[rng.randrange(vocab) for _ in range(2048)]], one, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    cold = llm.generate([prompt], one, use_tqdm=False)[0]
    cold_s = time.perf_counter() - t
    llm.cache.evict("l1")  # write-back: the prompt's blocks go down to L2
    llm.cache.synchronize()
    before = llm.cache.stats()["tiers"]["l2"]["bytes_out"]
    t = time.perf_counter()
    hit = llm.generate([prompt], one, use_tqdm=False)[0]
    hit_s = time.perf_counter() - t
    moved = llm.cache.stats()["tiers"]["l2"]["bytes_out"] - before
    layout = llm.cache.layout
    blocks = hit.cached_tokens // layout.block_size
    full = blocks * layout.bytes_per_block
    share = len(layout.full_layers) / layout.num_layers
    windows = [w for w in layout.windows if w is not None]
    window = max(windows) if windows else 0
    bound = (share + (1 - share) * window / max(hit.cached_tokens, 1)) * full
    return dict(tokens=tokens, cold_ttft_s=cold_s, hit_ttft_s=hit_s, speedup=cold_s / hit_s,
                cached_tokens=hit.cached_tokens, same_token=hit.token_ids == cold.token_ids,
                **first_token_agreement(cold.logprobs[0], hit.logprobs[0]),
                l2_bytes_loaded=moved, full_load_bytes=full, of_full_load=moved / max(full, 1),
                window_share_bytes=bound, within_window_share=moved <= bound + layout.bytes_per_block)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--hit", action="store_true", help="also the 100K-token L2 hit (gpt-oss-20b)")
    p.add_argument("--hit-tokens", type=int, default=100_000)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="also a torch.profiler timeline of 32 decode steps per model (GPU): where a step's time goes")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16
    shapes = SMOKE if a.smoke else SHAPES
    bw = None if a.smoke else hbm_bytes_per_s(device)
    results: dict = {"hbm_bytes_per_s": bw, "models": {}}
    for name in a.models.split(","):
        lm = random_model(shapes[name], device, dtype)
        opts = dict(loaded=lm, max_num_seqs=8)
        if a.smoke:
            opts.update(l2=1 << 26, max_num_batched_tokens=256)
        if a.hit and name == "gpt-oss-20b":
            opts.update(write_policy="write_back", max_model_len=a.hit_tokens + 256)
        llm = tierkv.LLM(None, **opts)
        fig = {"decode": decode(llm, lm, a.prompt_len, 16 if a.smoke else a.decode_tokens, bw)}
        print(name, "decode", fig["decode"], flush=True)
        if a.profile and not a.smoke:
            trace = (a.out or Path("benchmarks/results")) / f"bench_families-{name}-decode.trace.json.gz"
            prompt = [random.Random(2).randrange(lm.config.vocab_size) for _ in range(a.prompt_len)]
            steps = tierkv.SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
            fig["decode_profile"] = profile_run(lambda: llm.generate([prompt], steps, use_tqdm=False), trace, top=20)
            print_profile(fig["decode_profile"], f"{name}: prefill + 32 decode steps")
        if a.hit and name == "gpt-oss-20b":
            fig["l2_hit"] = l2_hit(llm, 2000 if a.smoke else a.hit_tokens, lm.config.vocab_size)
            print(name, "l2_hit", fig["l2_hit"], flush=True)
        results["models"][name] = fig
        llm.engine.close()
        del llm, lm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    path = write_results("bench_families", results, a.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
