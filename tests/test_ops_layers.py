"""ops/layers.py: fused RMSNorm, SwiGLU and RoPE give the eager ops' values and gradients up to rounding (bounds
derived from float32's unit roundoff and the length of each sum), switch only the classes whose formula they
reproduce, and leave every model of every tiny family computing what it computed before."""

import copy

import pytest
import torch
import torch.nn.functional as F

from posttrain.models.builtin import TINY_CONFIGS, build_tiny
from posttrain.models.loading import load_model
from posttrain.ops import cpu_kernels, layers

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the fused CPU kernels could not be built here")
U = torch.finfo(torch.float32).eps / 2  # unit roundoff


def eager_rmsnorm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # HF LlamaRMSNorm in float32


@pytest.mark.parametrize("rows,width", [(1, 7), (130, 64), (1024, 576)])
def test_rmsnorm_values_and_gradients_match_eager(rows, width):
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, width, generator=g)).requires_grad_(True)
    w = torch.randn(width, generator=g).requires_grad_(True)
    out, ref = layers.rmsnorm(x, w, 1e-6), eager_rmsnorm(x, w, 1e-6)
    assert type(out.grad_fn).__name__ == "_RMSNormBackward"
    r = torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    # the D-term sum of squares in another order: r moves by <= (D/2)·γ, out by a few more roundings
    assert ((out - ref).abs() <= (width + 8) * U * ref.abs().detach() + 1e-30).all()
    go = torch.randn(rows, width, generator=g)
    (gx, gw), (gx_ref, gw_ref) = torch.autograd.grad(out, (x, w), go), torch.autograd.grad(ref, (x, w), go)
    gy, xd = go * w.detach(), x.detach()
    # ∂x = r·gy − x·r³·⟨gy, x⟩/D: each part to (D + 8) roundings of its absolute size
    gx_scale = r * gy.abs() + r**3 * xd.abs() * (gy * xd).abs().sum(-1, keepdim=True) / width
    assert ((gx - gx_ref).abs() <= 2 * (width + 8) * U * gx_scale).all()
    # ∂w = Σ_rows go·(x·r): an N-term sum in another order
    gw_scale = (go * xd * r).abs().sum(0)
    assert ((gw - gw_ref).abs() <= 2 * (rows + width + 8) * U * gw_scale).all()


@pytest.mark.parametrize("shape", [(5,), (2, 512, 1536), (3, 7, 33)])
def test_swiglu_values_and_gradients_match_eager(shape):
    gen = torch.Generator().manual_seed(len(shape))
    g = (4 * torch.randn(*shape, generator=gen)).requires_grad_(True)
    u = torch.randn(*shape, generator=gen).requires_grad_(True)
    h, ref = layers.swiglu(g, u), F.silu(g) * u
    assert type(h.grad_fn).__name__ == "_SwiGLUBackward"
    gd, ud = g.detach(), u.detach()
    sig = torch.sigmoid(gd)
    # exp to 2 ulps (both sides), then a division and a product: silu·u to ~8 roundings of |silu·u|
    assert ((h - ref).abs() <= 8 * U * ref.abs().detach() + 1e-37).all()
    gh = torch.randn(*shape, generator=gen)
    (gg, gu), (gg_ref, gu_ref) = torch.autograd.grad(h, (g, u), gh), torch.autograd.grad(ref, (g, u), gh)
    assert ((gu - gu_ref).abs() <= 8 * U * gu_ref.abs() + 1e-37).all()
    # σ·(1 + g·(1 − σ)) cancels near g ≈ −1.28: bound by the sizes of its terms, not of the result
    gg_scale = (gh * ud).abs() * sig * (1 + gd.abs() * (1 - sig))
    assert ((gg - gg_ref).abs() <= 16 * U * gg_scale + 1e-37).all()


def test_swiglu_rows_of_a_wider_tensor_equal_the_contiguous_kernel():
    gu = 4 * torch.randn(13, 2 * 96, generator=torch.Generator().manual_seed(3))
    g, u = gu[:, :96], gu[:, 96:]  # the engine's gate|up halves: strided rows, no copies
    h = layers.swiglu_rows(g, u)
    assert h.shape == (13, 96) and torch.equal(h, layers.swiglu(g.contiguous(), u.contiguous()))
    assert layers.swiglu_rows(g.bfloat16(), u.bfloat16()) is None and layers.swiglu_rows(g.t(), u.t()) is None


def test_kernels_apply_only_to_float32_cpu_plain_tensors():
    x = torch.randn(4, 8)
    assert layers.rmsnorm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6) is None
    assert layers.rmsnorm(x.bfloat16(), torch.ones(8, dtype=torch.bfloat16), 1e-6) is None
    assert layers.swiglu(x.bfloat16(), x.bfloat16()) is None  # bf16 autocast keeps the eager ops
    assert layers.swiglu(x, x[:, :4]) is None
    assert layers.rmsnorm(x, torch.ones(8), 1e-6) is not None


def test_no_graph_without_gradients():
    x, w = torch.randn(4, 8), torch.randn(8)
    with torch.no_grad():
        assert layers.rmsnorm(x.requires_grad_(), w, 1e-6).grad_fn is None
    assert layers.swiglu(torch.randn(3, 4), torch.randn(3, 4)).grad_fn is None


class GemmaLikeRMSNorm(torch.nn.Module):
    """(1 + w)·norm(x): another formula under the same attribute names, which must keep its forward."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(width))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class GeluMLP(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(width, 2 * width), torch.nn.Linear(width, 2 * width),
                                                        torch.nn.Linear(2 * width, width))
        self.act_fn = torch.nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_other_formulas_keep_their_forward():
    model = torch.nn.Sequential(GemmaLikeRMSNorm(16), GeluMLP(16))
    assert layers.use_fused_layers(model) == 0
    assert type(model[0]) is GemmaLikeRMSNorm and type(model[1]) is GeluMLP


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_every_tiny_family_computes_what_it_computed(name):
    """load_model switches what it can; the loss and every gradient equal the unswitched twin's to float32
    rounding (two forward/backward passes of a few layers: 1e-5 relative)."""
    model, twin = load_model(name, seed=0, varlen_attention=False), build_tiny(name, seed=0)
    ids = torch.randint(0, twin.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for m in (model, twin):
        loss = m(input_ids=ids, labels=ids).loss
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad]))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    if name in ("tiny-random", "tiny-random-qwen2", "tiny-random-mistral", "tiny-random-qwen3"):
        assert any(type(m).__name__.startswith("Fused") for m in model.modules()), "expected fused layers"
    if "gemma" in name:  # (1 + w) norms and GELU MLPs: none switched (their attention's RoPE is HF's: switched)
        fused = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused")]
        assert fused and all(n.endswith("Attention") for n in fused)


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen3"])
def test_autocast_mlp_runs_each_projection_once_and_equals_the_class(name, monkeypatch):
    """Under bf16 autocast the kernel leaves the MLP to eager ops: the same formula on the projections already
    computed (a second gate/up matmul would be half the MLP's forward again), bit-identical to the class's own.
    Both sides on torch's bf16 matmul: where bf16 is software, ops.linear sends matmuls of 16+ rows to an fp32 GEMM
    (the same values in another summation order; tests/test_ops_linear.py), which the stock class never takes."""
    from posttrain.ops import linear as L

    monkeypatch.setattr(L, "BF16_VIA_FP32", False)
    model, twin = load_model(name, seed=0, varlen_attention=False), build_tiny(name, seed=0)
    calls = []
    for m in model.modules():
        if type(m).__name__.startswith("Fused") and hasattr(m, "gate_proj"):
            for proj in (m.gate_proj, m.up_proj, m.down_proj):
                proj.register_forward_hook(lambda mod, a, out: calls.append(mod))
    ids = torch.randint(0, twin.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    outs = []
    for m in (model, twin):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(m(input_ids=ids).logits)
    layers_n = model.config.num_hidden_layers
    assert len(calls) == 3 * layers_n and len(set(map(id, calls))) == 3 * layers_n
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_switch_round_trip_deepcopy_and_env_off(monkeypatch):
    model = load_model("tiny-random", seed=0, varlen_attention=False)
    fused = sum(type(m).__name__.startswith("Fused") for m in model.modules())
    assert fused > 0
    clone = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        on = model(ids).logits
        monkeypatch.setenv("POSTTRAIN_FUSED_LAYERS", "0")  # the classes stay; their forward takes the original
        off = model(ids).logits
        monkeypatch.delenv("POSTTRAIN_FUSED_LAYERS")
        assert layers.use_fused_layers(clone, enabled=False) == fused
        plain = clone(ids).logits
    torch.testing.assert_close(off, plain, rtol=0, atol=0)
    torch.testing.assert_close(on, plain, rtol=1e-5, atol=1e-5)
    assert not any(type(m).__name__.startswith("Fused") for m in clone.modules())


def hf_cos_sin(B, T, D, base=10000.0):
    """HF's rotary tables: angles t·θ_i for the D/2 frequencies, each used twice (cat(freqs, freqs)), float32."""
    inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    emb = (torch.arange(T).float()[None, :, None] * inv).repeat(1, 1, 2).expand(B, T, D)
    return emb.cos().contiguous(), emb.sin().contiguous()


def llama_rope():
    from transformers.models.llama import modeling_llama

    fn = modeling_llama.apply_rotary_pos_emb
    return getattr(fn, "posttrain_original", fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,H,Hk,D,B_cos,table", [(2, 512, 9, 3, 64, 2, "hf"), (1, 7, 4, 2, 16, 1, "hf"),
                                                   (3, 33, 2, 1, 128, 3, "hf"), (3, 10, 4, 2, 32, 1, "hf"),
                                                   (2, 9, 3, 1, 16, 2, "random"), (3, 6, 2, 2, 8, 1, "random")])
def test_rope_equals_hf_bit_for_bit(dtype, B, T, H, Hk, D, B_cos, table):
    """Values, gradients, dtypes and the output's memory layout equal transformers' apply_rotary_pos_emb exactly:
    the same products, each rounded, then one add (a bf16 q: float32 out, each path's gradient rounded to bf16
    first). B_cos = 1: one table for every row; "random" tables have halves that differ (HF's repeat theirs), so
    a kernel that took the sine of the wrong half would fail here."""
    original = llama_rope()
    fused = layers._rope_dispatch(original)
    gen = torch.Generator().manual_seed(0)
    cos, sin = hf_cos_sin(B_cos, T, D) if table == "hf" else torch.randn(2, B_cos, T, D, generator=gen).unbind(0)
    q0, k0 = torch.randn(B, T, H * D, generator=gen).to(dtype), torch.randn(B, T, Hk * D, generator=gen).to(dtype)
    results = []
    for f, on in ((original, False), (fused, True)):
        q = q0.clone().view(B, T, H, D).transpose(1, 2).requires_grad_(True)  # HF's layout: a transposed view
        k = k0.clone().view(B, T, Hk, D).transpose(1, 2).requires_grad_(True)
        token = layers._ROPE_ON.set(on)
        out = f(q, k, cos, sin)
        layers._ROPE_ON.reset(token)
        assert (out[0].grad_fn is not None and type(out[0].grad_fn).__name__.startswith("_RoPE")) == on
        gen = torch.Generator().manual_seed(1)
        torch.autograd.backward(out, [torch.randn(o.shape, generator=gen) for o in out])
        results.append([*out, q.grad, k.grad])
    for i, (a, b) in enumerate(zip(*results)):
        assert a.dtype == b.dtype and torch.equal(a, b)
        if i < 2:  # the outputs (a leaf's .grad takes the leaf's strides whatever backward returned)
            layout = [[st for st, n in zip(t.stride(), t.shape) if n > 1] for t in (a, b)]  # size-1 dims: any stride
            assert layout[0] == layout[1]
    with torch.no_grad():  # no graph: the kernel's forward alone
        q, k = (x.view(B, T, -1, D).transpose(1, 2) for x in (q0, k0))
        token = layers._ROPE_ON.set(True)
        out = fused(q, k, cos, sin)
        layers._ROPE_ON.reset(token)
        assert all(torch.equal(a, b) and a.grad_fn is None for a, b in zip(out, original(q, k, cos, sin)))


def test_rope_dispatch_passes_other_calls_through():
    """Any call but the plain (q, k, cos, sin[, unsqueeze_dim=1]) reaches the module's own function unchanged,
    also inside a fused attention: keywords, k=None (one tensor only), another unsqueeze_dim."""
    seen = []

    def own(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
        seen.append(unsqueeze_dim)
        return "own"

    fused = layers._rope_dispatch(own)
    q, (cos, sin) = torch.randn(1, 2, 3, 8), hf_cos_sin(1, 3, 8)
    token = layers._ROPE_ON.set(True)
    try:
        assert fused(q, cos=cos, sin=sin, unsqueeze_dim=2) == "own"
        assert fused(q, None, cos, sin) == "own"
        assert fused(q, q, cos, sin, unsqueeze_dim=2) == "own"
        assert fused(q, k=q, cos=cos, sin=sin) == "own"
        assert fused(q, q, cos, sin) != "own"  # the plain call: the kernel
    finally:
        layers._ROPE_ON.reset(token)
    assert seen == [2, 1, 2, 1]

def test_rope_dispatch_only_inside_a_fused_attention():
    """A switched model's attention takes the kernel; a model of the same class that was not switched (TRL's in
    a benchmark) keeps the eager ops; a RoPE of another formula (an output cast to q's dtype, as OLMo 2's) keeps
    its own function."""
    from transformers.models.llama import modeling_llama

    model, twin = load_model("tiny-random", seed=0, varlen_attention=False), build_tiny("tiny-random", seed=0)
    assert modeling_llama.apply_rotary_pos_emb.posttrain_original is llama_rope()
    calls = []
    real = layers._rope_kernel
    ids = torch.randint(0, twin.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    try:
        layers._rope_kernel = lambda *a: calls.append(1) or real(*a)
        model(ids)
        n_model = len(calls)
        twin(ids)
    finally:
        layers._rope_kernel = real
    assert n_model == 2 * model.config.num_hidden_layers and len(calls) == n_model

    def casting_rope(q, k, cos, sin, unsqueeze_dim=1):
        q2, k2 = llama_rope()(q, k, cos, sin)
        return q2.to(q.dtype), k2.to(k.dtype)

    home = type("module", (), {"apply_rotary_pos_emb": staticmethod(casting_rope)})
    attn = model.model.layers[0].self_attn
    import sys

    sys.modules["posttrain_test_casting_rope"] = home
    try:
        Cls = type("CastingAttention", (type(attn).__mro__[1],), {"__module__": "posttrain_test_casting_rope"})
        assert not layers._rope_agrees(Cls.__new__(Cls), None)
        assert home.apply_rotary_pos_emb is casting_rope
    finally:
        del sys.modules["posttrain_test_casting_rope"]
