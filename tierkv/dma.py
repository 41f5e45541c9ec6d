"""Asynchronous DMA between host and device memory by address: cudaMemcpy2DAsync through ctypes.

torch copies whole tensors; a move between L2 and a staging buffer wants one copy engine
transfer per run of neighbouring L2 slots, often of a slice of each block (a group of layers),
which is a strided 2-D copy that torch would split into a temporary and a host loop. The CUDA
runtime does it in one call. This binds the runtime torch itself loaded (found among the
process's mapped libraries), so the copies share torch's streams and context. Where no runtime
can be found, `available()` is False and callers keep to the copies torch can do. This file
never allocates and never decides what to copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the addresses (unified addressing)


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
    return lib


def available() -> bool:
    return _runtime() is not None


def copy(dst: int, src: int, width: int, rows: int = 1, *, dst_pitch: int = 0, src_pitch: int = 0,
         stream: int = 0) -> None:
    """Copy `rows` rows of `width` bytes from address `src` to `dst`, row r starting r*pitch bytes
    after the first (pitch 0: rows follow each other), ordered on CUDA stream handle `stream`."""
    dst_pitch, src_pitch = dst_pitch or width, src_pitch or width
    if dst_pitch == src_pitch == width:
        width, rows, dst_pitch, src_pitch = width * rows, 1, width * rows, width * rows  # one plain copy
    rc = _runtime().cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, _DEFAULT, stream)
    if rc != 0:
        _runtime().cudaGetLastError()  # clear it, or torch's next launch check on this thread raises it
        raise RuntimeError(f"cudaMemcpy2DAsync failed: {_runtime().cudaGetErrorString(rc).decode()}")
