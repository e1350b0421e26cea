"""Keep freed host memory in the process instead of handing it back to the OS every time.

PyTorch's CPU allocator is plain malloc. glibc serves blocks above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB, its largest allowed value) with a fresh mmap and unmaps them on free, and it
trims the top of the heap once more than a threshold is free. Every such block is faulted in anew,
page by page, at each use: a decode step allocates tensors of 0.4-13 MB (activations, the (batch, vocab)
logits and their float32 copies), a training step on SmolLM2 several of ~100 MB (the (tokens, vocab)
softmax of the head, the tied embedding's gradient). Measured on the 2-core CI machine: sampling from
(64, 49152) logits 13.7 ms with the defaults, 3.4 ms with the mmap threshold raised
(benchmarks/engine_vs_hf.py); a fresh 96 MB subtraction 31 ms with mmap, 6.5 ms from the heap; the
GRPO benchmark's update ~12% faster with mmap off (benchmarks/grpo_vs_trl.py).

`keep_freed_memory()` sets, once per process (mallopt): the mmap threshold to its maximum, mmap off for
the main heap (M_MMAP_MAX = 0: every block comes from the heap, so a freed 100 MB block is reused
instead of unmapped; glibc still maps memory where the heap cannot grow, and for threads' arenas), and
the trim threshold to 1 GiB. The price: the process keeps its peak heap instead of returning it to the
OS, as PyTorch's CUDA caching allocator does on GPU. It is process-wide; it does nothing off glibc
(macOS, musl) or when POSTTRAIN_KEEP_FREED_MEMORY=0. Called when a model is loaded on the CPU
(`models.loading.load_model`) and by the engine when its model is on the CPU (CUDA tensors never come
from malloc).
Huge pages. Even a block the heap keeps is often fresh memory: PyTorch asks for 64-byte aligned blocks
(posix_memalign), and glibc (2.36) serves a repeat request of the same size from a new stretch of heap
rather than the freed aligned chunk, so each ~100 MB temporary of a step faults in anew, 4 KiB at a time
(~25,000 faults). With THP_MEM_ALLOC_ENABLE=1 PyTorch advises transparent huge pages (madvise
MADV_HUGEPAGE) for every CPU block of 2 MiB or more: the same block then faults in 2 MiB at a time (512x
fewer faults; 64 MB fresh tensor: ~16,400 -> ~550 faults). Measured on the 2-core CI machine (Intel), SFT
fp32 in fresh processes alternating: +3-5%, inside the host's noise. PyTorch reads the variable
once, at its first CPU allocation, so `import posttrain` sets it (unless it is set already) and it has
effect only when posttrain is imported before torch: the `posttrain` command always is; a script that
imports torch first can set THP_MEM_ALLOC_ENABLE=1 in its environment. It needs the kernel's THP in
`always` or `madvise` mode (/sys/kernel/mm/transparent_hugepage/enabled; `huge_pages()` tells).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc malloc.h
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
    libc = _libc()
    if libc is None:
        return False
    _done = _set(libc, KEEP)
    return _done


KEEP = {_M_MMAP_THRESHOLD: MMAP_THRESHOLD, _M_TRIM_THRESHOLD: TRIM_THRESHOLD, _M_MMAP_MAX: 0}
# glibc's defaults once its dynamic threshold has seen a freed block of 32 MiB or more (what a training
# step's temporaries do at once): blocks up to 32 MiB from the heap, larger ones mmap'd and unmapped on
# free, the heap top trimmed beyond twice the threshold
GLIBC_STEADY = {_M_MMAP_THRESHOLD: MMAP_THRESHOLD, _M_TRIM_THRESHOLD: 2 * MMAP_THRESHOLD, _M_MMAP_MAX: 65536}


def _libc():
    """glibc with mallopt's signature set, or None off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def _set(libc, values: dict) -> bool:
    return all(bool(libc.mallopt(k, v)) for k, v in values.items())


def glibc_steady_state(on: bool) -> bool:
    """Switch this process to glibc's steady-state defaults (`GLIBC_STEADY`; on=True) or back to
    `keep_freed_memory`'s settings (on=False), only if those were applied. For benchmarks: a competitor
    runs with the allocator its users get, in the same process; nothing is trimmed at a switch (in its own
    process the competitor's heap would keep what glibc keeps). True if the switch took effect."""
    return bool(_done) and _set(_libc(), GLIBC_STEADY if on else KEEP)


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc malloc_trim): after a one-off burst of
    allocations (a memory probe) that the run's own steps would not reuse in the same shapes."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


def huge_pages() -> bool:
    """Whether PyTorch's large CPU blocks get transparent huge pages in this process: THP_MEM_ALLOC_ENABLE=1
    before torch's first allocation (from the environment, or set by `import posttrain` ahead of torch) and
    a kernel THP mode that honours madvise."""
    import posttrain

    if os.environ.get("THP_MEM_ALLOC_ENABLE") != "1" or not sys.platform.startswith("linux"):
        return False
    if posttrain.THP_SET_TOO_LATE:
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode
