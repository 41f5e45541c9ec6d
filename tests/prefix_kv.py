"""Test data: KV that is a pure function of the token prefix, as a real model's is.

kv[l, k, t, h, d] depends on tokens[:t+1] and the salt only, so any block the cache returns can
be checked byte for byte against what a model would have produced for that prefix.
"""

import torch
import xxhash

from tierkv import KVLayout


def prefix_kv(layout: KVLayout, tokens: list[int], salt: str | None = None) -> torch.Tensor:
    """[layers, 2, len(tokens), kv_heads, head_dim] in layout.dtype; exact in fp16/fp32."""
    L, _, _, H, D = layout.block_shape
    per_token = L * 2 * H * D
    h = xxhash.xxh64_intdigest(str(salt).encode())
    codes = []
    for t in tokens:  # a rolling hash of the prefix
        h = xxhash.xxh64_intdigest(h.to_bytes(8, "little") + int(t).to_bytes(4, "little", signed=True))
        codes.append(h % 1024)
    code = torch.tensor(codes, dtype=torch.float32)  # [T]
    offsets = torch.arange(per_token, dtype=torch.float32).reshape(L, 2, 1, H, D)
    # distinct per element and per prefix; < 2**11 * per_token stays exact in fp16 for small shapes
    return (code.reshape(1, 1, -1, 1, 1) + 1024 * offsets).to(layout.dtype)


def write_into_slots(cache, seq, tokens: list[int], start: int, salt: str | None = None) -> None:
    """Play the engine: write the KV of tokens[start:] into the sequence's L1 slots."""
    if start >= len(tokens):
        return
    kv = prefix_kv(cache.layout, tokens, salt)[:, :, start:]  # [L, 2, n, H, D]
    bs = cache.block_size
    positions = range(start, len(tokens))
    blocks = torch.tensor([seq.slots[p // bs] for p in positions], dtype=torch.int64)
    offsets = torch.tensor([p % bs for p in positions], dtype=torch.int64)
    # pool: [L, blocks, 2, bs, H, D]; two separated index tensors put the token dim first: [n, L, 2, H, D]
    cache.l1.kv[:, blocks, :, offsets] = kv.permute(2, 0, 1, 3, 4).to(cache.device)


def read_slots(cache, seq, n: int) -> torch.Tensor:
    """[L, 2, n, H, D]: what the pool holds for the first n positions of `seq`."""
    bs = cache.block_size
    pool = cache.l1.kv
    blocks = pool[:, torch.tensor(seq.slots[: -(-n // bs)], dtype=torch.int64, device=pool.device)]  # [L, nb, 2, bs, H, D]
    L, nb, _, _, H, D = blocks.shape
    return blocks.transpose(1, 2).reshape(L, 2, nb * bs, H, D)[:, :, :n]
