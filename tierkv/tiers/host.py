"""L2: the host KV pool, allocated once, pinned in place when a GPU is there to copy to.

    kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] in the model's dtype, or
        [num_blocks, bytes_per_block] uint8 packed blocks with an OffloadLayout (fp8 + scales)

Block-first: a block is one contiguous run of bytes, so L2<->L3 is a single read or write and
neighbouring slots form long DMA transfers. The pool is plain host memory page-locked with
cudaHostRegister: exactly the size asked (torch's pinned allocator rounds up to a power of two)
and faulted in on all cores first (the driver alone does it on one). Where the OS will not pin
it all, the pool shrinks to the largest halving that pins, and says so; where nothing pins, it
stays pageable. This file owns memory and free slots, never policy.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from ..layout import KVLayout, OffloadLayout
from .pool import FreeSlots, check_fits, gib

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one
_PAGE = 4096
_ADVICE = "raise the locked-memory limit (ulimit -l, memlock) or free host memory, or lower CacheConfig.l2"


def _register(kv: torch.Tensor) -> bool:
    """Page-lock `kv`'s memory for DMA; False where the driver refuses. Tests replace this."""
    cudart = torch.cuda.cudart()  # raises where there is no CUDA runtime
    # Fault every page in on all cores: the driver alone does it on one (H200 box, 100 GiB:
    # ~10 s this way, ~40 s without).
    kv.view(-1).view(torch.uint8)[::_PAGE].fill_(0)
    rc: list[int] = []

    def call() -> None:
        rc.append(int(cudart.cudaHostRegister(kv.data_ptr(), kv.nbytes, _PORTABLE)))

    # On a throwaway thread: CUDA keeps a refusal as the calling thread's "last error", which
    # torch's next kernel-launch check on that thread would raise.
    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    return rc == [0]


def _unregister(kv: torch.Tensor) -> None:
    torch.cuda.synchronize()  # no copy may still be using these pages
    torch.cuda.cudart().cudaHostUnregister(kv.data_ptr())


class HostPool:
    def __init__(self, layout: KVLayout | OffloadLayout, num_blocks: int, pin: bool | None = None) -> None:
        self.layout = layout
        self._shape, self._dtype = layout.block_storage  # one block: its shape and dtype here
        check_fits(num_blocks * layout.bytes_per_block, torch.device("cpu"), "CacheConfig.l2")
        if pin is None:
            pin = torch.cuda.is_available()
        kv = self._pinned(num_blocks) if pin and num_blocks > 0 else None
        self.pinned = kv is not None
        self.kv = kv if kv is not None else torch.empty((num_blocks, *self._shape), dtype=self._dtype)
        self.num_blocks = self.kv.shape[0]
        self.free = FreeSlots(self.num_blocks)
        self._unpin = None
        if self.pinned:
            # Unpinned exactly once, by close() or when the pool is collected; the finaliser holds
            # `kv`, so the memory outlives its registration. At exit the OS reclaims it all.
            self._unpin = weakref.finalize(self, _unregister, self.kv)
            self._unpin.atexit = False

    def _pinned(self, num_blocks: int) -> torch.Tensor | None:
        """A pinned pool of `num_blocks`, or of the largest halving of it that pins; None if none pins."""
        asked = num_blocks * self.layout.bytes_per_block
        n = num_blocks
        try:
            while n > 0:
                kv = torch.empty((n, *self._shape), dtype=self._dtype)
                if _register(kv):
                    break
                del kv  # give the pages back before trying half as many
                n //= 2
        except (RuntimeError, AssertionError) as err:  # no usable CUDA runtime
            log.warning("could not pin L2 (%s); using %s of pageable memory, copies will be slower", err, gib(asked))
            return None
        if n == 0:
            log.warning("could not pin any of the %s asked for L2, not even one block; using pageable memory, "
                        "copies will be slower. To pin it, %s", gib(asked), _ADVICE)
            return None
        if n < num_blocks:
            log.warning("could not pin the %s asked for L2 (%d blocks); pinned %s (%d blocks) and L2 is that size. "
                        "To pin it all, %s", gib(asked), num_blocks, gib(kv.nbytes), n, _ADVICE)
        return kv

    def close(self) -> None:
        """Unpin and release the memory, once no copy to or from it is in flight; the pool is then empty."""
        if self._unpin is not None:
            self._unpin()
        self.kv = torch.empty((0, *self._shape), dtype=self._dtype)
        self.num_blocks, self.pinned = 0, False
        self.free = FreeSlots(0)

    def limit(self, num_blocks: int) -> None:
        """Use only the first `num_blocks` slots (tensor-parallel ranks all use as many as the rank
        that could pin the fewest). Only before any slot is taken."""
        if len(self.free) != self.num_blocks:
            raise RuntimeError("HostPool.limit must come before any slot is taken")
        if num_blocks < self.num_blocks:
            self.kv = self.kv[:num_blocks]
            self.num_blocks = num_blocks
            self.free = FreeSlots(num_blocks)

    @property
    def rows(self) -> torch.Tensor:
        """The pool's memory as [num_blocks, bytes_per_block] uint8 (a view: writes land in the slots)."""
        return self.kv.view(torch.uint8).view(self.num_blocks, self.layout.bytes_per_block)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
