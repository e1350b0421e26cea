"""ops/linear.py: fp32 CPU linears on oneDNN or posttrain's packed GEMM give F.linear's values and gradients (to
summation order), only where they apply, and only on machines where the rule picks them (the kernel tests force
each kernel this machine has on in turn)."""

import copy
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops import cpu_kernels
from posttrain.ops import linear as L

needs_onednn = pytest.mark.skipif(not L.AVAILABLE, reason="this torch build has no oneDNN (mkldnn) linear")
KERNELS = ["onednn"] + (["posttrain"] if cpu_kernels.gemm_runs(torch.zeros(1, 1)) else [])


@pytest.fixture(autouse=True, params=KERNELS)
def fp32_kernel(request, monkeypatch):
    """The kernels' tests run on every machine, whichever kernel the rule picks for training there: once with
    oneDNN and once with posttrain's GEMM where it is built (x86-64 with AVX2 and FMA)."""
    monkeypatch.setattr(L, "FP32_KERNEL", request.param)
    return request.param


def order_bound(x, w, b=None):
    """|fl(x·wᵀ) − x·wᵀ| <= γ_K·(|x|·|w|ᵀ + |b|) for any summation order (γ_K = K·u/(1 − K·u), u = 2^-24):
    two kernels differ by at most twice that."""
    u = torch.finfo(torch.float32).eps / 2
    k = x.shape[-1]
    gamma = k * u / (1 - k * u)
    return 2 * gamma * F.linear(x.abs().double(), w.abs().double(), None if b is None else b.abs().double())


@needs_onednn
@pytest.mark.parametrize("shape", [(3, 5, 64), (130, 576), (1, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_match_f_linear(shape, bias, fp32_kernel):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(48, shape[-1], generator=g, requires_grad=True)
    b = torch.randn(48, generator=g, requires_grad=True) if bias else None
    y, y_ref = L.linear(x, w, b), F.linear(x, w, b)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "_LinearBackward"  # the kernel's path ran
    if fp32_kernel == "posttrain":  # its sums: one FMA chain in k order (the engine's own values)
        x2, wd = x.detach().reshape(-1, shape[-1]), w.detach()
        packed = cpu_kernels.gemm_packed(x2, cpu_kernels.gemm_pack(wd), 48, None if b is None else b.detach())
        assert torch.equal(y.detach().reshape(-1, 48), packed)
    assert ((y - y_ref).abs().double() <= order_bound(x, w, b)).all()
    gy = torch.randn(y.shape, generator=g)
    inputs = (x, w) + ((b,) if bias else ())
    got, want = torch.autograd.grad(y, inputs, gy), torch.autograd.grad(y_ref, inputs, gy)
    # ∂x = ∂y·W, ∂W = ∂yᵀ·x: dot products of 48 and of (rows) terms
    gx_bound = order_bound(gy.reshape(-1, 48), w.t().detach())
    assert ((got[0] - want[0]).abs().reshape(-1, shape[-1]).double() <= gx_bound).all()
    gw_bound = order_bound(gy.reshape(-1, 48).t(), x.detach().reshape(-1, shape[-1]).t())  # sums over the rows
    assert ((got[1] - want[1]).abs().double() <= gw_bound).all()
    torch.testing.assert_close(got[2:], want[2:])  # ∂b: the same reduction as autograd's


@pytest.mark.parametrize("K", [40, 37])
def test_sums_longer_than_the_packed_limit_run_in_slices(K, fp32_kernel, monkeypatch):
    """k beyond PACKED_MAX_K (the LM head's ∂x over the vocabulary; limits shrunk here): posttrain's GEMM over k
    slices of at most LONG_SLICE (x's slices read in place), partials added in slice order; values to summation
    order, and the input gradient through the same route."""
    monkeypatch.setattr(L, "PACKED_MAX_K", 16)
    monkeypatch.setattr(L, "LONG_SLICE", 12)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(9, K, generator=g, requires_grad=True)
    w = torch.randn(7, K, generator=g, requires_grad=True)
    b = torch.randn(7, generator=g)
    y = L.linear(x, w, b)
    assert ((y - F.linear(x, w, b)).abs().double() <= order_bound(x, w, b)).all()
    if fp32_kernel == "posttrain":  # four slices of 9-10 k steps (ceil(K / 12)), added left to right
        cuts = [K * i // 4 for i in range(5)]
        parts = [cpu_kernels.gemm_once(x.detach()[:, a:c].contiguous(), w.detach()[:, a:c].contiguous(), b if a == 0 else None)
                 for a, c in zip(cuts, cuts[1:])]
        assert torch.equal(y.detach(), parts[0] + parts[1] + parts[2] + parts[3])
    gy = torch.randn(9, 7, generator=g)
    gx, gx_ref = torch.autograd.grad(y, x, gy)[0], gy @ w.detach()
    assert ((gx - gx_ref).abs().double() <= order_bound(gy, w.t().detach())).all()


@needs_onednn
def test_matmul_helpers_are_differentiable_and_exact_to_order():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(9, 16, generator=g, requires_grad=True)
    b = torch.randn(16, 5, generator=g, requires_grad=True)
    c = torch.randn(5, 16, generator=g, requires_grad=True)
    for got, want, other in ((L.matmul(a, b), a @ b, b), (L.linear(a, c), a @ c.t(), c)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        grads, grads_ref = torch.autograd.grad(got.sum(), (a, other)), torch.autograd.grad(want.sum(), (a, other))
        torch.testing.assert_close(grads, grads_ref, rtol=1e-5, atol=1e-5)

def test_other_dtypes_devices_and_autocast_take_the_stock_op():
    x64 = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert type(L.linear(x64, w64).grad_fn).__name__ != "_LinearBackward"
    assert torch.autograd.gradcheck(lambda a, b: L.linear(a, b), (x64, w64))
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = L.linear(x, w)
    assert y.dtype == torch.bfloat16  # autocast's own bf16 matmul (already oneDNN in PyTorch)
    assert not L.applies(torch.randn(0, 8), w)  # empty inputs: the stock op


@needs_onednn
def test_no_graph_when_nothing_needs_a_gradient():
    x, w = torch.randn(6, 8), torch.randn(3, 8)
    assert L.linear(x, w).grad_fn is None
    with torch.no_grad():
        assert L.linear(x, w.requires_grad_()).grad_fn is None


@needs_onednn
def test_swapping_classes_keeps_parameters_copies_and_pickles():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4, bias=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 8)
    y0 = model(x)
    assert L.use_onednn_linears(model) == 2
    assert all(type(m) is L.Linear for m in (model[0], model[2])) and isinstance(model[0], torch.nn.Linear)
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    torch.testing.assert_close(model(x), y0, rtol=1e-5, atol=1e-6)
    assert type(copy.deepcopy(model)[0]) is L.Linear
    assert type(pickle.loads(pickle.dumps(model))[2]) is L.Linear
    assert L.use_onednn_linears(model) == 0  # idempotent
    assert L.use_onednn_linears(model, enabled=False) == 2 and type(model[0]) is torch.nn.Linear


def test_the_rule_picks_by_vendor_and_obeys_the_switch(monkeypatch):
    assert [L._fp32_kernel(c) for c in ("onednn", "blas", "posttrain")] == ["onednn", "blas", "posttrain"]
    assert L._fp32_kernel("auto") in ("posttrain", "blas" if L._mkl_fast() else "onednn")
    with pytest.raises(ValueError, match="POSTTRAIN_FP32_MATMUL"):
        L._fp32_kernel("mkl")
    monkeypatch.setattr(L, "FP32_KERNEL", "blas")  # the BLAS chosen: the stock op, and no class swap
    monkeypatch.setattr(L, "BF16_VIA_FP32", False)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    assert not L.applies(x, w) and type(L.linear(x, w).grad_fn).__name__ != "_LinearBackward"
    assert L.use_onednn_linears(torch.nn.Sequential(torch.nn.Linear(8, 3))) == 0


# ---- bf16 matmuls as fp32 GEMMs (Intel without AMX) ------------------------------------------------------------


def assert_same_bf16_matmul(got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor, k: int) -> None:
    """got, want: the same bf16 matmul by two kernels, each an fp32 sum of the exact products of bf16 operands
    rounded to bf16 once; `terms` = Σ|products| per element (float64), k products (+ bias) per sum.

    Bound: the two fp32 sums differ by at most δ = 2·γ_k·terms (γ_k = k·u/(1 − k·u), u = 2^-24, any order), and
    each rounding to bf16 moves a value by at most 2^-8 of it, so |got − want| <= δ + 2^-8·(|got| + |want|)·(1 + 2^-7).
    Share: a sum rounds differently only if a bf16 rounding boundary lies within δ of it, so the share of elements
    that differ is at most mean(min(1, 2δ / ulp)), plus a binomial margin. Operands multiplied unrounded (fp32
    values) would move about half of all elements."""
    assert got.dtype == want.dtype
    u = 2.0**-24
    delta = 2 * (k * u / (1 - k * u)) * terms
    g, w = got.double(), want.double()
    assert ((g - w).abs() <= delta + 2.0**-8 * (g.abs() + w.abs()) * (1 + 2.0**-7)).all()
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(w)[1] - 8)  # bf16's step at |want|: 2^(e-8), w = m·2^e
    expected = (2 * delta / ulp).clamp(max=1).mean().item()
    share = (g != w).double().mean().item()
    assert share <= expected + 3 * (expected / g.numel()) ** 0.5, (share, expected)


def _abs_bf16(t: torch.Tensor) -> torch.Tensor:
    """|t| of t's bf16 values, float64 (a bound's terms)."""
    return t.detach().to(torch.bfloat16).double().abs()


@pytest.fixture
def bf16_via_fp32(monkeypatch):
    monkeypatch.setattr(L, "BF16_VIA_FP32", True)
    monkeypatch.setattr(L, "MIN_ROWS", 1)  # small shapes take the route too


@pytest.mark.parametrize("bias", [False, True])
def test_autocast_bf16_linear_as_fp32_gemm_is_autocasts_matmul(bf16_via_fp32, bias):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 70, 96, generator=g, requires_grad=True)
    w = torch.randn(80, 96, generator=g, requires_grad=True)
    b = torch.randn(80, generator=g, requires_grad=True) if bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = L.linear(x, w, b), F.linear(x, w, b)
    assert type(y.grad_fn).__name__ == "_Bf16LinearBackward" and y.dtype == torch.bfloat16
    ax, aw = _abs_bf16(x).reshape(-1, 96), _abs_bf16(w)
    terms = ax @ aw.t() + (0 if b is None else _abs_bf16(b))
    assert_same_bf16_matmul(y.reshape(-1, 80), y_ref.reshape(-1, 80), terms, 96 + bias)
    gy = torch.randn(y.shape, generator=g).to(torch.bfloat16)
    inputs = (x, w) + ((b,) if bias else ())
    got, want = torch.autograd.grad(y, inputs, gy), torch.autograd.grad(y_ref, inputs, gy)
    assert all(a.dtype == c.dtype == torch.float32 for a, c in zip(got, want))  # widened to the fp32 leaves
    agy = _abs_bf16(gy).reshape(-1, 80)
    assert_same_bf16_matmul(got[0].reshape(-1, 96), want[0].reshape(-1, 96), agy @ aw, 80)  # ∂x = ∂y·W
    assert_same_bf16_matmul(got[1], want[1], agy.t() @ ax, agy.shape[0])  # ∂W = ∂yᵀ·x
    if bias:
        assert_same_bf16_matmul(got[2], want[2], agy.sum(0), agy.shape[0])  # ∂b = Σ_rows ∂y
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(L.linear(x, w, b), y.detach())  # no graph, the same numbers


def test_bf16_weights_without_autocast_and_the_matmul_helper(bf16_via_fp32):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 64, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16).requires_grad_()
    y = L.linear(x, w)
    assert type(y.grad_fn).__name__ == "_Bf16LinearBackward"
    ax, aw = _abs_bf16(x), _abs_bf16(w)
    assert_same_bf16_matmul(y, F.linear(x, w), ax @ aw.t(), 64)
    gx, gw = torch.autograd.grad(y.float().sum(), (x, w))  # ∂y = 1
    gx_ref, gw_ref = torch.autograd.grad(F.linear(x, w).float().sum(), (x, w))
    assert gx.dtype == gw.dtype == torch.bfloat16
    assert_same_bf16_matmul(gx, gx_ref, torch.ones(33, 40, dtype=torch.float64) @ aw, 40)
    assert_same_bf16_matmul(gw, gw_ref, torch.ones(40, 33, dtype=torch.float64) @ ax, 33)
    a, c = x.detach(), w.detach().t()
    assert_same_bf16_matmul(L.matmul(a, c), a @ c, ax @ aw.t(), 64)


def test_bf16_route_leaves_other_calls_alone(bf16_via_fp32):
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    assert not L.bf16_applies(x, w)  # fp32 without autocast
    with torch.autocast("cpu", dtype=torch.float16):
        assert not L.bf16_applies(x, w)  # another autocast dtype
    assert not L.bf16_applies(torch.randn(0, 8).bfloat16(), w.bfloat16())
    assert not L.bf16_applies(x.bfloat16(), w)  # mixed dtypes without autocast: F.linear's own error
    assert not L.bf16_applies(x.double(), w.double())


def test_bf16_route_takes_only_matmuls_of_many_rows(monkeypatch):
    monkeypatch.setattr(L, "BF16_VIA_FP32", True)  # MIN_ROWS as shipped
    w = torch.randn(3, 8).bfloat16()
    assert not L.bf16_applies(torch.randn(4, 8).bfloat16(), w)  # decoding: native bf16
    assert not L.bf16_applies(torch.randn(2, L.MIN_ROWS // 2 - 1, 8).bfloat16(), w)
    assert L.bf16_applies(torch.randn(2, L.MIN_ROWS // 2, 8).bfloat16(), w)  # rows = all dims but the last
    assert not L.bf16_applies(torch.randn(8).bfloat16(), w)
    small = torch.randn(4, 8).bfloat16()
    seen = []
    with L.route_any_rows():
        assert L.bf16_applies(small, w)
        thread = threading.Thread(target=lambda: seen.append(L.bf16_applies(small, w)))
        thread.start()
        thread.join()
    assert seen == [False] and not L.bf16_applies(small, w)  # this thread's block only, and undone after it


def test_bf16_route_under_inference_mode(bf16_via_fp32):
    """Inference tensors have no version counter: the shared-input cast is not kept for them (it raised)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 16, generator=g).bfloat16(), torch.randn(6, 16, generator=g).bfloat16()
    with torch.no_grad():
        want = L.linear(x, w)
    with torch.inference_mode():
        xi = x.clone()
        got = L.linear(xi, w)
        xi.mul_(2)  # changed in place, untracked: must not reuse the first cast
        got2 = L.linear(xi, w)
    assert torch.equal(got, want) and torch.equal(got2, L.linear(x * 2, w))
    xt = torch.randn(5, 16, generator=g)  # a normal tensor seen first under inference mode, then with grad:
    wt = torch.randn(6, 16, generator=g, requires_grad=True)  # its split made there must not be saved
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        L.linear(xt, wt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = L.linear(xt, wt)
    y.float().sum().backward()
    assert wt.grad is not None


def test_a_trained_weight_is_saved_widened_a_frozen_one_bf16(bf16_via_fp32):
    """The backward multiplies by W as float32: a trained W's widening is saved (not widened again), a frozen W's
    bf16 copy (half the bytes: LoRA's base weights); both hold the same values, so ∂x is the same bit for bit."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 32, generator=g)
    x = torch.randn(40, 32, generator=g, requires_grad=True)
    grads = {}
    for trained in (True, False):
        wt = w.clone().requires_grad_(trained)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = L.linear(x, wt)
        saved = y.grad_fn.saved_tensors[1]
        assert saved.dtype == (torch.float32 if trained else torch.bfloat16)
        assert torch.equal(saved.float(), w.bfloat16().float())
        grads[trained] = torch.autograd.grad(y.float().square().sum(), x)[0]
    assert torch.equal(grads[True], grads[False])
    wb = w.bfloat16().requires_grad_()  # a trained bf16 weight saves itself, no copy
    y = L.linear(x.detach().bfloat16().requires_grad_(), wb)
    assert y.grad_fn.saved_tensors[1].data_ptr() == wb.data_ptr()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # no ∂x wanted: W is not kept at all
        assert L.linear(x.detach(), w.clone().requires_grad_()).grad_fn.saved_tensors[1] is None


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="the rule chooses between MKL and oneDNN")
@pytest.mark.parametrize("intel,x86,family,flags,kernel", [
    (True, True, "6", {"avx512f", "avx2", "fma"}, "blas"),  # Intel: MKL's own fast paths
    (True, True, "6", {"avx2", "fma"}, "blas"),
    (False, True, "23", {"avx2", "fma"}, "posttrain"),  # AMD Zen 2: posttrain's GEMM beats MKL's by 15-25%
    (False, True, "23", {"avx"}, "blas"),  # no AVX2/FMA: posttrain's GEMM is not built; MKL
    (False, True, "25", {"avx2", "fma"}, "blas"),  # AMD Zen 3 (AVX2 only): MKL's AVX2 kernels beat oneDNN's
    (False, True, "25", {"avx512f", "avx2", "fma"}, "onednn"),  # AMD Zen 4: MKL keeps to AVX2, oneDNN does not
    (False, False, "", set(), "onednn"),  # not x86
])
def test_the_fp32_rule_follows_mkls_fast_path(monkeypatch, intel, x86, family, flags, kernel):
    monkeypatch.setattr(L, "_mkl_on_intel", lambda: intel)
    monkeypatch.setattr(L, "_intel", lambda: intel)
    monkeypatch.setattr(L, "_x86", lambda: x86)
    monkeypatch.setattr(L, "_cpu_flag", lambda flag: flag in flags)
    monkeypatch.setattr(L, "_cpuinfo", lambda key: f" {family}\n" if key == "cpu family" else "")
    assert L._fp32_kernel("auto") == kernel


def test_the_bf16_rule_reads_amx_and_the_onednn_isa_cap(monkeypatch):
    with pytest.raises(ValueError, match="POSTTRAIN_BF16_MATMUL"):
        L._prefer_fp32_for_bf16("bf16")
    assert L._prefer_fp32_for_bf16("fp32") and not L._prefer_fp32_for_bf16("native")
    monkeypatch.setattr(L, "NATIVE_BF16", True)
    monkeypatch.setattr(L, "_mkl_on_intel", lambda: True)
    monkeypatch.setattr(L, "_amx_usable", lambda: True)
    assert not L._prefer_fp32_for_bf16("auto")  # AMX: bf16 GEMMs are the fast kind
    monkeypatch.setattr(L, "_amx_usable", lambda: False)
    assert L._prefer_fp32_for_bf16("auto")
    monkeypatch.setattr(L, "_mkl_on_intel", lambda: False)
    assert not L._prefer_fp32_for_bf16("auto")  # AMD's avx512_bf16: bf16 ~2x fp32
    monkeypatch.setattr(L, "NATIVE_BF16", False)
    assert L._prefer_fp32_for_bf16("auto")  # no bf16 instructions (AVX2): software bf16, ~4x slower
    assert not L._prefer_fp32_for_bf16("native")
    monkeypatch.undo()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not L._amx_usable()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert L._amx_usable() == bool(torch.cpu._is_amx_tile_supported())


def test_native_bf16_reads_the_cpu_and_the_onednn_isa_cap(monkeypatch):
    monkeypatch.setattr(L.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not L._native_bf16()  # capped below every bf16 ISA
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    assert not L._native_bf16()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert L._native_bf16()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(L, "_amx_usable", lambda: False)
    monkeypatch.setattr(L, "_cpu_flag", lambda flag: False)
    assert not L._native_bf16()  # AVX2 / AVX-512 without bf16: software bf16
    monkeypatch.setattr(L, "_cpu_flag", lambda flag: flag == "avx_ne_convert")
    assert L._native_bf16()
    monkeypatch.setattr(L.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(L, "_cpu_flag", lambda flag: False)
    assert L._native_bf16()  # not x86: left native
