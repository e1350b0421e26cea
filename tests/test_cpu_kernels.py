"""Fused bf16 CPU kernels vs the eager ops they replace (and the eager ops == HF's modules).

RoPE and SiLU·mul are bit-identical. RMSNorm sums the squares in another order than PyTorch's reduction, so its
rsqrt can differ by one float ulp and a few outputs by a bf16 ulp or two; it must stay that close, and no
less accurate than the eager op against a float64 reference."""

import os

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from posttrain.ops import cpu_kernels as K

needs_kernels = pytest.mark.skipif(os.environ.get("POSTTRAIN_CPU_KERNELS") == "0", reason="kernels turned off")


@needs_kernels
def test_kernels_build_here():
    assert K.load() is not None  # Linux + g++ + ninja: the CI machine must build them (else decode is slower)


@needs_kernels
@pytest.mark.parametrize("rows,H", [(1, 576), (7, 576), (300, 576), (2000, 576), (500, 896), (200, 4096)])
def test_rmsnorm_kernel_matches_eager_and_hf(rows, H):
    g = torch.Generator().manual_seed(rows + H)
    big = (torch.randn(rows, H + 124, generator=g) * 4).bfloat16()
    x = big[:, :H]  # rows with a stride (a slice of a wider tensor)
    norm = LlamaRMSNorm(H, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=g) + 0.5)
    norm = norm.bfloat16()
    with torch.no_grad():
        ref = K.rmsnorm_ref(x, norm.weight, 1e-5)
        assert torch.equal(ref, norm(x))  # the eager twin is HF's module
        got = K.rmsnorm(x, norm.weight, 1e-5)
    assert got.dtype == torch.bfloat16
    diff = (got.float() - ref.float()).abs()
    assert (diff <= ref.float().abs() * 2**-6).all()  # one bf16 ulp in h, so at most ~2 in w * h
    assert (diff > 0).float().mean() < 0.01  # and only rarely
    x64, w64 = x.double(), norm.weight.double()
    exact = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert (got.double() - exact).abs().mean() <= (ref.double() - exact).abs().mean() * 1.05


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 257])
def test_rope_kernel_equals_eager_and_hf(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    D, heads, kv = 64, 9, 3
    qkv = torch.randn(rows, (heads + 2 * kv) * D, generator=g).to(dtype)
    x = qkv[:, :(heads + kv) * D].view(rows, heads + kv, D)  # q and k heads, rows strided like the engine's
    ang = torch.rand(rows, D // 2, generator=g) * 50
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    sin_signed = torch.cat([-sin[:, :D // 2], sin[:, D // 2:]], -1)
    ref = K.rope_ref(x, cos, sin_signed)
    q_hf, _ = apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    assert torch.equal(ref, q_hf.transpose(0, 1))
    got = K.rope(x, cos, sin_signed)
    assert got.dtype == dtype and torch.equal(got, ref)
    assert torch.equal(K._module.rope(x, cos, sin_signed), ref)  # the kernel itself, not a fallback


@needs_kernels
@pytest.mark.parametrize("rows,I", [(64, 1536), (5, 100), (3, 7), (9, 128)])
def test_silu_mul_kernel_equals_eager(rows, I):
    """bf16 silu(g) * u on the halves of a gate|up output (row-strided): bit for bit eager's, the tails past the
    last whole vector step included (std::exp there, as in torch's loop)."""
    torch.manual_seed(rows * I)
    gu = (torch.randn(rows, 2 * I) * 4).bfloat16()
    gu[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # exp's range ends: silu(±90) = 90 / -0
    g, u = gu[:, :I], gu[:, I:]
    assert torch.equal(K.silu_mul(g, u), F.silu(g) * u)
    assert torch.equal(K.silu_mul(g.float(), u.float()), F.silu(g.float()) * u.float())  # fp32: eager


@needs_kernels
@pytest.mark.parametrize("lanes", [8, 16])
def test_inline_exp_is_sleefs_exp_bit_for_bit(lanes):
    """The kernels' inline exp (bf16.h `exp8`, and `exp16` in AVX-512 builds: sampling, attention softmax, SiLU) ==
    the SLEEF routine it writes out (torch's Sleef_expf8_u10 / Sleef_expf16_u10, called a vector at a time) on every
    bf16 value as float32, 2^20 random float32 bit patterns, and the edges (the -104 / 100 cut-offs, denormals,
    +-inf, NaN). (torch.exp itself may run MKL's exp instead; F.silu runs SLEEF's: test_silu_mul_kernel_equals_eager.)"""
    if K.load() is None or not K._module.sample_kernel_available():
        pytest.skip("no AVX2 kernels here")
    if lanes == 16 and K.gemm_panel_width() != 32:  # panels of 2 x 16 lanes: an AVX-512 build
        pytest.skip("not an AVX-512 build")
    every_bf16 = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    g = torch.Generator().manual_seed(0)
    sampled = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 20,), generator=g, dtype=torch.int32).view(torch.float32)
    edges = torch.tensor([-104.0, -103.99999, -104.00001, 100.0, 99.99999, 100.00001, 88.72283, 88.72284, -87.33654,
                          1e-40, -1e-40, 0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    x = torch.cat([every_bf16, sampled, edges, torch.zeros((-edges.numel()) % 64)])
    ours = K._module.exp_lanes_(x.clone(), lanes, False)
    sleef = K._module.exp_lanes_(x.clone(), lanes, True)
    assert torch.equal(ours.view(torch.int32), sleef.view(torch.int32))  # bits, NaN payloads included


def test_fallback_for_float32_and_odd_layouts():
    x = torch.randn(4, 32)
    w = torch.rand(32)
    assert torch.equal(K.rmsnorm(x, w, 1e-6), K.rmsnorm_ref(x, w, 1e-6))  # float32: the eager ops
    xt = torch.randn(32, 4).bfloat16().t()  # last dim not contiguous
    wb = w.bfloat16()
    assert torch.equal(K.rmsnorm(xt, wb, 1e-6), K.rmsnorm_ref(xt, wb, 1e-6))


@needs_kernels
def test_stale_build_lock_is_removed_not_waited_on():
    """A build killed midway leaves torch's `lock` file; the next load must remove it, not wait forever
    (torch's FileBaton polls until the file goes). Runs in a child so a regression times out instead of hanging."""
    import subprocess
    import sys

    assert K.load() is not None  # builds (or finds) the extension in the usual directory first
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(f"posttrain_cpu_kernels_{K._cpu_tag()}", verbose=False), "lock")
    open(lock, "w").close()
    code = "from posttrain.ops import cpu_kernels as K; assert K.load() is not None"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left by an interrupted build" in done.stderr
    assert not os.path.exists(lock)


def test_each_checkout_keeps_its_own_build(monkeypatch, tmp_path):
    """Two checkouts sharing one build directory rebuild it whenever the other loads (other source paths in the
    ninja file): the build's name depends on where the sources are."""
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(K._SOURCE.parent, csrc)
    here = K._cpu_tag()
    monkeypatch.setattr(K, "_SOURCE", csrc / K._SOURCE.name)
    assert K._cpu_tag() != here


@needs_kernels
def test_bf16_rounding_kernels_equal_torchs_casts():
    """bf16_split / round_bf16_ round to nearest even exactly as torch's casts, specials included (NaN stays NaN;
    its payload may differ)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 577, generator=g) * torch.logspace(-42, 38, 577)  # subnormals to near-overflow
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0, 1e-45])
    x[1, :4] = torch.tensor([1.00390625, 1.01171875, 1.0 + 2**-9 + 2**-20, -1.00390625])  # ties and just above
    ref = x.to(torch.bfloat16)
    xb, xr = K.load().bf16_split(x)
    assert xb.dtype == torch.bfloat16 and xr.dtype == torch.float32
    torch.testing.assert_close(xb, ref, rtol=0, atol=0, equal_nan=True)
    not_nan = ~x.isnan()
    assert torch.equal(xb.view(torch.int16)[not_nan], ref.view(torch.int16)[not_nan])
    assert torch.equal(xr.view(torch.int32)[not_nan], ref.float().view(torch.int32)[not_nan])
    t = x.clone()
    assert K.load().round_bf16_(t) is t  # in place
    assert torch.equal(t.view(torch.int32)[not_nan], ref.float().view(torch.int32)[not_nan]) and t[0, 0].isnan()
