"""Keep freed host memory in the process instead of handing it back to the OS every time.

PyTorch's CPU allocator is plain malloc. glibc serves blocks above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) with a fresh mmap and unmaps them on free, and it trims the top of the heap
once more than a threshold is free. A decode step allocates tensors of 0.4-13 MB (activations, the
(batch, vocab) logits and their float32 copies) and frees them again, so every step faults in
thousands of fresh zeroed pages: on the 2-core CI machine sampling from (64, 49152) logits took
13.7 ms with the defaults and 3.4 ms with the thresholds below (benchmarks/engine_vs_hf.py measures
the effect on a whole run).

`keep_freed_memory()` raises both thresholds once per process (mallopt), so freed blocks are reused
from the heap. The price: the process keeps its peak heap instead of returning it to the OS, as
PyTorch's CUDA caching allocator does on GPU. It is process-wide; it does nothing off glibc (macOS,
musl) or when POSTTRAIN_KEEP_FREED_MEMORY=0. The engine calls it only when its model is on the CPU
(CUDA tensors never come from malloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of free heap top instead of trimming it
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the malloc thresholds once; True if they are in effect."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("POSTTRAIN_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc malloc_trim): after a one-off burst of
    allocations (a memory probe) that the run's own steps would not reuse in the same shapes."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
