"""The CPU kernels compile for every x86 level they have code paths for, not only this machine's.

The extension is built with -march=native, so a build error in a path this CPU does not take stays invisible
here and breaks every other machine: session 27's bf16 GEMM instantiated its bf16 micro-kernel on every CPU
while the instruction it needs exists only with AVX-512 BF16, so the whole extension (norms, RoPE, attention,
sampler, GEMM) failed to build on AVX2 and plain AVX-512 CPUs. Each source is checked here with -fsyntax-only
(templates instantiated, no code generated) for x86-64-v3 (AVX2 + FMA) and x86-64-v4 (AVX-512 without BF16);
the native build is what `cpu_kernels.load()` compiles anyway."""

import platform
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.ops import cpu_kernels

LEVELS = ("x86-64-v3", "x86-64-v4")

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None,
                                reason="x86-64 with a C++ compiler only")


def _check(source, march: str) -> tuple[str, str, int, str]:
    from torch.utils.cpp_extension import include_paths

    includes = [arg for path in [*include_paths(), sysconfig.get_paths()["include"]] for arg in ("-isystem", path)]
    cmd = ["c++", "-fsyntax-only", "-std=c++20", f"-march={march}", "-fopenmp", "-DTORCH_EXTENSION_NAME=isa_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", *includes, str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return source.name, march, done.returncode, done.stderr[-2000:]


def test_every_kernel_source_compiles_for_avx2_and_plain_avx512():
    sources = sorted(cpu_kernels._SOURCE.parent.glob("*.cpp"))
    assert len(sources) >= 5
    jobs = [(s, march) for march in LEVELS for s in sources]
    with ThreadPoolExecutor(max_workers=2) as pool:  # ~15 s per file (torch's headers): ~75 s on 2 cores
        results = list(pool.map(lambda job: _check(*job), jobs))
    failed = [f"{name} for {march}:\n{err}" for name, march, rc, err in results if rc != 0]
    assert not failed, "\n\n".join(failed)
