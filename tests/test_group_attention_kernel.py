"""The engine's decode attention kernel over the group KV (csrc/attention_kernel.cpp) against a float64
reference that gathers each query's visible keys, and against the masked SDPA path it replaces.

Region layout (runner.set_width): group g holds its prompt's P keys at [0, P), then sample m's j-th token at
P + j*W + m. The kernel writes the step's k/v at `off` and attends the prompt and the sample's own tokens
(within a sliding window when given). Tolerances come from the dtypes: bf16 outputs are one rounding of a
float32 computation (half a bf16 ulp, 2^-9 relative, plus float32 accumulation over L keys)."""

import os

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops import cpu_kernels as K

pytestmark = pytest.mark.skipif(os.environ.get("POSTTRAIN_CPU_KERNELS") == "0", reason="kernels turned off")


def _case(groups=3, W=4, KV=2, G=3, D=64, t=9, dtype=torch.bfloat16, idle=(), seed=0):
    """Random group KV and one decode step: every live sample at its own length (t, t-1, t-2, ...)."""
    g_ = torch.Generator().manual_seed(seed)
    P = [5 + 11 * g for g in range(groups)]
    cap = max(P) + W * (t + 1) + 5
    kc, vc = (torch.randn(groups + 1, KV, cap, D, generator=g_).to(dtype) for _ in range(2))  # one spare group
    member = torch.full((groups, W), -1, dtype=torch.long)
    rows = [(g, m) for g in range(groups) for m in range(W) if (g, m) not in idle]
    for n, (g, m) in enumerate(rows):
        member[g, m] = n
    own = [t - n % 3 for n in range(len(rows))]  # tokens decoded before this one
    off = torch.tensor([P[g] + own[n] * W + m for n, (g, m) in enumerate(rows)])
    B, H = len(rows), KV * G
    q, k, v = (torch.randn(B, h, D, generator=g_).to(dtype) for h in (H, KV, KV))
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, member=member, off=off, prompt=torch.tensor(P), rows=rows, own=own, W=W)


def _visible(c, n, window):
    """Region offsets and positions of the keys row n sees (its new token included)."""
    g, m = c["rows"][n]
    P, j, W = int(c["prompt"][g]), c["own"][n], c["W"]
    keys = [(o, o) for o in range(P)] + [(P + i * W + m, P + i) for i in range(j + 1)]
    return [o for o, pos in keys if window is None or (P + j) - pos < window]


def _reference(c, scale, window):
    """float64 attention over each row's visible keys, from the caches with the new k/v written."""
    kc, vc = c["kc"].clone(), c["vc"].clone()
    for n, (g, _) in enumerate(c["rows"]):
        kc[g, :, c["off"][n]], vc[g, :, c["off"][n]] = c["k"][n], c["v"][n]
    B, H, D = c["q"].shape
    G = H // kc.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for n, (g, _) in enumerate(c["rows"]):
        idx = _visible(c, n, window)
        for h in range(H):
            key, val = kc[g, h // G, idx].double(), vc[g, h // G, idx].double()
            out[n, h] = torch.softmax(key @ c["q"][n, h].double() * scale, 0) @ val
    return out.view(B, H * D), kc, vc


def _run(c, scale, window):
    kc, vc = c["kc"].clone(), c["vc"].clone()
    out = K.group_attention(c["q"], c["k"], c["v"], kc, vc, c["member"], c["off"], c["prompt"], scale, window)
    return out, kc, vc


def _bound(c, ref, dtype):
    """|kernel - exact| allowed: float32 accumulation over L keys and D dims, then one rounding to `dtype`."""
    L = max(len(_visible(c, n, None)) for n in range(len(c["rows"])))
    vmax = c["vc"].double().abs().max()
    acc = 4 * (L + c["q"].shape[2]) * torch.finfo(torch.float32).eps * vmax
    return acc + ref.abs() * (2**-8 if dtype == torch.bfloat16 else 0)  # half an ulp is 2^-9 relative: 2x margin


@pytest.mark.parametrize("shape", [dict(), dict(G=1, KV=4), dict(G=4, W=8), dict(G=7, KV=2), dict(G=9, KV=1),
                                   dict(D=128, G=2), dict(D=80, G=3), dict(idle={(0, 1), (1, 0), (1, 3), (2, 2)}),
                                   dict(W=8, t=20), dict(t=30)])
@pytest.mark.parametrize("window", [None, 4, 12])
def test_group_attention_equals_visible_keys_attention(shape, window):
    c = _case(**shape)
    scale = c["q"].shape[2] ** -0.5
    out, kc, vc = _run(c, scale, window)
    ref, rk, rv = _reference(c, scale, window)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.equal(kc, rk) and torch.equal(vc, rv)  # the new k/v written, nothing else touched
    assert ((out.double() - ref).abs() <= _bound(c, ref, torch.bfloat16)).all()


def test_group_attention_float32():
    c = _case(dtype=torch.float32, t=20)
    out, kc, vc = _run(c, 0.125, None)
    ref, rk, rv = _reference(c, 0.125, None)
    assert out.dtype == torch.float32 and torch.equal(kc, rk) and torch.equal(vc, rv)
    assert ((out.double() - ref).abs() <= _bound(c, ref, torch.float32)).all()


def test_group_attention_as_accurate_as_masked_sdpa():
    """The masked SDPA path it replaces (every group key, the others masked) against the same reference:
    the kernel computes in float32 throughout, so its error is no larger."""
    c = _case(groups=4, W=8, KV=3, G=3, t=30)
    scale = 0.125
    out, _, _ = _run(c, scale, None)
    ref, rk, rv = _reference(c, scale, None)
    B, H, D = c["q"].shape
    mask = torch.full((B, rk.shape[2]), float("-inf"), dtype=torch.float32)
    for n in range(B):
        mask[n, _visible(c, n, None)] = 0
    g_of = torch.tensor([g for g, _ in c["rows"]])
    q = c["q"].view(B, 3, 3, D)  # (B, KV, G, D)
    sdpa = F.scaled_dot_product_attention(q, rk[g_of], rv[g_of], attn_mask=mask.to(torch.bfloat16).view(B, 1, 1, -1), scale=scale)
    err_kernel = (out.double() - ref).abs().mean()
    err_sdpa = (sdpa.reshape(B, H * D).double() - ref).abs().mean()
    assert err_kernel <= err_sdpa * 1.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [dict(), dict(G=9, KV=1, t=20), dict(D=128, G=2, W=8), dict(D=80, G=3),
                                   dict(idle={(0, 1), (1, 0), (2, 2)})])
def test_rope_inside_equals_rope_then_attention(dtype, shape):
    """With cos/sin, q and the new k are rotated as they are read (decode_layers' path): output and caches equal to
    `rope` over q|k, then the kernel, bit for bit. q, k, v are column slices of one q|k|v row as the runner passes them."""
    c = _case(dtype=dtype, **shape)
    B, H, D = c["q"].shape
    KV = c["k"].shape[1]
    qkv = torch.cat([c["q"].reshape(B, -1), c["k"].reshape(B, -1), c["v"].reshape(B, -1)], 1)
    q, k, v = (qkv[:, a:b].view(B, -1, D) for a, b in ((0, H * D), (H * D, (H + KV) * D), ((H + KV) * D, qkv.shape[1])))
    g = torch.Generator().manual_seed(7)
    angle = torch.rand(B, D // 2, generator=g) * 50
    cos = torch.cat([angle.cos(), angle.cos()], 1).to(dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], 1).to(dtype)  # sin_signed, as the runner's tables
    qk = K.rope(qkv[:, :(H + KV) * D].view(B, H + KV, D), cos, sin)
    kc0, vc0, kc1, vc1 = c["kc"].clone(), c["vc"].clone(), c["kc"].clone(), c["vc"].clone()
    scale = D**-0.5
    args = (c["member"], c["off"], c["prompt"], scale, 4)
    want = K.group_attention(qk[:, :H], qk[:, H:], v, kc0, vc0, *args)
    got = K.group_attention(q, k, v, kc1, vc1, *args, cos=cos, sin=sin)
    assert torch.equal(got, want) and torch.equal(kc1, kc0) and torch.equal(vc1, vc0)
    assert not torch.equal(kc1, c["kc"])  # the rotated keys were written
    with pytest.raises(RuntimeError, match="cos/sin"):
        K.group_attention(q, k, v, kc1, vc1, *args, cos=cos[:-1], sin=sin[:-1])


def test_runs_only_where_it_can():
    assert K.group_attention_runs(torch.device("cpu"), torch.bfloat16, 64)
    assert K.group_attention_runs(torch.device("cpu"), torch.float32, 128)
    assert not K.group_attention_runs(torch.device("cpu"), torch.bfloat16, 72)  # D not a multiple of 16
    assert not K.group_attention_runs(torch.device("cpu"), torch.float16, 64)
    assert not K.group_attention_runs(torch.device("meta"), torch.bfloat16, 64)



@pytest.mark.parametrize("D", [32, 64, 128, 256])
@pytest.mark.parametrize("R,n", [(1, 1), (5, 15), (6, 16), (7, 17), (24, 40)])
@pytest.mark.parametrize("scale", [1.0, 3e-38, 1e-20, 1e4])
@pytest.mark.parametrize("scaled", [slice(None, None, 2), slice(None)])
def test_prompt_scores_from_fmas_equal_vdpbf16ps(D, R, n, scale, scaled):
    """AVX-512 BF16 builds score the shared prompt keys with vdpbf16ps, or (on Intel, where it runs at half the
    FMA rate) with float32 FMAs that add the same exact products in the same order, denormals flushed as
    vdpbf16ps flushes them: the scores must be equal bit for bit, at any magnitude (3e-38: queries and products
    in the denormal range; 1e-20: products near it; 1e4: large sums). Every element scaled, or every other one:
    then each dot product mixes magnitudes and its rounding depends on the order of the adds."""
    module = K.load()
    g = torch.Generator().manual_seed(D * 1000 + R * 10 + n)
    q = torch.randn(R, D, generator=g)
    q[:, scaled] *= scale
    keys = torch.randn(n, D, generator=g)
    q, keys = q.bfloat16(), keys.bfloat16()
    if module is None or not module.attention_fma_scores():
        # the FMA loop follows vdpbf16ps as Intel's SDM specifies it and runs only on Intel; elsewhere vdpbf16ps runs
        pytest.skip("group_attention scores the prompt with vdpbf16ps alone here (no AVX-512 BF16, or not Intel)")
    fma, dp = module.prompt_scores(q, keys, 0.125, True), module.prompt_scores(q, keys, 0.125, False)
    assert fma.shape == (R, n) and torch.equal(fma, dp)
    exact = q.double() @ keys.double().T * 0.125
    if scale >= 1e-20:  # and they are the scores (float32 sums of D exact products)
        assert ((fma.double() - exact).abs() <= D * 2**-23 * (q.double().abs() @ keys.double().abs().T) * 0.125).all()
