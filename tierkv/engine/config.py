"""EngineConfig: every option of the engine with its default, validated in one place.

`LLM(**options)`, `Engine(**options)` and `tierkv-serve` all build one of these, so an option
means the same thing and defaults the same way everywhere. The cache's own options become a
`CacheConfig` here (its L1 default is the cache's, computed where the cache is made). Defaults
that depend on the device are resolved by `for_device`. This file never loads a model or
allocates memory.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import CacheConfig, check_offload_dtype, parse_size, require_l2_for_l3
from ..errors import ConfigError
from ..host_memory import host_available_bytes
from .hub import model_source

if TYPE_CHECKING:
    import torch

# Tokens one step may compute: on a GPU large enough to keep prefill compute-bound, on CPU small
# enough that a step stays interactive.
GPU_BATCHED_TOKENS = 8192
CPU_BATCHED_TOKENS = 1024

# L2 when `l2` is None and the model runs on a GPU: this share of the host memory available at
# startup, capped (pinning is paid at startup, ~1 s per 10 GiB, and pinned pages leave the OS's
# other users short). On CPU the default stays off: host memory is where the model and L1 live
# already, so an L2 there would only copy blocks from one part of it to another.
L2_SHARE = 0.25
L2_CAP = 32 * 2**30
L2_DEFAULT_RULE = f"{L2_SHARE:.0%} of available host memory, at most {L2_CAP // 2**30} GiB"


def default_write_policy(l3: tuple[str, ...] | list[str]) -> str:
    """The write policy when none is given: write_through with an L3, write_back without.

    Writing through publishes a block to the shared tiers as soon as it is full, which is what
    other processes reading L3 need. Without an L3 the tiers are this process's own, and write_back
    moves the same blocks to L2 only when L1 evicts them, so a workload that fits L1 copies
    nothing. Measured on the H200 (bench_throughput, 256 prompts, the default L2): write_through
    23,577 -> 19,858 output tok/s, 16% of the run spent on copies no request read back;
    write_back 23,577, as fast as no L2 (23,612).
    """
    return "write_through" if l3 else "write_back"


# dtype names a user may pass -> the torch dtype's name (the model runs in one of these three)
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "half": "float16", "float32": "float32", "fp32": "float32"}
_DEVICE = re.compile(r"^(cpu|cuda)(:\d+)?$")


def dtype_name(dtype: object) -> str | None:
    """The torch name of `dtype` (a name above, "auto", None or a torch.dtype); None means "auto".
    Raises ConfigError for any other. Needs no torch import, so it runs before torch loads."""
    if dtype is None or dtype == "auto":
        return None
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and name in DTYPES:
        return DTYPES[name]
    if not isinstance(dtype, str) and name in DTYPES.values():
        return name
    raise ConfigError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(DTYPES)} "
                      "(or torch.bfloat16, torch.float16, torch.float32)")


def default_l2(device_type: str, available: int | None, bytes_per_block: int) -> int:
    """Bytes of L2 when none is given: on a GPU, min(L2_SHARE of `available`, L2_CAP) in whole
    blocks; 0 on CPU or when the available memory is unknown."""
    if device_type != "cuda" or not available:
        return 0
    return min(int(available * L2_SHARE), L2_CAP) // bytes_per_block * bytes_per_block


def check_device(device: object) -> None:
    """"cpu", "cuda", "cuda:N", a torch.device of those, or None (the GPU when there is one)."""
    text = device if isinstance(device, str) else str(device)
    if device is not None and not _DEVICE.match(text):
        raise ConfigError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")


@dataclass(slots=True)
class EngineConfig:
    """The engine's options.

    model: a Hugging Face model directory or a hub id ("org/name", fetched into the HF cache,
        safetensors only); None is the bundled SmolLM2-135M-Instruct.
    l1, l2, l3, eviction, write_policy: the cache tiers (see CacheConfig); write_policy None is
        write_through with an L3 and write_back without (`default_write_policy`); l1 None sizes L1
        from the memory the weights left free; l2 None is, on a GPU, L2_SHARE of the available
        host memory up to L2_CAP (`default_l2`) and off on CPU; l2=0 turns L2 off.
    kv_offload_dtype: None keeps L2/L3 blocks in the model's dtype; "fp8_e4m3" stores them as fp8
        with per-head scales: ~2x the blocks in the same L2/L3, half the PCIe and disk bytes
        (see CacheConfig; L1 and attention keep the model's dtype).
    block_size: tokens per KV block.
    enable_prefix_caching: False computes every prompt from scratch (and shares nothing).
    max_model_len: longest sequence (prompt + output); None is the model's own maximum.
    max_num_batched_tokens: tokens one step computes at most; None is 8192 on a GPU, 1024 on CPU.
    max_num_seqs: sequences running at once.
    device, dtype: where and in what precision the model runs.
    cache_dir: where the bundled model is converted (default ~/.cache/tierkv); hub models go
        to the Hugging Face cache (HF_HOME).
    enforce_eager: no CUDA graphs for decode steps (debugging, or to save their capture time).
    async_scheduling: the host schedules and prepares step N+1 while the GPU runs step N, and
        takes step N's tokens back afterwards; False runs each step to completion first.
    tensor_parallel_size: GPUs (ranks) the model is split over, one process each, started by the
        engine (rank r on cuda:r; on CPU, gloo processes). l1 and l2 are then per rank, as a
        GPU's memory is; the default L2 share is divided among the ranks. L3 stays whole-model:
        rank 0 reads and writes every rank's KV heads, so the store serves any TP size.
    """

    model: str | None = None
    l1: int | str | None = None
    l2: int | str | None = None
    l3: tuple[str, ...] = ()
    eviction: str = "lru"
    write_policy: str | None = None
    kv_offload_dtype: str | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    device: str | None = None
    dtype: str | torch.dtype | None = None
    cache_dir: str | None = None
    enforce_eager: bool = False
    async_scheduling: bool = True
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        self.l3 = (self.l3,) if isinstance(self.l3, str) else tuple(self.l3)
        for name in ("block_size", "max_num_seqs", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
                raise ConfigError(f"{name} must be an int >= 2 or None (the default), got {value!r}")
        check_device(self.device)
        dtype_name(self.dtype)
        check_offload_dtype(self.kv_offload_dtype)
        model_source(self.model)  # a missing directory fails here; a hub id is fetched when loading
        self.cache_config()  # sizes, policies and L3 URLs fail here, before a model is loaded
        self.check_tiers(None if self.device is None else str(self.device).split(":")[0])

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> EngineConfig:
        """`EngineConfig(model, **options)` with an unknown option named, and the known ones listed."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option {unknown[0]!r}; the options are: {', '.join(sorted(known))}")
        return cls(model=model, **options)

    def check_tiers(self, device_type: str | None) -> None:
        """What the tiers need of each other, before anything loads: an L3 stages its blocks through
        L2 (require_l2_for_l3). An l2 left to its default depends on the device (default_l2: off on
        CPU), so with `device_type` None (no device named yet) only a given l2 is checked; the
        Engine checks again once torch has found the device, before it reads a weight."""
        if not self.l3:
            return
        if self.l2 is not None:
            require_l2_for_l3(self.l3, parse_size(self.l2, "CacheConfig.l2"))
        elif device_type is not None:
            # in bytes, not yet blocks: the block size comes with the model
            require_l2_for_l3(self.l3, default_l2(device_type, host_available_bytes(), 1),
                              " (L2 is off by default on CPU)" if device_type != "cuda"
                              else " (the default L2 is off: the host memory available is unknown)")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(l1=self.l1, l2=self.l2 or 0, l3=list(self.l3), eviction=self.eviction,
                           write_policy=self.write_policy or default_write_policy(self.l3),
                           kv_offload_dtype=self.kv_offload_dtype)

    def for_device(self, device: torch.device, max_position_embeddings: int, bytes_per_block: int,
                   available: int | None = None) -> EngineConfig:
        """A copy with every device- and model-dependent default filled in. `available`: the
        host memory free for L2 (read from the system when None)."""
        l2 = self.l2
        if l2 is None:
            l2 = default_l2(device.type, host_available_bytes() if available is None else available, bytes_per_block)
        return dataclasses.replace(
            self,
            l2=l2,
            write_policy=self.write_policy or default_write_policy(self.l3),
            max_model_len=self.max_model_len or max_position_embeddings,
            max_num_batched_tokens=self.max_num_batched_tokens
            or (GPU_BATCHED_TOKENS if device.type == "cuda" else CPU_BATCHED_TOKENS),
        )
