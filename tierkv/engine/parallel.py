"""Tensor parallelism: which part of the model a rank holds, and the collectives between ranks.

Megatron-style sharding of the Llama-family decoder over `size` ranks of one host:
- column-parallel q/k/v and gate/up: rank r holds its heads (and its slice of the intermediate
  size), so attention and SiLU run on local data;
- row-parallel o and down: each rank multiplies its slice and one all-reduce sums the partials;
- vocab-parallel embedding and LM head: rank r holds rows [r * per, (r + 1) * per) of a vocab
  padded to size * per; the embedding all-reduces, the logits are all-gathered.
KV heads are split like q heads; with fewer KV heads than ranks each is replicated on
size / num_kv_heads ranks (a rank's q heads always fall in one KV head then).

`TensorParallel()` (size 1) is the plain model: every collective is a no-op. This file never
starts processes (workers.py does) and never knows about the cache or requests.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tierkv.errors import ConfigError

# How long a collective may wait for a peer before it fails. Long enough for the slowest step
# (a long prefill chunk, a CUDA-graph capture), short enough that a rank stuck for good is an
# error a person sees rather than a hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older releases lack the new one
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_tensor_parallel(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int | None = None,
                          gpus: int | None = None) -> None:
    """Raise ConfigError, saying what to change, unless `size` ranks can split this model (and,
    with `gpus` given, unless that many GPUs exist)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    if num_heads % size:
        choices = [n for n in range(1, num_heads + 1) if num_heads % n == 0 and _kv_fits(n, num_kv_heads)]
        raise ConfigError(f"tensor_parallel_size {size} does not divide the model's {num_heads} attention heads; "
                          f"use one of {choices}")
    if not _kv_fits(size, num_kv_heads):
        raise ConfigError(f"tensor_parallel_size {size} cannot split the model's {num_kv_heads} KV heads: it must "
                          f"divide them, or be a multiple of them (each KV head then replicated)")
    if intermediate_size is not None and intermediate_size % size:
        raise ConfigError(f"tensor_parallel_size {size} does not divide the model's intermediate size "
                          f"{intermediate_size}")
    if gpus is not None and size > gpus:
        raise ConfigError(f"tensor_parallel_size {size} needs {size} GPUs, but {gpus} are visible; lower it to "
                          f"{gpus} or less")


def _kv_fits(size: int, num_kv_heads: int) -> bool:
    return num_kv_heads % size == 0 or size % num_kv_heads == 0


@dataclass(slots=True)
class TensorParallel:
    """This rank's place among `size` ranks, and the process group its collectives run on
    (None for size 1: nothing to talk to)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def part(self, n: int) -> slice:
        """This rank's equal share of `n` (heads, intermediate features); n % size == 0."""
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, num_kv_heads: int) -> slice:
        """The KV heads this rank holds: its share, or the one head it replicates."""
        if num_kv_heads >= self.size:
            return self.part(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return slice(head, head + 1)

    def vocab_per_rank(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)  # ceil: the last rank's rows past vocab_size are padding

    def vocab(self, vocab_size: int) -> slice:
        """Rows of the (padded) vocabulary this rank holds."""
        per = self.vocab_per_rank(vocab_size)
        return slice(self.rank * per, (self.rank + 1) * per)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (on the device's stream: no host wait); returns it."""
        if self.enabled:
            dist.broadcast(x, 0, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[n, per] logits of this rank's vocab rows -> [n, vocab_size] of every rank's, on every rank."""
        if not self.enabled:
            return logits
        n, per = logits.shape
        if n == 0:  # a step where no row samples (n is the same on every rank, so all skip together)
            return logits.new_empty((0, vocab_size))
        # [ranks * n, per]: ranks concatenated along dim 0, the one output shape gloo and NCCL both take
        out = torch.empty((self.size * n, per), dtype=logits.dtype, device=logits.device)
        _all_gather(out, logits.contiguous(), group=self.group)
        return out.view(self.size, n, per).permute(1, 0, 2).reshape(n, self.size * per)[:, :vocab_size]


def init_process_group(rank: int, size: int, init_file: str, device: torch.device) -> TensorParallel:
    """Join the ranks' default process group (NCCL on GPUs, gloo on CPU) through a rendezvous
    file every rank names, and return this rank's TensorParallel. On a GPU, rank r uses cuda:r."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a dead peer fails the op, not a hang
    # the ranks share one host: gloo (the CPU collectives, and the control group beside NCCL)
    # listens on loopback only, never on a network interface
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size, dist.group.WORLD)
