"""Hugging Face transformers on a TieredKVCache: `generate` with prefix reuse and paged, offloadable KV.

`TieredCache` is a transformers `Cache` whose K/V live in the L1 paged pool of a TieredKVCache
instead of per-layer growing tensors. `begin(prompt)` reserves the sequence's blocks and brings in
the prompt's cached prefix (L1 hits shared, L2 loaded, L3 prefetched), so `generate` computes only
the uncached suffix; `end(sequence)` commits the full blocks, where the cache's write policy copies
them down to L2/L3 for later calls and other processes. With the pool on the host and the model on
a GPU, each layer's K/V is gathered from the host blocks and copied up one layer ahead of use.
`generate(model, input_ids, kv_cache)` does begin + `model.generate` + end in one call.

This file never changes transformers' attention, masks or sampling, and never moves blocks between
tiers itself: it only reads and writes the pool slots of the one sequence it holds.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from typing_extensions import Self

from tierkv import kernels
from tierkv.cache import SequenceBlocks, TieredKVCache
from tierkv.errors import ConfigError, ShapeError, TierKVError

log = logging.getLogger(__name__)

__all__ = ["GenerateResult", "TieredCache", "cache_kwarg", "generate"]

L3_DEADLINE_S = 5.0  # how long begin() waits for L3 blocks before computing the rest instead


class TieredLayer(CacheLayerMixin):
    """One decoder layer's view of the sequence: `length` tokens of K/V in the pool's layer `index`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: TieredCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.length = 0  # tokens of this layer whose K/V sit in the pool
        self.device: torch.device | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens' K/V into the pool; return this layer's whole K and V, [1, Hkv, S, D] each."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # transformers 5.x passes the query length; kv covers everything cached plus the query
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.length + q, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise TierKVError("TieredCache cannot be reset in place; call end() and use a new TieredCache")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise TierKVError("TieredCache holds one sequence: beam search (num_beams > 1) is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise TierKVError("TieredCache cannot be cropped (assisted/speculative decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise TierKVError(
                "TieredCache holds one sequence: num_return_sequences/num_beams > 1 is not supported"
            )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise TierKVError("TieredCache holds one sequence; batch selection is not supported")

    def offload(self) -> None:  # the pool is where the K/V already live
        pass

    def prefetch(self) -> None:  # TieredCache prefetches through its own staging (see _prefetch)
        pass


class TieredCache(Cache):
    """A transformers Cache backed by a TieredKVCache; one sequence (batch size 1) per object.

    kv_cache: a TieredKVCache whose layout matches the model (layers, KV heads, head dim, dtype).
    config:   the model's config, to check that match (optional).
    salt:     a tenant's cache salt: prefixes are shared only between calls with the same salt.
    """

    def __init__(self, kv_cache: TieredKVCache, config=None, *, salt: str | None = None) -> None:
        if not isinstance(kv_cache, TieredKVCache):
            raise ConfigError(f"TieredCache needs a tierkv.TieredKVCache, got {type(kv_cache).__name__}")
        if kv_cache.l1.kv is None:
            raise ConfigError(f"TieredCache reads and writes the L1 pool in tierkv's layout; this cache's L1 is "
                              f"an engine's buffers in the {kv_cache.l1.kv_layout!r} layout: use a cache with its "
                              "own pool (no kv_caches=), or buffers registered with kv_layout='tierkv'")
        layout = kv_cache.layout
        if config is not None:
            _check_layout(layout, config)
        self.kv_cache, self.salt = kv_cache, salt
        self.seq: SequenceBlocks | None = None
        self.prompt: list[int] = []
        self.cached_tokens = 0  # prompt tokens whose K/V came from the tiers (not computed)
        self.by_tier = {"l1": 0, "l2": 0, "l3": 0}  # where the cached prefix came from, in tokens
        self.computed_tokens = 0  # tokens whose K/V the model computed into this cache
        self.ended = False
        # layer -> (K, V) [1, Hkv, n, D] already on the model's device, and the n they cover;
        # filled one layer ahead when the pool and the model sit on different devices.
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._stream = None
        self._row_memo: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(layers=[TieredLayer(self, i) for i in range(layout.num_layers)])

    # ------------------------------------------------------------------ around generate

    def begin(self, input_ids) -> int:
        """Reserve pool blocks for the prompt and load its cached prefix; returns the cached token count.

        input_ids: [T] or [1, T] token ids (a list works too). After this, `get_seq_length()`
        is the cached prefix and `generate` feeds the model only the rest of the prompt.
        """
        if self.seq is not None or self.ended:
            raise TierKVError("this TieredCache already holds a sequence; use a new TieredCache per generate call")
        tokens = _token_list(input_ids)
        kv = self.kv_cache
        m = kv.match(tokens, self.salt)
        if m.by_tier["l3"]:
            # L3 blocks come up to L2 first; allocate() then loads them like any L2 hit
            kv.prefetch(m, L3_DEADLINE_S).wait(L3_DEADLINE_S)
        self.seq = seq = kv.allocate(tokens, self.salt, match=m)
        seq.wait()
        self.prompt = tokens
        self.cached_tokens = seq.num_cached_tokens
        # what allocate() used, by tier as the match saw it (an L3 hit that did not land is recomputed)
        left = self.cached_tokens
        for tier in ("l1", "l2", "l3"):
            self.by_tier[tier] = min(m.by_tier[tier], left)
            left -= self.by_tier[tier]
        for layer in self.layers:
            layer.length = self.cached_tokens
        log.debug("prompt of %d tokens, %d cached %s", len(tokens), self.cached_tokens, self.by_tier)
        return self.cached_tokens

    def end(self, sequence=None) -> int:
        """Commit the sequence's full blocks to the TieredKVCache and release its pool blocks.

        sequence: the ids `generate` returned ([1, T] or [T]); None keeps only the prompt's
        blocks. Returns how many leading tokens the commit covered. Safe to call once.
        """
        if self.seq is None or self.ended:
            return 0
        kv, seq = self.kv_cache, self.seq
        try:
            tokens = self.prompt if sequence is None else _token_list(sequence)
            if tokens[: len(self.prompt)] != self.prompt:
                raise ShapeError("end() got a sequence that does not start with the prompt given to begin()")
            # only positions the model wrote hold K/V: the last generated token was never fed back
            written = min(layer.length for layer in self.layers)
            tokens = tokens[:written]
            kv.commit(seq, tokens)
            return len(tokens) // kv.block_size * kv.block_size
        finally:
            kv.free(seq)
            self.ended = True
            self._staged.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if self.seq is not None and not self.ended:
            self.kv_cache.free(self.seq)
            self.ended = True

    # ------------------------------------------------------------------ the per-layer path

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        if layer_idx + 1 < len(self.layers):
            self._prefetch(layer_idx + 1, key_states.device)
        return keys, values

    def _update(self, layer: TieredLayer, k_new: torch.Tensor, v_new: torch.Tensor):
        if self.seq is None or self.ended:
            raise TierKVError(
                "TieredCache.begin(input_ids) must run before generate (or use "
                "tierkv.integrations.transformers.generate, which calls it)"
            )
        kv, seq = self.kv_cache, self.seq
        if k_new.ndim != 4 or k_new.shape[0] != 1:
            raise ShapeError(
                f"TieredCache holds one sequence: expected K/V [1, Hkv, T, D], got {tuple(k_new.shape)} "
                "(batches, num_beams > 1 and num_return_sequences > 1 are not supported)"
            )
        if k_new.dtype != kv.layout.dtype:
            raise ShapeError(
                f"the model computes K/V in {k_new.dtype} but the TieredKVCache layout holds {kv.layout.dtype}; "
                "build the KVLayout with the model's dtype"
            )
        start, t = layer.length, k_new.shape[2]
        end = start + t
        if start == self.cached_tokens and end != len(self.prompt) and not self.computed_tokens and layer.index == 0:
            raise ShapeError(
                f"the first forward fed {t} tokens on top of {start} cached ones, but the prompt has "
                f"{len(self.prompt)}: pass attention_mask to generate (transformers then skips the cached "
                "prefix itself), or feed input_ids[:, cached:]"
            )
        if end > seq.num_tokens:  # decode steps grow the sequence; layer 0 reserves for all layers
            kv.append(seq, end - seq.num_tokens)
        pool = kv.l1.kv[layer.index]  # [num_blocks, 2, bs, Hkv, D]
        bs = kv.block_size
        positions = torch.arange(start, end)
        table = torch.tensor(seq.slots, dtype=torch.int64)
        slots = table[positions // bs] * bs + positions % bs  # [T] pool slot of each new token
        # [1, Hkv, T, D] -> [T, Hkv, D], the layout the pool kernels take
        k_tok = k_new[0].transpose(0, 1).to(pool.device)
        v_tok = v_new[0].transpose(0, 1).to(pool.device)
        kernels.kv_write(k_tok.contiguous(), v_tok.contiguous(), pool, slots.to(pool.device))
        if layer.index == 0:
            self.computed_tokens += t
        layer.length = end
        if pool.device == k_new.device:
            # one gather per tensor straight into [1, Hkv, end, D]: as cheap as DynamicLayer's cat
            return self._gather(layer.index, end, k_new.device)
        staged = self._staged.pop(layer.index, None)
        if staged is not None and staged[2] == start:
            torch.cuda.current_stream(k_new.device).wait_stream(self._stream)
            k_old, v_old = staged[0], staged[1]
        else:
            k_old, v_old = self._gather(layer.index, start, k_new.device)
        # [1, Hkv, start, D] + [1, Hkv, T, D] -> [1, Hkv, end, D]
        return torch.cat([k_old, k_new], dim=2), torch.cat([v_old, v_new], dim=2)

    def _rows(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of a layer's pool, seen as [num_blocks * 2 * bs] token rows, holding K and V of positions 0..n-1."""
        key = (n, device)
        if key not in self._row_memo:
            bs = self.kv_cache.block_size
            positions = torch.arange(n)
            blocks = torch.tensor(self.seq.slots, dtype=torch.int64)[positions // bs]  # [n]
            k_rows = blocks * (2 * bs) + positions % bs  # K of block b at rows 2b*bs.., V right after
            if len(self._row_memo) > 4:  # this step's start and end are all that is ever asked again
                self._row_memo.clear()
            self._row_memo[key] = (k_rows.to(device), (k_rows + bs).to(device))
        return self._row_memo[key]

    def _gather(self, index: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [1, Hkv, n, D] (contiguous) of layer `index`'s first n tokens, read from the pool onto `device`."""
        pool = self.kv_cache.l1.kv[index]  # [num_blocks, 2, bs, Hkv, D], contiguous
        nb, _, bs, h, d = pool.shape
        rows = pool.view(nb * 2 * bs, h, d).transpose(0, 1)  # [Hkv, token rows, D], a view
        k_rows, v_rows = self._rows(n, pool.device)
        pin = pool.device.type == "cpu" and device.type == "cuda"
        out = []
        for idx in (k_rows, v_rows):
            # index_select along the rows writes [Hkv, n, D] contiguous: attention's layout, one copy;
            # pinned when it is headed for the GPU so the copy up runs asynchronously
            buf = torch.empty((h, n, d), dtype=pool.dtype, pin_memory=True) if pin else None
            x = torch.index_select(rows, 1, idx, out=buf) if pin else rows.index_select(1, idx)
            out.append(x.to(device, non_blocking=True).unsqueeze(0))
        return out[0], out[1]

    def _prefetch(self, index: int, device: torch.device) -> None:
        """Start bringing layer `index`'s cached K/V to the model's GPU while the current layer computes.

        Only when the pool is elsewhere (host pool, GPU model): on one device a gather at use is as cheap.
        """
        pool_device = self.kv_cache.l1.kv.device
        if device.type != "cuda" or pool_device == device or self.seq is None:
            return
        n = self.layers[index].length
        if n == 0:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        # the staged tensors are allocated on the side stream and read on the compute stream after a wait
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            k, v = self._gather(index, n, device)
        k.record_stream(torch.cuda.current_stream(device))
        v.record_stream(torch.cuda.current_stream(device))
        self._staged[index] = (k, v, n)

    # ------------------------------------------------------------------ reporting

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0


@dataclass(slots=True)
class GenerateResult:
    """What `generate` returns: the ids, and how much of the prompt the tiers served."""

    sequences: torch.Tensor  # [1, prompt + new] as transformers returns them
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the TieredKVCache
    computed_tokens: int  # tokens the model ran a forward over (prefill suffix + decode steps)
    by_tier: dict[str, int]
    seconds: float


def generate(
    model, input_ids, kv_cache: TieredKVCache, *, salt: str | None = None, **generate_kwargs
) -> GenerateResult:
    """`model.generate` for one prompt with the TieredKVCache serving and keeping its prefix.

    input_ids: [1, T] (or [T]) token ids. Extra keyword arguments go to `model.generate`
    (max_new_tokens, do_sample, ...). The full blocks of prompt and output are committed after.
    """
    ids = torch.as_tensor(input_ids)
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ShapeError(f"generate() takes one prompt, [1, T] or [T] token ids; got shape {tuple(ids.shape)}")
    for key in ("past_key_values", "cache", "attention_mask"):
        if key in generate_kwargs:
            raise ConfigError(f"generate() sets {key} itself; do not pass it")
    for key in ("num_beams", "num_return_sequences"):
        if generate_kwargs.get(key, 1) != 1:
            raise ConfigError(f"generate() runs one sequence per prompt; {key}={generate_kwargs[key]} is not supported")
    cache = TieredCache(kv_cache, model.config, salt=salt)
    start = time.perf_counter()
    with cache:
        cache.begin(ids)
        ids = ids.to(model.device)
        # transformers skips the cached prefix only when the mask covers the whole prompt
        kwargs = {cache_kwarg(model): cache, "attention_mask": torch.ones_like(ids)}
        out = model.generate(ids, **kwargs, **generate_kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        cache.end(sequences)
    return GenerateResult(sequences, ids.shape[1], cache.cached_tokens, cache.computed_tokens,
                          dict(cache.by_tier), time.perf_counter() - start)


def cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use the name this version's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _token_list(ids) -> list[int]:
    t = torch.as_tensor(ids)
    if t.ndim == 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 1 or t.numel() == 0 or t.dtype.is_floating_point:
        raise ShapeError(f"expected one sequence of integer token ids, [T] or [1, T]; got {tuple(t.shape)} {t.dtype}")
    return t.tolist()


def _check_layout(layout, config) -> None:
    """The TieredKVCache's blocks must have this model's K/V shape."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    want = {
        "num_layers": text.num_hidden_layers,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
    }
    wrong = {k: (getattr(layout, k), v) for k, v in want.items() if getattr(layout, k) != v}
    if wrong:
        detail = ", ".join(f"{k}={have} (model: {need})" for k, (have, need) in wrong.items())
        raise ConfigError(
            f"the TieredKVCache layout does not fit this model: {detail}; build KVLayout from the model config"
        )
    if getattr(text, "sliding_window", None) and getattr(text, "layer_types", None) and any(
        t != "full_attention" for t in text.layer_types
    ):
        log.info("sliding-window layers keep their whole history in TieredCache (the mask still applies the window)")
