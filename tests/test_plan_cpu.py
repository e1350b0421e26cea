"""`hardware=cpu` (posttrain/plan/cpu.py): the peak is measured, then the planner's formula applies."""

import math
import time

import pytest
import torch

from posttrain.models.builtin import TINY_CONFIGS
from posttrain.plan import cpu, predict


def test_cpu_hardware_uses_the_measured_peak_in_the_compute_dtype():
    p = predict("smollm2-135m", "grpo", batch=4, group=8, seq_len=24, prompt_len=44, steps=40, hardware="cpu",
                compute_dtype="bf16", beta=0, reward="verifier")
    peak = cpu.measured_peak_flops("bf16")  # cached: the very number the prediction used
    assert p["hardware"]["peak_flops"] == peak > 0
    assert p["seconds_per_step"] == p["flops_per_step"] / (peak * p["hardware"]["mfu"])
    assert p["run"]["seconds"] == pytest.approx(40 * p["seconds_per_step"], rel=1e-12)
    assert p["hardware"]["device_memory"] == cpu.physical_memory()
    fp32 = predict("smollm2-135m", "sft", hardware="cpu", dtype="fp32")
    assert fp32["hardware"]["peak_flops"] == cpu.measured_peak_flops("fp32")


def test_a_recipe_plans_on_cpu_in_the_dtype_its_matmuls_run_in():
    model = torch.nn.Linear(2, 2)
    assert cpu.run_hardware(model, "float32") == {"hardware": "cpu", "compute_dtype": "fp32"}
    assert cpu.run_hardware(model, "float32", "bf16") == {"hardware": "cpu", "compute_dtype": "bf16"}
    assert cpu.run_hardware(model, "bfloat16") == {"hardware": "cpu", "compute_dtype": "bf16"}
    assert cpu.run_hardware(torch.nn.Module(), "float32") == {}


def _square_matmul_flops(n: int = 1024, reps: int = 5) -> float:
    """An estimate independent of plan/cpu.py (another shape): FLOP/s of an n³ fp32 matmul, best of `reps`."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


STEPS = {"sft": dict(batch=8, seq_len=128), "dpo": dict(batch=4, seq_len=128),
         "grpo": dict(batch=4, group=8, seq_len=24, prompt_len=44, beta=0, reward="verifier")}


@pytest.mark.parametrize("name", [*TINY_CONFIGS, "smollm2-135m"])
def test_cpu_seconds_per_step_are_finite_and_near_flops_over_a_measured_matmul(name):
    crude_peak = _square_matmul_flops()
    for method, keys in STEPS.items():
        p = predict(name, method, hardware="cpu", dtype="fp32", **keys)
        s = p["seconds_per_step"]
        assert math.isfinite(s) and s > 0, (method, s)
        # planner: FLOPs / (peak × MFU 0.4); crude: FLOPs / the square matmul's FLOP/s. Both peaks time an fp32 matmul
        # on the same threads, so s / crude = 2.5 × (crude peak / planner peak): within a decade of 2.5 unless one
        # of the timings is wrong by 10×.
        ratio = s / (p["flops_per_step"] / crude_peak)
        assert 0.25 < ratio < 25, (method, ratio)


@pytest.mark.slow  # a wall-clock comparison: how far tiny kernels fall below the matmul peak depends on the CPU and its load
def test_cpu_prediction_of_a_tiny_training_step_is_within_10x_of_the_step():
    # tiny-random, 8 × 128 tokens, fp32 forward + backward + AdamW: measured 0.060 s vs predicted 0.035 s on one
    # Zen 4 core (tiny kernels run below the matmul peak, so the planner is optimistic, not absurd).
    from posttrain.models.builtin import build_tiny

    model = build_tiny("tiny-random")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 1024, (8, 128))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        best = min(best, time.perf_counter() - t0)
    predicted = predict("tiny-random", "sft", batch=8, seq_len=128, hardware="cpu", dtype="fp32")["seconds_per_step"]
    assert 0.1 < best / predicted < 10, (best, predicted)


def test_the_peak_is_measured_even_when_the_time_budget_is_gone(monkeypatch):
    monkeypatch.setattr(cpu, "_PEAKS", {})  # measure afresh, not the cached number
    peak = cpu.measured_peak_flops("fp32", seconds=0.0)  # no time left: still timed runs, never 0 or inf
    assert math.isfinite(peak) and peak > 0
