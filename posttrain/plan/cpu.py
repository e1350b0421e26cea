"""`hardware=cpu`: this machine's CPU, measured rather than named. Two rates, each the best of several
short trials timed on the process's CPU clock (a thread another process deschedules stops it), cached per
machine in the user cache dir so that one busy moment does not decide a plan:

    peak_flops[dtype]   FLOP/s of a (2048 × 576)·(576 × 1536) matmul (SmolLM2-135M's MLP) in bf16 or fp32,
                        through the kernel training uses (ops/linear.py), with the threads torch uses (or
                        one thread × threads, whichever is faster): the compute-bound rate (training, prefill)
    bandwidth           bytes/s of a 64 MiB fp32 copy (read 64 + write 64 MiB, more than a CPU's last-level
                        cache): the memory-bound rate (decode reads every weight and the KV once per token)

Cache: `$POSTTRAIN_CACHE_DIR` (else `$XDG_CACHE_HOME/posttrain`, else `~/.cache/posttrain`)/cpu_rates.json,
one entry per rate and dtype with the CPU model, cores, torch threads and the time it was measured. An entry
of another CPU or core count, or older than `MAX_AGE_S`, is measured afresh; a fresh entry is still
re-checked with a few trials in every new process and raised when the machine is faster now (best kept:
a start-up on a busy machine lowers no cached rate). Memory is the physical RAM."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

SHAPE = (2048, 576, 1536)
COPY_BYTES = 64 * 2**20
MAX_AGE_S = 7 * 86400
TRIALS, RECHECK_TRIALS = 7, 2
_RATES: dict[tuple, dict] = {}  # this process: (kind, dtype, threads) -> entry


def cache_path() -> Path:
    root = os.environ.get("POSTTRAIN_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posttrain")
    return Path(root) / "cpu_rates.json"


def machine() -> dict:
    """What a cached rate belongs to: the CPU model, the cores this process may use, torch's threads."""
    import torch

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": name, "cores": cores, "threads": torch.get_num_threads()}


def best_of(trial: Callable[[], float], trials: int, threads: int = 1, pause: float = 0.005) -> float:
    """The shortest time of `trials` calls (≥ 1), each the CPU time of the process over its `threads` threads
    (at most the wall time), a short pause between calls. A thread descheduled by another process stops its
    CPU clock but not the wall clock: for work split evenly over every thread, CPU / threads is the time the
    call takes on an idle machine, so a loaded machine does not make the rate look low."""
    best = float("inf")
    for i in range(max(trials, 1)):
        if i:
            time.sleep(pause)
        w0, c0 = time.perf_counter(), time.process_time()
        trial()
        wall, cpu_s = time.perf_counter() - w0, time.process_time() - c0
        best = min(best, wall, cpu_s / max(threads, 1))
    return max(best, 1e-9)


def _torch_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
            "float16": torch.float16}.get(dtype, torch.float32)


def one_thread_time(trial: Callable[[], float], trials: int) -> float:
    """The shortest CPU time of `trials` calls on one torch thread (its own clock: time.thread_time)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for _ in range(max(trials, 1)):
            t0 = time.thread_time()
            trial()
            best = min(best, time.thread_time() - t0)
        return max(best, 1e-9)
    finally:
        torch.set_num_threads(threads)


def matmul_rate(dtype: str = "fp32", trials: int = TRIALS, kernel: Callable | None = None) -> float:
    """FLOP/s of the (m × k)·(k × n) matmul in `dtype`: 2·m·k·n / time, the larger of two estimates: all
    threads on the process's CPU clock, and one thread on its own clock × threads (a matmul this size splits
    evenly; on a loaded machine the first counts other threads' spinning, the second none). `kernel`: another
    matmul (a, b) -> a·b to time, e.g. torch.matmul (the BLAS)."""
    import torch

    from posttrain.ops import linear

    matmul = kernel or linear.matmul  # default: the kernel training runs (fp32: oneDNN or MKL by CPU, ops/linear.py)
    m, k, n = SHAPE
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(_torch_dtype(dtype))
    b = torch.randn(k, n, generator=g).to(_torch_dtype(dtype))
    matmul(a, b)  # warm-up: kernel selection, first touch of the output
    threads = torch.get_num_threads()
    flops = 2 * m * k * n
    return max(flops / best_of(lambda: matmul(a, b), trials, threads),
               flops * threads / one_thread_time(lambda: matmul(a, b), trials))


def copy_rate(trials: int = TRIALS) -> float:
    """Bytes/s of copying COPY_BYTES of fp32: (read + write) / time, the larger of all threads and one thread
    (bandwidth does not grow with threads the way FLOPs do: one thread's rate is a floor, not a share)."""
    import torch

    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst
    moved = 2 * COPY_BYTES
    return max(moved / best_of(lambda: dst.copy_(src), trials, torch.get_num_threads()),
               moved / one_thread_time(lambda: dst.copy_(src), trials))


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, entry: dict) -> None:
    """Merge one entry into the cache file (atomic replace); a read-only home only loses the cache."""
    try:
        data = _read_cache(path)
        data[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def stale(entry: dict | None, here: dict, now: float, max_age: float = MAX_AGE_S) -> str | None:
    """Why a cached entry cannot be used (None: it can): missing, another CPU or core count, or too old."""
    if not entry or not isinstance(entry.get("value"), (int, float)) or entry["value"] <= 0:
        return "not measured yet"
    for field in ("cpu", "cores", "threads"):
        if entry.get(field) != here[field]:
            return f"{field} changed ({entry.get(field)!r} -> {here[field]!r})"
    age = now - float(entry.get("measured_at", 0))
    if not 0 <= age <= max_age:
        return f"measured {age / 86400:.1f} days ago"
    return None


def cached_rate(kind: str, dtype: str, measure: Callable[[int], float], now: float | None = None) -> dict:
    """The entry {value, cpu, cores, threads, measured_at, trials, source} of rate `kind` in `dtype`:
    this process's, else the cache's re-checked (the best of both kept), else measured and cached."""
    here = machine()
    memo = (kind, dtype, here["threads"])
    if memo in _RATES:
        return _RATES[memo]
    now = time.time() if now is None else now
    path, key = cache_path(), f"{kind}:{dtype}"
    entry = _read_cache(path).get(key)
    why = stale(entry, here, now)
    if why is None:  # fresh: a few trials in this process may only raise it
        value = measure(RECHECK_TRIALS)
        if value > entry["value"]:
            entry = {**entry, "value": value, "raised_at": now}
            _write_cache(path, key, entry)
        entry = {**entry, "source": "cache"}
    else:
        entry = {**here, "value": measure(TRIALS), "measured_at": now, "trials": TRIALS, "load": _load()}
        _write_cache(path, key, entry)
        entry = {**entry, "source": f"measured ({why})"}
    _RATES[memo] = entry
    return entry


def _load() -> float | None:
    """The 1-minute load average (what else ran while a rate was measured), None where unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def measured_peak_flops(dtype: str = "fp32") -> float:
    """FLOP/s of the matmul in `dtype` (bf16 | fp16 | fp32): cached, best kept (see the module docstring)."""
    name = "bf16" if dtype in ("bf16", "bfloat16") else "fp16" if dtype in ("fp16", "float16") else "fp32"
    return cached_rate("matmul", name, lambda trials: matmul_rate(name, trials))["value"]


def measured_bandwidth() -> float:
    """Memory bytes/s of the copy benchmark: cached, best kept."""
    return cached_rate("copy", "bytes", copy_rate)["value"]


def rate_entries() -> dict[str, dict]:
    """The rates this process has used, by `kind:dtype` (plan.json's hardware.rates)."""
    return {f"{kind}:{dtype}": entry for (kind, dtype, _), entry in _RATES.items()}


def physical_memory() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def run_hardware(model, dtype: str, mixed_precision: str = "none") -> dict:
    """The planner keys of a recipe's own run: on the CPU, hardware=cpu measured in the dtype its matmuls
    run in (bf16 under bf16 weights or bf16 mixed precision); nothing on a GPU (no named profile to pick)."""
    p = next(iter(model.parameters()), None)
    if p is None or p.device.type != "cpu":
        return {}
    bf16 = mixed_precision == "bf16" or dtype in ("bfloat16", "bf16")
    return {"hardware": "cpu", "compute_dtype": "bf16" if bf16 else "fp32"}
