"""posttrain's packed float32 GEMM for the engine's decode linears (ops/csrc/gemm_kernel.cpp): y = x·Wᵀ + b + r within
float32's summation bound of the exact value, every row the same whatever the batch around it, and the engine's
`_Linear` on it where `ops.linear.ENGINE_GEMM` says so."""

import os

import pytest
import torch

from posttrain.ops import cpu_kernels as K
from posttrain.ops import linear as L
from posttrain.rollout import runner

needs_kernel = pytest.mark.skipif(
    os.environ.get("POSTTRAIN_CPU_KERNELS") == "0" or K.load() is None or not K._module.gemm_kernel_available(),
    reason="the packed GEMM needs the CPU kernels on x86-64 with AVX2 and FMA")

EPS = 2.0**-24  # float32 unit roundoff


def _exact(x, w, b, r):
    out = x.double() @ w.double().t()
    out = out if b is None else out + b.double()
    return out if r is None else out + r.double()


def _bound(x, w, b, r):
    """A K-term float32 FMA chain, then + b, then + r: |error| <= (K + 2)·u·(Σ_k |x_k w_k| + |b| + |r|) (the
    standard bound for recursive summation; each FMA rounds once)."""
    mag = x.abs().double() @ w.abs().double().t()
    mag = mag if b is None else mag + b.abs().double()
    mag = mag if r is None else mag + r.abs().double()
    return (x.shape[1] + 2) * EPS * mag


# rows: 1, a partial tile (6 per tile), exact tiles, more than one chunk of 384 rows; columns: partial panels
# (16 or 32 per panel) and several; K odd, small and the model's
SHAPES = [(1, 5, 7), (7, 33, 64), (12, 16, 3), (13, 100, 576), (64, 960, 576), (31, 576, 1536), (400, 40, 20)]


@needs_kernel
@pytest.mark.parametrize("M,N,Kd", SHAPES)
@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True), (True, True)])
def test_packed_gemm_is_the_matmul(M, N, Kd, bias, residual):
    g = torch.Generator().manual_seed(M * 1000 + N + Kd)
    x, w = torch.randn(M, Kd, generator=g), torch.randn(N, Kd, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    r = torch.randn(M, N, generator=g) if residual else None
    y = K.gemm_packed(x, K.gemm_pack(w), N, b, r)
    assert y.shape == (M, N) and y.dtype == torch.float32
    err = (y.double() - _exact(x, w, b, r)).abs()
    assert (err <= _bound(x, w, b, r)).all(), err.max()


@needs_kernel
def test_every_row_is_the_same_whatever_the_batch_and_threads():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(50, 96, generator=g), torch.randn(70, 96, generator=g), torch.randn(70, generator=g)
    packed = K.gemm_pack(w)
    full = K.gemm_packed(x, packed, 70, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = K.gemm_packed(x, packed, 70, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one_thread)
    for rows in (slice(0, 1), slice(7, 8), slice(5, 19), slice(49, 50)):
        assert torch.equal(K.gemm_packed(x[rows], packed, 70, b), full[rows])


@needs_kernel
def test_bf16_weights_pack_as_their_float32_values():
    w = torch.randn(40, 24).bfloat16()
    assert torch.equal(K.gemm_pack(w), K.gemm_pack(w.float()))
    assert K.gemm_pack(w).shape == (-(-40 // K._module.gemm_panel_width()), 24, K._module.gemm_panel_width())


@needs_kernel
def test_repacking_into_the_previous_panels():
    w1, w2 = torch.randn(37, 20), torch.randn(37, 20)
    first = K.gemm_pack(w1)
    again = K.gemm_pack(w2, first)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, K.gemm_pack(w2))
    other = K.gemm_pack(torch.randn(37, 21), first)  # does not fit: fresh panels, the old ones untouched
    assert other.data_ptr() != first.data_ptr() and torch.equal(first, K.gemm_pack(w2))


@needs_kernel
def test_mismatched_operands_are_refused():
    packed = K.gemm_pack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="does not match"):
        K.gemm_packed(torch.randn(3, 9), packed, 20)
    with pytest.raises(RuntimeError, match="does not match"):
        K.gemm_packed(torch.randn(3, 8), packed, 200)
    with pytest.raises(RuntimeError, match="bias"):
        K.gemm_packed(torch.randn(3, 8), packed, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="residual"):
        K.gemm_packed(torch.randn(3, 8), packed, 20, None, torch.randn(3, 19))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_linear_runs_on_the_packed_gemm(monkeypatch, dtype):
    monkeypatch.setattr(runner, "ENGINE_GEMM", True)
    monkeypatch.setattr(runner, "WIDEN_PACKED_BF16", dtype == torch.bfloat16)
    torch.manual_seed(0)
    a, c = torch.nn.Linear(64, 48), torch.nn.Linear(64, 20, bias=False)
    lin = runner._Linear([a, c], pack=True, batch_hint=8, dtype=dtype)
    lin.refresh()
    assert lin.kind == "gemm"
    w = torch.cat([a.weight, c.weight]).detach().to(dtype)
    b = torch.cat([a.bias.detach(), torch.zeros(20)]).to(dtype).float()
    x, r = torch.randn(9, 64).to(dtype), torch.randn(9, 68).to(dtype)
    expect = K.gemm_packed(x.float(), K.gemm_pack(w), 68, b, r.float()).to(dtype)
    assert torch.equal(lin(x, residual=r), expect)
    with torch.no_grad():  # a weight change reaches the packed copy at the next refresh
        a.weight.mul_(2)
    lin.refresh()
    assert not torch.equal(lin(x, residual=r), expect)


def test_engine_linear_keeps_onednn_where_the_rule_says(monkeypatch):
    monkeypatch.setattr(runner, "ENGINE_GEMM", False)
    lin = runner._Linear([torch.nn.Linear(16, 8)], pack=True, batch_hint=4)
    lin.refresh()
    assert lin.kind in ("onednn", "wt")


@pytest.mark.parametrize("x86,avx512,expected", [(True, False, True), (True, True, False), (False, False, False)])
def test_the_engine_gemm_rule(monkeypatch, x86, avx512, expected):
    monkeypatch.setattr(L, "_x86", lambda: x86)
    monkeypatch.setattr(L, "_cpu_flag", lambda flag: avx512 and flag == "avx512f")
    assert L._prefer_engine_gemm("auto") == expected
    assert L._prefer_engine_gemm("posttrain") and not L._prefer_engine_gemm("onednn")
    with pytest.raises(ValueError, match="POSTTRAIN_ENGINE_GEMM"):
        L._prefer_engine_gemm("mkl")
