"""L2: the host KV pool, allocated once, pinned in place when a GPU is there to copy to.

    kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] in the model's dtype, or
        [num_blocks, bytes_per_block] uint8 packed blocks with an OffloadLayout (fp8 + scales)

Block-first: a block is one contiguous run of bytes, so L2<->L3 is a single read or write and
neighbouring slots form long DMA transfers. The pool is plain host memory page-locked with
cudaHostRegister: exactly the size asked (torch's pinned allocator rounds up to a power of two)
and faulted in on all cores first (the driver alone does it on one). Where the OS will not pin
it all, the pool shrinks to the largest halving that pins, and says so; where nothing pins, it
stays pageable. A pool may instead live in a shared memory file (`file=`): the process that makes
the cache creates it, and others (an engine's workers, which copy between their KV buffers and L2)
map the same bytes with `HostPool.attach`. This file owns memory and free slots, never policy.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import replace

import torch

from ..errors import ConfigError
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


def _remove(file: str) -> None:
    try:
        os.unlink(file)
    except FileNotFoundError:
        pass


def _shared_room(file: str, nbytes: int) -> None:
    """Refuse, naming both sizes, a shared L2 larger than its filesystem's free room (Docker's
    /dev/shm is 64 MiB by default): the pages would fail one at a time, as SIGBUS, mid-copy."""
    folder = os.path.dirname(os.path.abspath(file))
    if not os.path.isdir(folder):
        raise ConfigError(f"the shared L2 file {file} is in a folder that does not exist")
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if os.path.exists(file):
        free += os.path.getsize(file)
    if nbytes > free:
        raise ConfigError(f"the shared L2 needs {nbytes} bytes ({gib(nbytes)}) in {folder}, which has {free} bytes "
                          f"({gib(free)}) free: lower l2, or "
                          "give the container more shared memory (docker --shm-size, or a Kubernetes emptyDir with "
                          "medium: Memory mounted at /dev/shm)")


def _mapped(file: str, num_blocks: int, shape: tuple, dtype: torch.dtype, create: bool) -> torch.Tensor:
    """[num_blocks, *shape] of `dtype` over shared memory file `file` (made anew of that size when `create`)."""
    nbytes = num_blocks * torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    if create:
        # the KV of its requests: owner only. A file left there (a crash, another user) is replaced,
        # never reused: opened as it is, it would keep its own mode and owner.
        try:
            _remove(file)
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as err:
            raise ConfigError(f"cannot create the shared L2 file {file} ({err.strerror}): remove what is there, "
                              "or choose another CacheConfig.l2_file") from None
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
    raw = torch.from_file(file, shared=True, size=nbytes, dtype=torch.uint8)
    return raw.view(dtype).view(num_blocks, *shape)


class HostPool:
    def __init__(self, layout: KVLayout | OffloadLayout, num_blocks: int, pin: bool | None = None,
                 file: str | None = None) -> None:
        """`file`: create the pool as this shared memory file (replacing one left there), unpinned
        here: the processes that copy into it pin their own mappings (`attach`)."""
        self.layout = layout
        self._shape, self._dtype = layout.block_storage  # one block: its shape and dtype here
        check_fits(num_blocks * layout.bytes_per_block, torch.device("cpu"), "CacheConfig.l2")
        self.file, self.owns_file = file, file is not None
        if pin is None:
            pin = torch.cuda.is_available()
        kv = self._pinned(num_blocks) if pin and num_blocks > 0 and file is None else None
        self.pinned = kv is not None
        if file is not None:
            _shared_room(file, num_blocks * layout.bytes_per_block)
            kv = _mapped(file, num_blocks, self._shape, self._dtype, create=True)
            # removed by close(), or else when the process exits (a vLLM that ends without
            # shutting its connector down): a file in /dev/shm holds its memory until removed
            self._remove = weakref.finalize(self, _remove, file)
        self.kv = kv if kv is not None else torch.empty((num_blocks, *self._shape), dtype=self._dtype)
        self.num_blocks = self.kv.shape[0]
        self.free = FreeSlots(self.num_blocks)
        self._unpin = None
        if self.pinned:
            # Unpinned exactly once, by close() or when the pool is collected; the finaliser holds
            # `kv`, so the memory outlives its registration. At exit the OS reclaims it all.
            self._unpin = weakref.finalize(self, _unregister, self.kv)
            self._unpin.atexit = False

    @classmethod
    def attach(cls, layout: KVLayout | OffloadLayout, file: str, pin: bool | None = None,
               heads: tuple[int, int] | None = None) -> HostPool:
        """The pool another process made in shared memory file `file` (HostPool(file=...)), mapped
        here: writes on either side land in the same bytes. Pinned where a GPU is there to copy
        to (`pin` None) and the driver lets it; the free list is the maker's, not this one's.
        `heads=(first, end)`: a tensor-parallel rank's KV heads of each block (`layout` is the
        whole block's): the pool is that slice of every slot, and its layout that rank's."""
        pool = cls.__new__(cls)
        pool.layout, pool.file, pool.owns_file = layout, file, False
        pool._shape, pool._dtype = layout.block_storage
        size = os.path.getsize(file) if os.path.exists(file) else -1
        if size <= 0 or size % layout.bytes_per_block:
            raise ConfigError(f"{file} is not an L2 pool of blocks of {layout.bytes_per_block} bytes "
                              f"({'missing' if size < 0 else f'{size} bytes'}): the cache that makes it must use the "
                              "same KV layout and run first")
        kv = _mapped(file, size // layout.bytes_per_block, pool._shape, pool._dtype, create=False)
        pool.pinned = bool(torch.cuda.is_available() if pin is None else pin) and _register(kv)
        pool.kv, pool.num_blocks = kv, kv.shape[0]
        if heads is not None:
            if isinstance(layout, OffloadLayout) or not 0 <= heads[0] < heads[1] <= layout.num_kv_heads:
                raise ConfigError(f"heads={heads}: a rank's slice of the {layout} blocks in {file} (fp8 L2 blocks "
                                  "are packed whole and cannot be sliced)")
            pool.kv = kv[..., heads[0] : heads[1], :]  # [n, layers, 2, bs, heads, head_dim]
            pool.layout = replace(layout, num_kv_heads=heads[1] - heads[0])
            pool._shape = pool.layout.block_storage[0]
        pool.free = FreeSlots(0)
        pool._unpin = None
        if pool.pinned:
            pool._unpin = weakref.finalize(pool, _unregister, kv)
            pool._unpin.atexit = False
        return pool

    def unlink(self) -> None:
        """Remove the shared file's name once every process that copies into it has mapped it:
        the memory stays theirs and goes with the last of them, however they end (a killed
        process runs no close and no exit handler)."""
        if self.file is not None and self.owns_file:
            self._remove()

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
        """Unpin and release the memory, once no copy to or from it is in flight; the pool is then
        empty. The maker of a shared pool removes its file (mappings elsewhere stay valid)."""
        if self._unpin is not None:
            self._unpin()
        if self.file is not None and self.owns_file:
            self._remove()
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
