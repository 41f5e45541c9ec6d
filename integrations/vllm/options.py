"""The connector's options and the identity of its blocks: what `kv_connector_extra_config` may
say, the KVLayout of vLLM's pages, and the name (namespace) under which the blocks are stored.

Both vLLM processes (the scheduler's and each worker's) build the same answer from the same
vllm_config, so their caches agree on every slot without talking. Under tensor parallelism a
block holds every rank's KV heads (each rank copies its slice): L2 and L3 hold whole-model
blocks, named as a single-GPU engine names them, so TP sizes share them. With vLLM's hybrid KV-cache
manager (several KV-cache groups, each with its own block ids), each group gets options of its own
(`per_group`): its layers, its share of L2, and a name of its own. Never imports torch kernels,
never moves bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tierkv.config import CacheConfig
from tierkv.errors import ConfigError
from tierkv.layout import KVLayout, group_tag

# kv_connector_extra_config keys, under tierkv-serve's flag names
OPTIONS = ("l2", "l3", "eviction", "write_policy", "kv_offload_dtype", "model")
DEFAULT_L2 = "4GiB"
NULL_BLOCK = 0  # vLLM's null block (BlockPool.null_block): a position a sliding window left, no memory
GROUP_KINDS = ("FullAttentionSpec", "SlidingWindowSpec")  # the KV-cache group specs the connector stores


@dataclass(frozen=True)
class ConnectorOptions:
    cache: CacheConfig
    model: str  # the namespace's model name
    layout: KVLayout  # one rank's pages, as vLLM allocates them
    whole: KVLayout  # a whole block, every rank's KV heads: what L2 slots and L3 objects hold
    tp_size: int
    kv_format: str  # "" where vLLM's pages hold plain K and V (CUDA), else what they hold (CPU)
    kv_layout: str  # tiers.gpu.KV_LAYOUTS name of the registered tensors
    engine_blocks: int  # vLLM's KV blocks (0 on a worker, which needs no count)
    layer_names: tuple[str, ...] = ()  # the KV-cache group's layers, in order; (): every registered layer
    window: int | None = None  # the group's sliding window in tokens (None: full attention)


def parse(vllm_config, num_blocks: int = 0) -> ConnectorOptions:
    """The options of this vLLM engine; ConfigError naming what to change for any it cannot take."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; TierKVConnector "
                          f"takes {', '.join(OPTIONS)} (tierkv-serve's flags of the same names)")
    l3 = extra.get("l3", [])
    if isinstance(l3, str):
        l3 = [l3]
    engine_id = vllm_config.kv_transfer_config.engine_id
    cache = CacheConfig(
        l2=extra.get("l2", DEFAULT_L2), l3=list(l3), eviction=extra.get("eviction", "lru"),
        write_policy=extra.get("write_policy", "write_through"), kv_offload_dtype=extra.get("kv_offload_dtype"),
        l2_file=f"/dev/shm/tierkv-{engine_id}",
    )
    if cache.l2 == 0:
        raise ConfigError("kv_connector_extra_config l2: TierKVConnector keeps blocks in L2 (and L3 below it); "
                          "give l2 a size such as \"4GiB\"")
    parallel = vllm_config.parallel_config
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    tp, total_heads = parallel.tensor_parallel_size, model_config.get_total_num_kv_heads()
    if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
        raise ConfigError("TierKVConnector runs with pipeline_parallel_size=1 and data_parallel_size=1 for now "
                          "(tensor parallelism is supported)")
    if total_heads % tp:
        raise ConfigError(f"TierKVConnector needs the {total_heads} KV heads split evenly over tensor_parallel_size="
                          f"{tp} (vLLM replicates them otherwise, which the connector does not store yet)")
    if tp > 1 and extra.get("kv_offload_dtype"):
        raise ConfigError("kv_offload_dtype with tensor_parallel_size > 1: each rank writes its KV heads into its "
                          "slice of a block, and fp8 blocks are packed whole; leave kv_offload_dtype unset")
    if cache_config.cache_dtype not in ("auto", None):
        raise ConfigError(f"TierKVConnector stores KV in the model's dtype; --kv-cache-dtype {cache_config.cache_dtype} "
                          "is not supported: leave it at auto (tierkv's kv_offload_dtype=fp8_e4m3 halves L2 and L3 instead)")
    dtype = model_config.dtype
    layout = KVLayout(
        num_layers=model_config.get_num_layers(parallel), num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_dim=model_config.get_head_size(), block_size=cache_config.block_size, dtype=dtype,
    )
    on_cpu = vllm_config.device_config.device_type == "cpu"
    kv_format = f"vllm_cpu-{_cpu_isa(dtype, layout)}" if on_cpu else ""
    return ConnectorOptions(cache=cache, model=extra.get("model") or default_model(vllm_config), layout=layout,
                            whole=replace(layout, num_kv_heads=total_heads), tp_size=tp, kv_format=kv_format,
                            kv_layout="vllm_cpu" if on_cpu else "vllm_paged", engine_blocks=num_blocks)


def per_group(opts: ConnectorOptions, kv_cache_config) -> list[ConnectorOptions]:
    """The options of each of vLLM's KV-cache groups. One group (vLLM's hybrid manager off, or a
    model of one layer kind): `opts` itself, one cache over every layer, named as ever. Several
    (the hybrid manager on a model with sliding-window and full-attention layers): each group's
    blocks have block ids of their own, so each gets a cache of its own, over its layers, with
    its share of L2 (by layers) in a shared memory file of its own, its blocks named apart by
    the group's place and window (L2 and L3 objects are per group)."""
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if len(groups) <= 1:
        return [opts]
    total = sum(len(g.layer_names) for g in groups)
    out = []
    for i, group in enumerate(groups):
        spec, n = group.kv_cache_spec, len(group.layer_names)
        kind = type(spec).__name__
        if kind not in GROUP_KINDS:
            raise ConfigError(f"TierKVConnector stores KV-cache groups of {' and '.join(GROUP_KINDS)}; this model's "
                              f"group {i} is a {kind}: run it without the connector")
        layout = opts.layout
        found = (spec.num_kv_heads, spec.head_size, getattr(spec, "head_size_v", spec.head_size), spec.dtype,
                 spec.block_size)
        if found != (layout.num_kv_heads, layout.head_dim, layout.head_dim, layout.dtype, layout.block_size):
            raise ConfigError(f"KV-cache group {i} ({kind}) has pages of kv heads, head size K/V, dtype, block size "
                              f"{found}, not the model's {layout.num_kv_heads, layout.head_dim, layout.head_dim, layout.dtype, layout.block_size}: "
                              "TierKVConnector stores one page shape per model")
        window = spec.sliding_window if kind == "SlidingWindowSpec" else None
        tag = group_tag(i, window)
        cache = replace(opts.cache, l2=opts.cache.l2 * n // total, l2_file=f"{opts.cache.l2_file}-{tag}")
        out.append(replace(opts, cache=cache, layout=replace(layout, num_layers=n),
                           whole=replace(opts.whole, num_layers=n), layer_names=tuple(group.layer_names), window=window,
                           kv_format="-".join(x for x in (opts.kv_format, tag) if x)))
    return out


def _cpu_isa(dtype: torch.dtype, layout: KVLayout) -> str:
    """How vLLM's CPU attention packs K on this machine (its own choice, so the same as the
    workers'): pages packed another way are other bytes, and are named apart."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # private: the one place it decides

    return _get_attn_isa(dtype, layout.block_size, layout.head_dim)


def default_model(vllm_config) -> str:
    """The namespace's model name when the options give none: a local checkpoint's fingerprint
    (every byte of its weights: a fine-tune never reads its base model's blocks), or the Hub id
    at its revision."""
    model_config = vllm_config.model_config
    path = Path(model_config.model)
    if path.is_dir():
        from tierkv.engine.loader import fingerprint, weight_files

        return "local:" + fingerprint(path, weight_files(path))
    return f"{model_config.model}@{model_config.revision or 'main'}"


def request_salt(request) -> str | None:
    """What besides the tokens decides a request's KV, as vLLM keys it: cache_salt and a LoRA."""
    parts = []
    if request.cache_salt:
        parts.append(f"salt:{request.cache_salt}")
    lora = request.lora_request
    if lora is not None:
        parts.append(f"lora:{lora.lora_name}:{lora.lora_path}")
    return "\x00".join(parts) if parts else None


def cacheable(request) -> bool:
    """Requests whose KV depends on more than token ids and salt (images, prompt embeddings) are
    neither looked up nor saved: their tokens alone would name other KV."""
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None
