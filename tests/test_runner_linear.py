"""The engine's packed linears (rollout.runner._Linear) on a CPU without bf16 dot-product instructions: the bf16
copy is kept widened to fp32 and multiplied by fp32 GEMMs, one rounding to bf16 per result, which is the bf16
matmul again up to the summation order (products of bf16 numbers are exact in fp32)."""

import pytest
import torch

from posttrain.rollout import runner


def _bound(x, W, bias, extra=0.0):
    """|y - exact| <= one bf16 rounding of the result (2^-8 relative) + fp32 summation over K terms (K * 2^-24 of
    the sum of |terms|) + a bf16 residual's own size 0 (it is exact)."""
    mag = x.abs() @ W.abs().t() + bias.abs() + extra
    return mag * 2**-8 + mag * x.shape[1] * 2**-24


@pytest.mark.parametrize("native", [False, True])
def test_packed_bf16_linear_is_the_bf16_matmul(monkeypatch, native):
    monkeypatch.setattr(runner, "WIDEN_PACKED_BF16", not native)
    monkeypatch.setattr(runner, "WIDEN_MIN_ROWS", 1)  # at any decode batch
    torch.manual_seed(0)
    a, b = torch.nn.Linear(64, 48), torch.nn.Linear(64, 32, bias=False)
    lin = runner._Linear([a, b], pack=True, batch_hint=8, dtype=torch.bfloat16)
    lin.refresh()
    assert lin.widen == (not native)
    x, r = torch.randn(8, 64).bfloat16(), torch.randn(8, 80).bfloat16()
    W = torch.cat([a.weight, b.weight]).detach().bfloat16().double()
    bias = torch.cat([a.bias.detach().bfloat16(), torch.zeros(32, dtype=torch.bfloat16)]).double()
    exact = x.double() @ W.t() + bias
    y, yr = lin(x), lin(x, residual=r)
    assert y.dtype == yr.dtype == torch.bfloat16 and y.shape == (8, 80)
    assert ((y.double() - exact).abs() <= _bound(x.double(), W, bias)).all()
    # with the residual: at most two roundings (the matmul's, then the add's; fused: one)
    err = (yr.double() - exact - r.double()).abs()
    assert (err <= 2 * _bound(x.double(), W, bias, r.double().abs())).all()


def test_widened_copy_follows_a_weight_change(monkeypatch):
    monkeypatch.setattr(runner, "WIDEN_PACKED_BF16", True)
    monkeypatch.setattr(runner, "WIDEN_MIN_ROWS", 1)  # at any decode batch
    lin_mod = torch.nn.Linear(16, 8, bias=False)
    lin = runner._Linear([lin_mod], pack=True, batch_hint=4, dtype=torch.bfloat16)
    lin.refresh()
    x = torch.randn(4, 16).bfloat16()
    before = lin(x)
    with torch.no_grad():
        lin_mod.weight.mul_(2)
    lin.refresh()
    assert torch.equal(lin(x), (before.float() * 2).bfloat16())  # x 2 is exact in every format


@pytest.mark.parametrize("hint,min_rows,widened", [(4, 24, False), (23, 24, False), (24, 24, True), (64, 24, True), (4, 1, True)])
def test_widening_waits_for_a_decode_batch_of_min_rows(monkeypatch, hint, min_rows, widened):
    """Where bf16 is native but slower than the fp32 kernel, an engine decoding fewer than WIDEN_MIN_ROWS rows at a
    time keeps bf16 (the doubled bytes of a widened copy cost more than its faster arithmetic saves there)."""
    monkeypatch.setattr(runner, "WIDEN_PACKED_BF16", True)
    monkeypatch.setattr(runner, "WIDEN_MIN_ROWS", min_rows)
    lin = runner._Linear([torch.nn.Linear(16, 8)], pack=True, batch_hint=hint, dtype=torch.bfloat16)
    lin.refresh()
    assert lin.widen == widened
    x = torch.randn(3, 16).bfloat16()
    assert lin(x).dtype == torch.bfloat16 and lin(x).shape == (3, 8)
