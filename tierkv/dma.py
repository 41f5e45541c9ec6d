"""Asynchronous DMA between host and device memory by address, through the CUDA runtime (ctypes).

torch copies whole tensors; a move between L2 and a staging buffer wants many copy-engine
transfers at once (one per run of neighbouring L2 slots, or per block when a move takes a group
of layers of each: a slice of each block). `copy_batch` issues them in one cudaMemcpyBatchAsync
call (CUDA 12.8+), so the host pays one call a chunk however scattered the slots; with an older
runtime, or on the legacy default stream, which that call refuses, it issues one cudaMemcpyAsync
each. `copy` is one strided (2-D) copy. The copy engines leave the SMs to compute: a copy the GPU
runs itself over PCIe slows the step beside it (H100, bench_planes: decode linears 1.2-24x slower
beside a GPU copy, 1.03-1.07x beside the copy engine's). This binds the runtime torch itself
loaded (found among the process's mapped libraries), so the copies share torch's streams and
context. Where no runtime can be found, `available()` is False and callers keep to the copies
torch can do. This file never allocates device memory and never decides what to copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the addresses (unified addressing)
_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: a batch reads its sources in stream order
_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute (a hint)
_BATCH: dict[str, bool] = {}  # set by _runtime() where the runtime has cudaMemcpyBatchAsync


class _MemLocation(ctypes.Structure):  # struct cudaMemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # struct cudaMemcpyAttributes (driver_types.h, CUDA 12.8+)
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _MemLocation),
                ("dst_loc_hint", _MemLocation), ("flags", ctypes.c_uint)]


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch uses, or None."""
    path = None
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
    except OSError:
        pass
    path = path or ctypes.util.find_library("cudart")
    if path is None:
        log.info("no CUDA runtime library found: L1<->L2 moves use GPU copies instead of DMA")
        return None
    lib = ctypes.CDLL(path)
    lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaMemcpy2DAsync.restype = ctypes.c_int
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaGetLastError.restype = ctypes.c_int
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaMemcpyAsync.restype = ctypes.c_int
    version = ctypes.c_int(0)
    lib.cudaRuntimeGetVersion(ctypes.byref(version))
    if version.value >= 12080 and hasattr(lib, "cudaMemcpyBatchAsync"):
        pointers, sizes = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
        # (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, [failIdx,] stream): CUDA 12.8 and
        # 12.9 take failIdx (where a failed batch stopped), 13.0 dropped it
        fail_index = [sizes] if version.value < 13000 else []
        lib.cudaMemcpyBatchAsync.argtypes = [pointers, pointers, sizes, ctypes.c_size_t,
                                             ctypes.POINTER(_MemcpyAttributes), sizes, ctypes.c_size_t,
                                             *fail_index, ctypes.c_void_p]
        lib.cudaMemcpyBatchAsync.restype = ctypes.c_int
        _BATCH.update(fail_index=bool(fail_index))
    return lib


def available() -> bool:
    return _runtime() is not None


def batched() -> bool:
    """Whether copy_batch issues a batch in one call (else one call a copy)."""
    return available() and bool(_BATCH)


def copy(dst: int, src: int, width: int, rows: int = 1, *, dst_pitch: int = 0, src_pitch: int = 0,
         stream: int = 0) -> None:
    """Copy `rows` rows of `width` bytes from address `src` to `dst`, row r starting r*pitch bytes
    after the first (pitch 0: rows follow each other), ordered on CUDA stream handle `stream`."""
    dst_pitch, src_pitch = dst_pitch or width, src_pitch or width
    if dst_pitch == src_pitch == width:
        width, rows, dst_pitch, src_pitch = width * rows, 1, width * rows, width * rows  # one plain copy
    _check(_runtime().cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, _DEFAULT, stream),
           "cudaMemcpy2DAsync")


def copy_batch(dsts: Sequence[int] | np.ndarray, srcs: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray,
               stream: int) -> None:
    """Copy sizes[i] bytes from address srcs[i] to dsts[i] for every i, ordered on CUDA stream
    handle `stream` as one operation (the copies among themselves in any order: none may overlap
    another's destination). Lists of ints or int64 arrays (staging.copies): an array's memory is
    handed to the runtime as it is, where a list is converted first."""
    n = len(sizes)
    if not (len(dsts) == len(srcs) == n):
        raise ValueError(f"copy_batch needs as many destinations, sources and sizes; got {len(dsts)}, "
                         f"{len(srcs)} and {n}")
    if n == 0:
        return
    lib = _runtime()
    if not _BATCH or not stream:
        for dst, src, size in zip(*(_ints(x) for x in (dsts, srcs, sizes))):
            _check(lib.cudaMemcpyAsync(dst, src, size, _DEFAULT, stream), "cudaMemcpyAsync")
        return
    # [n] each, 64-bit: the layouts of void* and size_t (kept referenced until the call returns)
    dsts, srcs, sizes = (np.ascontiguousarray(x, dtype=np.int64) for x in (dsts, srcs, sizes))
    attrs = _MemcpyAttributes(src_access_order=_ORDER_STREAM, flags=_PREFER_OVERLAP_WITH_COMPUTE)
    first = (ctypes.c_size_t * 1)(0)  # the attributes apply from copy 0 on: to all of them
    fail_index = [(ctypes.c_size_t * 1)(0)] if _BATCH["fail_index"] else []
    _check(lib.cudaMemcpyBatchAsync(_pointer(dsts, ctypes.c_void_p), _pointer(srcs, ctypes.c_void_p),
                                    _pointer(sizes, ctypes.c_size_t), n, ctypes.byref(attrs), first, 1,
                                    *fail_index, stream), "cudaMemcpyBatchAsync")


def _ints(values) -> list[int]:
    """Python ints, which ctypes takes as addresses and sizes (a numpy integer it refuses)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def _pointer(array: np.ndarray, ctype):
    return array.ctypes.data_as(ctypes.POINTER(ctype))


def _check(rc: int, call: str) -> None:
    if rc != 0:
        _runtime().cudaGetLastError()  # clear it, or torch's next launch check on this thread raises it
        raise RuntimeError(f"{call} failed: {_runtime().cudaGetErrorString(rc).decode()}")
