"""Chained block hashes: the identity of a block of tokens in one model's KV space.

    h_i = xxh3_128(h_{i-1} || namespace || token ids of block i as little-endian int32)

with h_{-1} = 0. `namespace` is a 16-byte digest of the model fingerprint, KV layout, TP rank
and the request's cache_salt, so two processes or machines agree on every hash and two tenants
never share one. Never Python's hash(), never a random seed. This file must stay pure: no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import msgpack
import numpy as np
import torch
import xxhash

from .errors import UsageError

HASH_FORMAT_VERSION = 1
_INT32 = np.iinfo(np.int32)


@lru_cache(maxsize=4096)
def namespace(model: str, layout_fingerprint: str, tp_rank: int = 0, salt: str | None = None) -> bytes:
    """16-byte digest of everything besides the tokens that decides what a block's KV is.

    The fields are msgpack-encoded before hashing so that no two different tuples can produce
    the same bytes (a plain concatenation of "ab"+"c" and "a"+"bc" would collide).
    """
    fields = [HASH_FORMAT_VERSION, model, layout_fingerprint, int(tp_rank), salt]
    return xxhash.xxh3_128_digest(msgpack.packb(fields))


def token_bytes(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """Token ids as little-endian int32 bytes, 4 bytes a token; the form hashed and stored."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise UsageError(f"tokens must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise UsageError("token ids must be integers that fit in int32")
    return arr.astype("<i4", copy=False).tobytes()


def hash_blocks(
    tokens: bytes, block_size: int, ns: bytes, parent: int = 0, first_block: int = 0, last_block: int | None = None
) -> list[int]:
    """Chained hashes of the full blocks `first_block .. last_block-1` of `tokens` (token_bytes form).

    `parent` is the hash of block `first_block - 1` (0 when starting at the first block), so a
    sequence that grows can extend its chain without rehashing what it already has.
    """
    stride = 4 * block_size
    full = len(tokens) // stride
    last = full if last_block is None else min(last_block, full)
    view = memoryview(tokens)
    out: list[int] = []
    h = parent
    for i in range(first_block, last):
        h = xxhash.xxh3_128_intdigest(h.to_bytes(16, "little") + ns + view[i * stride : (i + 1) * stride])
        out.append(h)
    return out
