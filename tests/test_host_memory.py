"""ops/host_memory.py: under posttrain's settings a freed large block is reused without page faults;
under glibc's steady state (what a benchmark's competitor runs under) it is mapped afresh at every use."""

import ctypes
import ctypes.util
import resource

import pytest

from posttrain.ops import host_memory

BLOCK = 64 << 20  # bytes: above glibc's largest mmap threshold (32 MiB)


def faults_of_reuse(libc) -> int:
    """Minor page faults of writing a BLOCK-byte malloc block twice more after a first one was freed."""
    def one() -> int:
        p = libc.malloc(BLOCK)
        assert p, "malloc failed"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ctypes.memset(p, 1, BLOCK)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        libc.free(p)
        return faults

    one()
    return one() + one()


def test_kept_blocks_are_reused_and_the_steady_state_maps_them_anew():
    if not host_memory.keep_freed_memory():
        pytest.skip("glibc's mallopt is not available here")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    try:
        kept = faults_of_reuse(libc)
        assert host_memory.glibc_steady_state(on=True)
        steady = faults_of_reuse(libc)
    finally:
        assert host_memory.glibc_steady_state(on=False)
    # two fresh mappings: 2 x 16384 faults with 4 KiB pages (2 x 32 with 2 MiB transparent huge pages)
    assert steady >= 64 and steady > 8 * kept, (kept, steady)
    assert faults_of_reuse(libc) <= max(kept, 8) * 2  # back to posttrain's settings
