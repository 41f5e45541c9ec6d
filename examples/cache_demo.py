"""A tour of the tierkv cache in one minute: store KV, find it again in L1, push it down to L2, get it back.

Runs on a GPU when there is one, on the CPU otherwise. The KV here is random numbers shaped like
Llama-3.1-8B's (32 layers, 8 KV heads, head_dim 128); a real engine would write what its model
computed. Run: python examples/cache_demo.py
"""

import time

import torch

import tierkv


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    layout = tierkv.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=dtype, block_size=16)
    # L1 holds 64 blocks (1,024 tokens), L2 four times that: small on purpose, to see eviction.
    config = tierkv.CacheConfig(l1=64 * layout.bytes_per_block, l2=256 * layout.bytes_per_block,
                                eviction="lru", write_policy="write_back")
    cache = tierkv.TieredKVCache(layout, config, device=device, model="demo")
    print(f"device {device}; one block = {layout.bytes_per_block / 2**20:.1f} MiB; "
          f"L1 {cache.l1.num_blocks} blocks, L2 {cache.l2.num_blocks} blocks ({'pinned' if cache.l2.pinned else 'pageable'})")

    gen = torch.Generator().manual_seed(0)
    system_prompt = torch.randint(0, 32000, (800,), generator=gen).tolist()
    kv = torch.randn(layout.kv_shape(len(system_prompt)), generator=gen).to(dtype)  # [layers, 2, tokens, heads, dim]

    stored = cache.store(system_prompt, kv.to(device))
    print(f"stored the first {stored} of {len(system_prompt)} tokens (full blocks only)")

    question = system_prompt + torch.randint(0, 32000, (40,), generator=gen).tolist()
    print(f"a new question sharing the prompt: {cache.match(question)}")

    for i in range(3):  # other traffic pushes the prompt out of L1 into L2
        other = torch.randint(0, 32000, (600,), generator=gen).tolist()
        cache.store(other, torch.randn(layout.kv_shape(600), generator=gen).to(dtype).to(device))
    print(f"after other traffic:               {cache.match(question)}")

    t = time.perf_counter()
    n, back = cache.retrieve(question)
    cache.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    same = torch.equal(back.cpu(), kv[:, :, :n])
    print(f"retrieved {n} tokens ({n * layout.bytes_per_token / 2**20:.0f} MiB) in {ms:.1f} ms; byte-identical: {same}")

    stats = cache.stats()
    print(f"hit rate {stats['hit_rate']:.2f}; L1 evictions {stats['tiers']['l1']['evictions']}, "
          f"L2 holds {stats['tiers']['l2']['used_blocks']} blocks")


if __name__ == "__main__":
    main()
