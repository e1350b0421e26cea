"""ops/host_memory.py: under posttrain's settings a freed large block is reused without page faults;
under glibc's steady state (what a benchmark's competitor runs under) it is mapped afresh at every use.
Run in a fresh interpreter: a long test process's heap has free blocks that would serve any request."""

import subprocess
import sys

SCRIPT = r"""
import ctypes, ctypes.util, resource, sys
from posttrain.ops import host_memory
if not host_memory.keep_freed_memory():
    print("skip"); sys.exit(0)
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
BLOCK = 64 << 20  # above glibc's largest mmap threshold (32 MiB)
def one():
    p = libc.malloc(BLOCK)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ctypes.memset(p, 1, BLOCK)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(p)
    return faults
one()
kept = one() + one()
assert host_memory.glibc_steady_state(on=True)
host_memory.release_freed_memory()  # start from an empty heap, as a competitor's own process would
steady = one() + one()
assert host_memory.glibc_steady_state(on=False)
one()
back = one() + one()
print(kept, steady, back)
"""


def test_kept_blocks_are_reused_and_the_steady_state_maps_them_anew():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    if out == ["skip"]:
        import pytest

        pytest.skip("glibc's mallopt is not available here")
    kept, steady, back = map(int, out)
    # two fresh mappings: 2 x 16384 faults with 4 KiB pages (2 x 32 with 2 MiB transparent huge pages)
    assert steady >= 64 and steady > 8 * kept, (kept, steady)
    assert back <= max(kept, 8) * 2, (kept, back)  # back to posttrain's settings


HUGE = r"""
import resource, sys
import posttrain  # before torch: sets THP_MEM_ALLOC_ENABLE unless the environment has it
import torch
from posttrain.ops import host_memory
torch.ones(1 << 20)  # warm up torch's first allocations
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 << 20)  # a fresh 64 MiB block, written once
print(int(host_memory.huge_pages()), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _fresh(script: str, **env) -> list[str]:
    import os

    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=environ).stdout.split()


def test_huge_pages_fault_a_large_tensor_in_far_fewer_pieces():
    on, faults_huge = map(int, _fresh(HUGE))
    off, faults_plain = map(int, _fresh(HUGE, THP_MEM_ALLOC_ENABLE="0"))
    assert off == 0
    if not on:
        import pytest

        pytest.skip("the kernel's transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/enabled)")
    # 64 MiB in 4 KiB pages: 16384 faults; in 2 MiB pages: 32 (plus the block's unaligned ends in 4 KiB pages)
    assert faults_plain >= 16384 // 2, faults_plain
    assert faults_huge * 8 < faults_plain, (faults_huge, faults_plain)


def test_huge_pages_are_reported_off_when_torch_came_first():
    on, _ = map(int, _fresh("import torch\n" + HUGE))
    assert on == 0
