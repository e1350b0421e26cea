"""`hardware=cpu`: this machine's CPU, measured rather than named. Its peak is the FLOP/s of a matmul the
size of a small model's projections ((2048 × 576) · (576 × 1536), SmolLM2-135M's MLP), in the dtype the
run computes in, with the threads torch uses; measured once per process and dtype (~0.1 s). Memory is the
physical RAM. The time model is the planner's: FLOPs / (peak × MFU)."""

from __future__ import annotations

import os
import time

_PEAKS: dict[tuple[str, int], float] = {}
SHAPE = (2048, 576, 1536)


def measured_peak_flops(dtype: str = "fp32", seconds: float = 0.1) -> float:
    """FLOP/s of a (m × k)·(k × n) matmul in `dtype` (bf16 | fp16 | fp32), best of the timed repetitions."""
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    key = (str(torch_dtype), torch.get_num_threads())
    if key not in _PEAKS:
        m, k, n = SHAPE
        g = torch.Generator().manual_seed(0)
        a = torch.randn(m, k, generator=g).to(torch_dtype)
        b = torch.randn(k, n, generator=g).to(torch_dtype)
        a @ b  # warm-up: kernel selection, first-touch of the output
        best, end, reps = float("inf"), time.perf_counter() + seconds, 0
        while reps < 3 or time.perf_counter() < end:  # at least 3 timed runs, even when descheduled past `end`
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
            reps += 1
        _PEAKS[key] = 2 * m * k * n / max(best, 1e-9)
    return _PEAKS[key]


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
