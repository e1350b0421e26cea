"""The activation probe (training.memprobe): its byte accounting on steps whose allocations are known,
that it leaves the model as it found it, and that an RL run's plan uses what it measured."""

import json

import pytest
import torch

from posttrain.training.memprobe import activation_fit, pass_bytes, peak_allocated

MiB = 1 << 20


def test_peak_allocated_counts_live_bytes_not_the_sum():
    def fn():
        a = torch.empty(4 * MiB, dtype=torch.uint8)
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(1 * MiB, dtype=torch.uint8)  # fits in what a left: the peak stays 6 MiB
        del b, c

    peak = peak_allocated(fn)
    assert 6 * MiB <= peak < 6 * MiB + 64 * 1024


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.w


def test_fit_recovers_bytes_per_token_and_restores_grads():
    """step(n): x (n, 1000) fp32 and x·w are alive at once (4000 n bytes each), and in backward x and
    grad·x (for w's gradient) again: 8000 bytes per token, nothing that does not grow with n."""
    model = Scale()

    def make_step(n):
        def step():
            x = torch.ones(n, 1000)
            return model(x).sum()
        return n, step

    fit = activation_fit(model, make_step, sizes=(64, 256))
    assert fit["per_token"] == pytest.approx(8000, rel=0.02)
    assert fit["fixed"] < 16 * 1024
    assert model.w.grad is None and torch.equal(model.w.detach(), torch.ones(1))


def test_pass_bytes_does_not_count_the_gradient_the_planner_counts_as_state():
    """The 4 MiB .grad is allocated before the pass (model state); backward's one transient weight
    gradient (4 MiB, added into .grad and freed) is an activation-side peak and is counted."""
    model = torch.nn.Linear(1024, 1024, bias=False)
    counted = pass_bytes(model, lambda: model(torch.ones(1, 1024)).sum())
    assert 4 * MiB <= counted < 4 * MiB + 256 * 1024
    assert model.weight.grad is None


def test_rl_plan_uses_the_measured_activations(tmp_path):
    from conftest import run_rl
    from test_rl_recipe import space_share  # noqa: F401  (registers the test reward run_rl uses)

    _, out = run_rl(tmp_path, "max_steps=1", "lora.enabled=true")
    pred = json.loads((out / "plan.json").read_text())["predicted"]
    assert pred["activation_source"] == "measured"
    assert pred["activation_bytes"] > 0


def test_sft_plan_uses_the_measured_activations(tmp_path):
    from posttrain import cli

    out = tmp_path / "sft"
    assert cli.main(["sft", "model=tiny-random", "data=arithmetic:20", "max_steps=1", "batch_size=2", "max_length=64",
                     f"output_dir={out}", "progress=false"]) == 0
    pred = json.loads((out / "plan.json").read_text())["predicted"]
    assert pred["activation_source"] == "measured" and pred["activation_bytes"] > 0


def test_small_probe_passes_hold_what_a_full_size_bf16_route_step_holds(monkeypatch):
    """Where bf16 matmuls run as fp32 GEMMs (ops.linear) only from MIN_ROWS rows on, the probe's small passes
    take that route too, so the fit predicts a full-size step (its saved float32 weight widening included)."""
    from posttrain.ops import linear as L

    monkeypatch.setattr(L, "BF16_VIA_FP32", True)
    w = torch.nn.Parameter(torch.randn(1024, 512))

    def make_step(n):
        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return L.linear(torch.randn(n, 512, requires_grad=True), w).float().sum()
        return n, step

    model = torch.nn.ParameterList([w])
    fit = activation_fit(model, make_step, sizes=(64, 192))
    assert fit is not None
    big = make_step(4 * L.MIN_ROWS)
    measured = pass_bytes(model, big[1])
    assert fit["fixed"] + fit["per_token"] * big[0] == pytest.approx(measured, rel=0.05)
