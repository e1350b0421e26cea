"""`hardware=cpu` (posttrain/plan/cpu.py): the peak is measured, then the planner's formula applies."""

import pytest
import torch

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
