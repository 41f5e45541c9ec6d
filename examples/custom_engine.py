"""Embedding tierkv in your own engine: a greedy generation loop over the paged L1 pool, in ~100 lines.

The model (tierkv.engine.model) reads and writes K/V only through the pool and tierkv.kernels'
paged attention; this loop does the bookkeeping an engine does with the public cache API:
match -> allocate (cached prefix shared) -> per step append + commit -> free. Two prompts share a
long system prompt; the second one computes only its own tokens.
Run: python examples/custom_engine.py [--model HF_DIR]   (default: the bundled SmolLM2-135M, CPU)
"""

import argparse
import time

import torch

import tierkv
from tierkv.engine.attention import AttentionMetadata
from tierkv.engine.loader import load_model


def generate(model, cache: tierkv.TieredKVCache, prompt: list[int], max_new: int, eos: set[int]):
    """Greedy-decode one prompt; returns (new token ids, prompt tokens served by the cache)."""
    bs = cache.block_size
    match = cache.match(prompt)  # longest cached prefix, capped at len(prompt) - 1
    seq = cache.allocate(prompt, match=match)  # L1 hits pinned, L2 hits loaded, fresh blocks for the rest
    seq.wait()  # on CUDA: the compute stream waits for the L2 loads
    tokens, done, out = list(prompt), seq.num_cached_tokens, []
    try:
        while len(out) < max_new:
            new = tokens[done:]  # the uncached prompt part first, then one token per step
            if done + len(new) > seq.num_tokens:
                cache.append(seq, done + len(new) - seq.num_tokens)
            positions = list(range(done, done + len(new)))
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([seq.slot_of(p, bs) for p in positions], device=cache.device),  # [T]
                block_tables=cache.block_table([seq]),  # [1, max_blocks] int32
                seq_lens=torch.tensor([done + len(new)], dtype=torch.int32, device=cache.device),  # [1]
                cu_seqlens_q=torch.tensor([0, len(new)], dtype=torch.int32, device=cache.device),  # [2]
                logits_indices=torch.tensor([len(new) - 1], device=cache.device),  # only the last row's logits
                is_decode=len(new) == 1,
            )
            ids = torch.tensor(new, device=cache.device)
            logits = model(ids, torch.tensor(positions, device=cache.device), cache.l1.kv, meta)  # [1, vocab]
            done += len(new)
            cache.commit(seq, tokens[:done])  # full blocks are shareable right away
            token = int(logits[0].argmax())
            out.append(token)
            tokens.append(token)
            if token in eos:
                break
    finally:
        cache.free(seq)  # shared blocks stay cached (evictable), private ones return to the pool
    return out, match.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local HF model dir (default: bundled SmolLM2-135M)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(args.model, device=device)
    tok = loaded.tokenizer
    layout = loaded.kv_layout(block_size=16)  # the model's K/V shape and dtype, 16 tokens a block
    cache = tierkv.TieredKVCache(layout, tierkv.CacheConfig(l1="256MiB"), device=device, model=loaded.fingerprint)
    print(f"model {loaded.model_dir.name} on {device}; L1 {cache.l1.num_blocks} blocks of {layout.block_size} tokens")

    system = ("You are the help desk of a city library. Opening hours: 9 to 18 on weekdays, 10 to 14 on "
              "Saturdays, closed on Sundays. Late returns cost 20 cents a day. Answer in one sentence.")
    questions = ["When are you open on Saturday?", "How much is a late return?"]
    eos = set(tok.eos_token_ids)
    for q in questions:
        prompt = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
        start = time.perf_counter()
        with torch.inference_mode():
            out, cached = generate(loaded.model, cache, prompt, args.max_new_tokens, eos)
        seconds = time.perf_counter() - start
        print(f"Q: {q}\nA: {tok.decode(out).strip()}")
        print(f"prompt {len(prompt)} tokens, cached tokens {cached}, computed {len(prompt) - cached}, "
              f"{len(out)} new in {seconds:.2f}s")
    s = cache.stats()
    print(f"cache: {s['hit_tokens']} hit tokens of {s['query_tokens']} looked up, {s['blocks']} blocks indexed")
    cache.close()


if __name__ == "__main__":
    main()
