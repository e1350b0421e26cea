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


# rows: 1, tiles of fewer rows (up to 6 per tile, a chunk's rows spread evenly over its tiles), exact tiles, more than one chunk of 384 rows; columns: partial panels
# (16 or 32 per panel) and several; K odd, small and the model's
SHAPES = [(1, 5, 7), (7, 33, 64), (12, 16, 3), (13, 100, 576), (25, 48, 100), (64, 960, 576), (31, 576, 1536), (400, 40, 20)]


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
@pytest.mark.parametrize("M,N,Kd", SHAPES + [(770, 37, 45), (9, 8, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_views_give_the_contiguous_calls_values(M, N, Kd, bias):
    """Training's ∂x = ∂y·W and ∂W = ∂yᵀ·x: W packed from its transposed view (rows of Wᵀ copied) and x given as
    the transposed view of a contiguous (K, M) tensor (transposed into a buffer a chunk of rows at a time, across
    the 384-row chunks at M = 770) give the contiguous operands' values bit for bit: the same FMA chains."""
    g = torch.Generator().manual_seed(M * 31 + N + Kd)
    xt, wt = torch.randn(Kd, M, generator=g), torch.randn(Kd, N, generator=g)  # x = xtᵀ, W = wtᵀ: strided views
    b = torch.randn(N, generator=g) if bias else None
    packed = K.gemm_pack(wt.t())
    assert torch.equal(packed, K.gemm_pack(wt.t().contiguous()))
    y = K.gemm_packed(xt.t(), packed, N, b)
    assert torch.equal(y, K.gemm_packed(xt.t().contiguous(), packed, N, b))
    x, w = xt.t(), wt.t()
    assert (((y.double() - _exact(x, w, b, None)).abs()) <= _bound(x, w, b, None)).all()


@needs_kernel
@pytest.mark.parametrize("M,N,Kd", SHAPES)
def test_rows_with_a_stride_are_read_in_place_with_the_contiguous_values(M, N, Kd):
    """x as a slice of columns of a wider tensor (row stride > K: the LM head's ∂x by k slices) gives the contiguous
    copy's values bit for bit, with a bias and a residual too (the same FMA chains)."""
    g = torch.Generator().manual_seed(M * 13 + N + Kd)
    wide = torch.randn(M, Kd + 11, generator=g)
    x, w = wide[:, 5 : 5 + Kd], torch.randn(N, Kd, generator=g)
    b, r = torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    packed = K.gemm_pack(w)
    assert x.stride() == (Kd + 11, 1)
    assert torch.equal(K.gemm_packed(x, packed, N), K.gemm_packed(x.contiguous(), packed, N))
    assert torch.equal(K.gemm_packed(x, packed, N, b, r), K.gemm_packed(x.contiguous(), packed, N, b, r))
    assert torch.equal(K.gemm_once(x, w, b), K.gemm_packed(x.contiguous(), packed, N, b))


@needs_kernel
@pytest.mark.parametrize("M,N,Kd", SHAPES)
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
def test_bf16_x_over_float32_panels_rounds_the_float32_result_once(M, N, Kd, bias, residual):
    """The widened-bf16 path (AVX2 CPUs): bf16 x and residual over float32 panels of bf16 weights give the float32
    call on their widened values rounded once to bf16 (nearest even), bit for bit."""
    g = torch.Generator().manual_seed(M * 7 + N + Kd)
    x, w = torch.randn(M, Kd, generator=g).bfloat16(), torch.randn(N, Kd, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16().float() if bias else None
    r = torch.randn(M, N, generator=g).bfloat16() if residual else None
    packed = K.gemm_pack(w)
    y = K.gemm_packed(x, packed, N, b, r)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert torch.equal(y, K.gemm_packed(x.float(), packed, N, b, None if r is None else r.float()).bfloat16())


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


needs_bf16_kernel = pytest.mark.skipif(
    os.environ.get("POSTTRAIN_CPU_KERNELS") == "0" or K.load() is None or not K._module.gemm_bf16_kernel_available(),
    reason="the bf16 packed GEMM needs the CPU kernels on x86-64 with AVX-512 BF16")
BF16_EPS = 2.0**-8  # bf16 unit roundoff (8 significant bits, round to nearest)


def _bf16_case(M, N, Kd, bias, residual, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, Kd, generator=g).bfloat16(), torch.randn(N, Kd, generator=g).bfloat16()
    b = torch.randn(N, generator=g) if bias else None  # the engine's bias: float32
    r = torch.randn(M, N, generator=g).bfloat16() if residual else None
    return x, w, b, r


@needs_bf16_kernel
@pytest.mark.parametrize("M,N,Kd", [(1, 5, 8), (7, 33, 64), (12, 16, 2), (13, 100, 576), (64, 960, 576),
                                    (31, 576, 1536), (400, 40, 20)])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
def test_bf16_packed_gemm_is_the_matmul(M, N, Kd, bias, residual):
    """bf16 x and panels (vdpbf16ps): products of bf16 values are exact in float32, so before the final rounding
    the float32 bound holds (≤ K + 2 rounded additions); the bf16 output adds one rounding of the result."""
    x, w, b, r = _bf16_case(M, N, Kd, bias, residual, M * 1000 + N + Kd)
    y = K.gemm_packed(x, K.gemm_pack_bf16(w), N, b, r)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    exact, f32 = _exact(x, w, b, r), _bound(x, w, b, r)
    err = (y.double() - exact).abs()
    assert (err <= f32 + BF16_EPS * (exact.abs() + f32)).all(), err.max()


@needs_bf16_kernel
def test_bf16_rows_are_the_same_whatever_the_batch_and_threads():
    x, w, b, r = _bf16_case(50, 70, 96, True, True, 2)
    packed = K.gemm_pack_bf16(w)
    full = K.gemm_packed(x, packed, 70, b, r)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = K.gemm_packed(x, packed, 70, b, r)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one_thread)
    for rows in (slice(0, 1), slice(7, 8), slice(5, 19), slice(49, 50)):
        assert torch.equal(K.gemm_packed(x[rows], packed, 70, b, r[rows]), full[rows])


@needs_bf16_kernel
def test_bf16_panels_hold_the_weight_in_pairs_and_repack_in_place():
    w = torch.randn(40, 24).bfloat16()
    packed = K.gemm_pack_bf16(w)
    nr = K._module.gemm_panel_width()
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-40 // nr), 12, nr, 2)
    # panel p, pair j, column c, t  ==  W[p·NR + c][2j + t] (zero past N)
    padded = torch.cat([w, w.new_zeros(packed.shape[0] * nr - 40, 24)])
    expect = padded.view(packed.shape[0], nr, 12, 2).permute(0, 2, 1, 3)
    assert torch.equal(packed, expect)
    w2 = torch.randn(40, 24).bfloat16()
    again = K.gemm_pack_bf16(w2, packed)
    assert again.data_ptr() == packed.data_ptr() and torch.equal(again, K.gemm_pack_bf16(w2))
    assert not K.gemm_bf16_runs(torch.randn(40, 23).bfloat16()) and not K.gemm_bf16_runs(w.float())
    with pytest.raises(RuntimeError, match="even number of columns"):
        K.gemm_pack_bf16(torch.randn(40, 23).bfloat16())
    with pytest.raises(RuntimeError, match="bf16 over gemm_pack_bf16's"):
        K.gemm_packed(torch.randn(3, 24), packed, 40)


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
    monkeypatch.setattr(runner, "WIDEN_MIN_ROWS", 1)  # at any decode batch
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


@needs_bf16_kernel
def test_engine_bf16_linear_runs_on_the_bf16_panels(monkeypatch):
    monkeypatch.setattr(runner, "ENGINE_GEMM_BF16", True)
    monkeypatch.setattr(runner, "WIDEN_PACKED_BF16", False)
    torch.manual_seed(0)
    a, c = torch.nn.Linear(64, 48), torch.nn.Linear(64, 20, bias=False)
    lin = runner._Linear([a, c], pack=True, batch_hint=8, dtype=torch.bfloat16)
    lin.refresh()
    assert lin.kind == "gemm" and lin.w.dtype == torch.bfloat16
    w = torch.cat([a.weight, c.weight]).detach().bfloat16()
    b = torch.cat([a.bias.detach(), torch.zeros(20)]).bfloat16().float()
    x, r = torch.randn(9, 64).bfloat16(), torch.randn(9, 68).bfloat16()
    expect = K.gemm_packed(x, K.gemm_pack_bf16(w), 68, b, r)
    assert torch.equal(lin(x, residual=r), expect)
    first = lin.w.data_ptr()
    with torch.no_grad():  # a weight change reaches the packed copy at the next refresh, re-packed in place
        a.weight.mul_(2)
    lin.refresh()
    assert lin.w.data_ptr() == first and not torch.equal(lin(x, residual=r), expect)


@needs_bf16_kernel
@pytest.mark.parametrize("M,I,Kd,bias", [(64, 1536, 576, False), (7, 96, 64, True), (1, 160, 128, False),
                                         (13, 80, 32, True), (400, 64, 20, False)])
def test_swiglu_epilogue_is_silu_mul_of_the_product(M, I, Kd, bias):
    """gemm_packed(glu=True) on panels of glu_rows([gate; up]) returns silu(gate) * up bit for bit as the plain
    GEMM then `silu_mul` compute it (incl. a row tail past the last 64-column vector step: I = 80, 160)."""
    g = torch.Generator().manual_seed(M + I)
    w, x = (torch.randn(2 * I, Kd, generator=g) * 0.2).bfloat16(), torch.randn(M, Kd, generator=g).bfloat16()
    b = torch.randn(2 * I, generator=g) if bias else None
    gu = K.gemm_packed(x, K.gemm_pack_bf16(w), 2 * I, b)
    expect = K.silu_mul(gu[:, :I], gu[:, I:])
    packed = K.gemm_pack_bf16(K.glu_rows(w))
    h = K.gemm_packed(x, packed, 2 * I, None if b is None else K.glu_rows(b), None, True)
    assert h.shape == (M, I) and torch.equal(h, expect)
    assert torch.equal(K.gemm_packed(x[M // 2 :], packed, 2 * I, None if b is None else K.glu_rows(b), None, True), expect[M // 2 :])


@needs_kernel
@pytest.mark.parametrize("M,I,Kd,bias", [(64, 1536, 576, False), (7, 96, 64, True), (1, 80, 128, False), (13, 48, 32, True)])
def test_swiglu_epilogue_on_float32_panels_of_bf16_values(M, I, Kd, bias):
    """The widened-bf16 path (float32 panels of bf16 weights, float32 x of bf16 values): the epilogue returns, as
    float32, the bf16 values `silu_mul` computes from the product rounded to bf16 (what the engine did before)."""
    g = torch.Generator().manual_seed(M * I)
    w, x = (torch.randn(2 * I, Kd, generator=g) * 0.2).bfloat16(), torch.randn(M, Kd, generator=g).bfloat16()
    b = torch.randn(2 * I, generator=g).bfloat16().float() if bias else None
    gu = K.gemm_packed(x.float(), K.gemm_pack(w), 2 * I, b).bfloat16()
    expect = K.silu_mul(gu[:, :I], gu[:, I:])
    h = K.gemm_packed(x.float(), K.gemm_pack(K.glu_rows(w)), 2 * I, None if b is None else K.glu_rows(b), None, True)
    assert h.dtype == torch.float32 and h.shape == (M, I)
    assert torch.equal(h.bfloat16(), expect) and torch.equal(h, expect.float())
    hb = K.gemm_packed(x, K.gemm_pack(K.glu_rows(w)), 2 * I, None if b is None else K.glu_rows(b), None, True)
    assert hb.dtype == torch.bfloat16 and torch.equal(hb, expect)  # bf16 x: the same values, stored as bf16


@needs_bf16_kernel
def test_swiglu_epilogue_refuses_what_it_cannot_do():
    w, x = torch.randn(2 * 48, 32).bfloat16(), torch.randn(3, 32).bfloat16()  # 96 = 3 panels of 32: fine
    assert K.gemm_packed(x, K.gemm_pack_bf16(K.glu_rows(w)), 96, None, None, True).shape == (3, 48)
    with pytest.raises(RuntimeError, match="SwiGLU"):  # N not a multiple of the panel width
        K.gemm_packed(x, K.gemm_pack_bf16(w[:80]), 80, None, None, True)
    with pytest.raises(RuntimeError, match="SwiGLU"):  # no residual
        K.gemm_packed(x, K.gemm_pack_bf16(w), 96, None, torch.zeros(3, 96).bfloat16(), True)


@needs_kernel
@pytest.mark.parametrize("widen", [False, True])
def test_engine_gate_up_linear_returns_the_swiglu(monkeypatch, widen):
    """The runner's gate|up linear of a SiLU MLP (bf16 panels, or float32 panels of widened bf16 as on AVX2 CPUs)
    returns silu(gate) * up (the `_gated` input), the same values as the gate|up product then `silu_mul`;
    re-packed in place after a weight change."""
    if not widen and not K._module.gemm_bf16_kernel_available():
        pytest.skip("bf16 panels need AVX-512 BF16")
    monkeypatch.setattr(runner, "ENGINE_GEMM", True)
    monkeypatch.setattr(runner, "ENGINE_GEMM_BF16", not widen)
    monkeypatch.setattr(runner, "WIDEN_PACKED_BF16", widen)
    monkeypatch.setattr(runner, "WIDEN_MIN_ROWS", 1)  # at any decode batch
    torch.manual_seed(0)
    gate, up = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)
    lin = runner._Linear([gate, up], pack=True, batch_hint=8, dtype=torch.bfloat16, swiglu=True)
    plain = runner._Linear([gate, up], pack=True, batch_hint=8, dtype=torch.bfloat16)
    lin.refresh(), plain.refresh()
    assert lin.glu and not plain.glu and lin.widen == widen and lin.kind == "gemm"
    x = torch.randn(9, 64).bfloat16()
    gu = plain(x)
    assert lin(x).dtype == torch.bfloat16 and torch.equal(lin(x), K.silu_mul(gu[:, :96], gu[:, 96:]))
    first = lin.w.data_ptr()
    with torch.no_grad():
        up.weight.mul_(2)
    lin.refresh(), plain.refresh()
    gu = plain(x)
    assert lin.w.data_ptr() == first and torch.equal(lin(x), K.silu_mul(gu[:, :96], gu[:, 96:]))


def test_engine_linear_keeps_onednn_where_the_rule_says(monkeypatch):
    monkeypatch.setattr(runner, "ENGINE_GEMM", False)
    monkeypatch.setattr(runner, "ENGINE_GEMM_BF16", False)
    monkeypatch.setattr(runner, "WIDEN_PACKED_BF16", False)
    for dtype in (torch.float32, torch.bfloat16):
        lin = runner._Linear([torch.nn.Linear(16, 8)], pack=True, batch_hint=4, dtype=dtype)
        lin.refresh()
        assert lin.kind in ("onednn", "wt")


@pytest.mark.parametrize("x86,expected", [(True, True), (False, False)])
def test_the_engine_gemm_rule(monkeypatch, x86, expected):
    monkeypatch.setattr(L, "_x86", lambda: x86)
    assert L._prefer_engine_gemm("auto") == expected
    assert L._prefer_engine_gemm("posttrain") and not L._prefer_engine_gemm("onednn")
    with pytest.raises(ValueError, match="POSTTRAIN_ENGINE_GEMM"):
        L._prefer_engine_gemm("mkl")


@pytest.mark.parametrize("via_fp32,native,intel,amx,expected",
                         [(False, True, True, False, False), (True, False, False, False, True), (True, True, False, False, False),
                          (True, True, True, False, True), (True, True, True, True, False), (False, False, True, False, False)])
def test_the_widen_rule(monkeypatch, via_fp32, native, intel, amx, expected):
    """bf16 engine weights widen to fp32 panels where bf16 is software, or vdpbf16ps runs at half the FMA rate (Intel
    without AMX); never where bf16 matmuls stay native (POSTTRAIN_BF16_MATMUL=native, AMD AVX-512 BF16, AMX)."""
    monkeypatch.setattr(L, "_intel", lambda: intel)
    monkeypatch.setattr(L, "_amx_usable", lambda: amx)
    assert L._widen_packed_bf16(via_fp32, native) == expected


@pytest.mark.parametrize("x86,amx,expected", [(True, False, True), (True, True, False), (False, False, False)])
def test_the_engine_bf16_gemm_rule(monkeypatch, x86, amx, expected):
    monkeypatch.setattr(L, "_x86", lambda: x86)
    monkeypatch.setattr(L, "_amx_usable", lambda: amx)
    assert L._prefer_engine_gemm_bf16("auto") == expected
    assert L._prefer_engine_gemm_bf16("posttrain") and not L._prefer_engine_gemm_bf16("onednn")
    with pytest.raises(ValueError, match="POSTTRAIN_ENGINE_GEMM"):
        L._prefer_engine_gemm_bf16("mkl")
