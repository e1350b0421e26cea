"""The fused sampler (`cpu_kernels.sample_plain`) against the eager plain-row path of `sampling.sample_logits`.

Both draw by the same inverse CDF over float32 weights exp(z/t - max z/t); only the order in which each
vocabulary chunk's float32 sum is added differs. So the log-probs agree to the rounding of log(total)
(total's relative error <= (chunks + chunk width) float32 ulps), and a token can differ only where
u*total falls within that rounding of a CDF step: a ~1e-5 chance per draw here, so at most a few rows
in a thousand (0 of 10240 measured), each then a token of the same distribution."""

import math
import os

import pytest
import torch

from posttrain.ops import cpu_kernels as K
from posttrain.ops import sampling as S

needs_kernel = pytest.mark.skipif(
    os.environ.get("POSTTRAIN_CPU_KERNELS") == "0" or K.load() is None or not K._module.sample_kernel_available(),
    reason="fused sampler not built here (kernels off, or no AVX2)")


def _eager(x, t, u, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(K, "sample_plain", lambda *a, **k: None)
        return S._plain_rows(x, t, u)


def _logits(rows: int, V: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g) * 2 + torch.randn(rows, 1, generator=g) * 5
    x[:, torch.randint(0, V, (20,), generator=g)] += 10  # a few likely tokens, as a language model's
    return x.to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [49152, 1003, 151936])
@pytest.mark.parametrize("temps", ["one", "mixed"])
def test_fused_sampler_matches_eager(dtype, V, temps, monkeypatch):
    rows = 400 if V < 100000 else 64
    x = _logits(rows, V, dtype, seed=V)
    g = torch.Generator().manual_seed(1)
    t = torch.ones(rows) if temps == "one" else torch.rand(rows, generator=g) * 1.5 + 0.2
    u = torch.randint(0, 1 << 24, (rows,), generator=g).double() / (1 << 24)  # as counter_uniforms
    tok, lp = K.sample_plain(x, t, u)
    e_tok, e_lp = _eager(x, t, u, monkeypatch)
    assert tok.dtype == torch.long and lp.dtype == torch.float32
    same = tok == e_tok
    assert int((~same).sum()) <= max(1, rows // 200)
    W = math.ceil(V / 256)
    tol = (256 + W) * 2.0**-24 + 1e-6  # log(total)'s rounding (+ y's float32 rounding)
    assert torch.allclose(lp[same], e_lp[same], rtol=1e-6, atol=tol)
    y = x.float() / t.unsqueeze(1)
    y = y - y.max(1, keepdim=True).values
    exact = torch.log_softmax(y.double(), 1).gather(1, tok.unsqueeze(1)).squeeze(1)
    assert torch.allclose(lp.double(), exact, rtol=1e-6, atol=tol)  # every draw: its own token's log-prob


@needs_kernel
def test_fused_sampler_edges_and_masked_tokens():
    V = 5000
    x = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    x[:, ::3] = float("-inf")  # weight 0: never drawn
    x[:, 4000:] = float("-inf")
    x[:, [1, 3998]] = 1.0  # first / last allowed token: probability ~1e-3, far above the CDF's rounding (~1e-5)
    u = torch.tensor([0.0, 1 - 2.0**-24, 0.5, 0.25, 0.999, 1e-7], dtype=torch.float64)
    tok, lp = K.sample_plain(x.bfloat16(), torch.ones(6), u)
    assert torch.isfinite(x.gather(1, tok.unsqueeze(1))).all() and torch.isfinite(lp).all()
    finite = torch.isfinite(x[0]).nonzero().squeeze(1)
    assert int(tok[0]) == int(finite[0]) and int(tok[1]) == int(finite[-1])  # u = 0 / u -> 1: first / last allowed token
    strided = torch.randn(8, V + 16, generator=torch.Generator().manual_seed(1))[:, :V]  # rows with a stride (a slice of wider logits)
    t8, u8 = torch.ones(8), torch.rand(8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(K.sample_plain(strided, t8, u8)[0], K.sample_plain(strided.contiguous(), t8, u8)[0])


def test_fused_sampler_declines_what_it_does_not_take():
    u, t = torch.rand(2, dtype=torch.float64), torch.ones(2)
    assert K.sample_plain(torch.randn(2, 10, dtype=torch.float16), t, u) is None
    assert K.sample_plain(torch.randn(10, 2).t(), t, u) is None  # columns not contiguous
