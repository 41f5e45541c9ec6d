"""tierkv inside a plain Hugging Face transformers program: prefix reuse and KV offload for `generate`.

Two questions about one long document. The first call computes the document; its K/V blocks go
into the TieredKVCache (L1 pool, copied down to L2 and an optional L3). The second call finds the
document there and computes only its question. With --offload on a GPU the pool lives in host
memory and each layer's K/V is copied up one layer ahead, as transformers' offloaded cache does.
Prints both answers, tokens/s and the cache hits, and checks the tokens equal transformers' own cache.
Run: python examples/transformers_offload.py [--model HF_DIR] [--l3 file:///tmp/tierkv-l3] [--offload]
"""

import argparse
import time

import torch
from tierkv.integrations.transformers import generate
from transformers import AutoModelForCausalLM, AutoTokenizer

import tierkv


def document(sections: int) -> str:
    """A long, regular text: about 30 tokens a section."""
    cargo = ["grain", "steel", "timber", "cotton"]
    return " ".join(f"Section {i}: the harbour office logs ship number {100 + i} arriving at dock {i % 7} with "
                    f"{10 * i} containers of {cargo[i % 4]}." for i in range(1, sections + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local HF model dir (default: bundled SmolLM2-135M)")
    parser.add_argument("--l3", action="append", default=[], help="an L3 URL (file://, redis://, s3://)")
    parser.add_argument("--offload", action="store_true", help="keep the L1 pool in host memory (GPU models)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--sections", type=int, default=24, help="length of the document (about 30 tokens each)")
    args = parser.parse_args()

    if args.model is None:
        from tierkv.engine.loader import bundled_model_dir

        args.model = bundled_model_dir()  # the bundled GGUF, converted once to a HF directory
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(args.model)

    c = model.config
    layout = tierkv.KVLayout(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                             head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                             dtype=dtype, block_size=16)
    pool_device = "cpu" if args.offload else device
    config = tierkv.CacheConfig(l1="256MiB", l2="512MiB", l3=args.l3, write_policy="write_through")
    kv = tierkv.TieredKVCache(layout, config, device=pool_device, model=str(args.model))
    print(f"model on {device} ({dtype}), KV pool on {pool_device}; L3: {args.l3 or 'none'}")

    text = document(args.sections)
    greedy = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    for question in ["Which dock did ship 105 use?", "What did ship 107 carry?"]:
        messages = [{"role": "user", "content": f"{text}\n\nQuestion: {question} Answer briefly."}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"].to(device)
        with torch.inference_mode():
            out = generate(model, ids, kv, **greedy)
            start = time.perf_counter()
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), **greedy)  # transformers' own cache
            plain = time.perf_counter() - start
        new = out.sequences.shape[1] - ids.shape[1]
        print(f"Q: {question}\nA: {tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()}")
        print(f"prompt {out.prompt_tokens} tokens: cached tokens {out.cached_tokens} {out.by_tier}, computed "
              f"{out.computed_tokens}; {new / out.seconds:.1f} tokens/s with tierkv, {new / plain:.1f} tokens/s "
              f"with transformers' cache; same tokens: {torch.equal(out.sequences, ref)}")
    s = kv.stats()
    print(f"cache hits: {s['hit_tokens']} tokens, hit rate {s['hit_rate']:.2f}, L2 holds "
          f"{s['tiers']['l2']['used_blocks']} blocks")
    kv.flush(timeout=30)
    kv.close()


if __name__ == "__main__":
    main()
