"""Fused RMSNorm and SwiGLU for CPU training: one pass forward and one backward instead of eager op chains.

HF's RMSNorm is 6 elementwise ops forward (to-float, pow, mean, add, rsqrt, two muls) and about twice that
backward; its gated MLP's silu(gate) * up is 2 forward and 3 backward, each reading and writing whole
(tokens, features) activations. On a 2-core CPU, in the SFT step of benchmarks/sft_vs_trl.py (SmolLM2-135M,
1024 tokens per forward) they took ~1.1 s of ~10 s. The kernels (csrc/train_kernels.cpp) do the same
arithmetic in one pass each, in parallel over rows:

    RMSNorm (float32 x, w):  r = 1/sqrt(mean(x²) + eps);  out = w·(x·r)
        ∂x = r·(∂out·w) − x·r³·⟨∂out·w, x⟩/D      ∂w = Σ_rows ∂out·(x·r)
    SwiGLU (float32 | bf16): s = silu(g) = g/(1 + e^−g);  h = s·u
        ∂u = ∂h·s      ∂g = (∂h·u)·σ(g)·(1 + g·(1 − σ(g)))

with the eager ops' roundings for bf16 (s and each product rounded), so the values differ from the eager
ones by summation order and exp's last bit only.

`use_fused_layers(model)` gives each RMSNorm and gated-MLP module class of the model a subclass whose forward
takes the kernels where they apply (CPU, plain tensors, float32 RMSNorm input and MLP activations)
and the class's own forward otherwise; isinstance, parameters, state dict and hooks stay. A class is switched
only after its own forward agreed with the fused one, values and gradients, on random input: variants with
another formula (Gemma's (1 + w) norm, a GELU MLP) keep theirs. POSTTRAIN_FUSED_LAYERS=0 turns it off.
"""

from __future__ import annotations

import os

import torch

from posttrain.ops import cpu_kernels

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SUBCLASSES: dict[type, type | None] = {}  # original class -> fused subclass, or None where it disagreed


def _kernels():
    return cpu_kernels.load() if os.environ.get("POSTTRAIN_FUSED_LAYERS", "1") != "0" else None


def _plain_cpu(*ts: torch.Tensor) -> bool:
    return all(type(t) in _PLAIN and t.device.type == "cpu" for t in ts)


# ------------------------------------------------------------------ autograd functions
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        # x (N, D) float32 contiguous, w (D,) -> out (N, D); rstd (N,) saved
        out, rstd = cpu_kernels.load().rmsnorm_fwd(x, w, eps)
        ctx.save_for_backward(x, w, rstd)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        x, w, rstd = ctx.saved_tensors
        gx, gw = cpu_kernels.load().rmsnorm_bwd(go.contiguous(), x, w, rstd)
        return gx if ctx.needs_input_grad[0] else None, gw if ctx.needs_input_grad[1] else None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        # g, u (..., F) one dtype, contiguous -> silu(g) * u
        ctx.save_for_backward(g, u)
        return cpu_kernels.load().swiglu_fwd(g, u)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gh):
        g, u = ctx.saved_tensors
        gg, gu = cpu_kernels.load().swiglu_bwd(gh.contiguous(), g, u)
        return gg, gu


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Fused float32 RMSNorm of x (..., D), or None where the kernel does not apply."""
    if not (x.dtype == w.dtype == torch.float32 and _plain_cpu(x, w) and x.numel() and _kernels() is not None):
        return None
    x2, w = x.reshape(-1, x.shape[-1]).contiguous(), w.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        out = _RMSNorm.apply(x2, w, eps)
    else:
        out = cpu_kernels.load().rmsnorm_fwd(x2, w, eps)[0]
    return out if x.dim() == 2 else out.view(x.shape)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Fused float32 silu(g) * u (one shape), or None where the kernel does not apply. bf16 (autocast) keeps
    the eager ops: there the fused pass measured no faster (2.67 vs 2.41 ms fwd+bwd at (1024, 1536))."""
    if not (g.dtype == u.dtype == torch.float32 and g.shape == u.shape
            and _plain_cpu(g, u) and g.numel() and _kernels() is not None):
        return None
    g, u = g.contiguous(), u.contiguous()
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _SwiGLU.apply(g, u)
    return cpu_kernels.load().swiglu_fwd(g, u)


# ------------------------------------------------------------------ module forwards
def _norm_eps(module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _fused_norm_forward(self, x):
    out = rmsnorm(x, self.weight, _norm_eps(self))
    return super(type(self), self).forward(x) if out is None else out


def _fused_mlp_forward(self, x):
    h = swiglu(self.gate_proj(x), self.up_proj(x))
    return super(type(self), self).forward(x) if h is None else self.down_proj(h)


def _is_norm(module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(w, torch.nn.Parameter) and w.dim() == 1
            and _norm_eps(module) is not None)


def _is_gated_mlp(module) -> bool:
    act = getattr(module, "act_fn", None)
    return (all(isinstance(getattr(module, n, None), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


# ------------------------------------------------------------------ switching a model's classes
_FORWARDS = ((_is_norm, _fused_norm_forward), (_is_gated_mlp, _fused_mlp_forward))


def _agrees(module, sub: type) -> bool:
    """Whether `sub`'s fused forward equals the class's own on random float32 input: values, and gradients
    of the input and the parameters (a formula gate, far above summation-order differences)."""
    params = [p for p in module.parameters() if p.dtype == torch.float32]
    width = params[0].shape[-1] if params else 0
    if not params or len(params) != len(list(module.parameters())) or not _plain_cpu(*params):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, width, generator=gen).requires_grad_(True)
    own, results = type(module), []
    try:
        for cls in (own, sub):
            module.__class__ = cls
            with torch.enable_grad():
                out = module(x)
                grads = torch.autograd.grad(out, [x, *params], torch.ones_like(out), allow_unused=True)
            results.append([out.detach(), *(torch.zeros(()) if g is None else g for g in grads)])
    finally:
        module.__class__ = own
    return all(a.shape == b.shape and bool(((a - b).abs() <= 1e-3 * (1 + a.abs().max())).all()) and bool(torch.isfinite(b).all())
               for a, b in zip(*results))


def _subclass(module, forward) -> type | None:
    cls = type(module)
    if cls not in _SUBCLASSES:
        name = f"Fused{cls.__name__}"
        sub = type(name, (cls,), {"forward": forward, "__module__": __name__, "__qualname__": name})
        _SUBCLASSES[cls] = sub if _agrees(module, sub) else None
        if _SUBCLASSES[cls] is not None:
            globals().setdefault(name, sub)  # picklable by name once a model of this class was switched
    return _SUBCLASSES[cls]


def use_fused_layers(model: torch.nn.Module, enabled: bool = True) -> int:
    """Give the RMSNorm and gated-MLP modules of a CPU model their fused subclasses (enabled=False: back to
    the original classes); returns how many modules changed. A no-op where the kernels cannot be built."""
    if not enabled:
        fused = set(filter(None, _SUBCLASSES.values()))
        changed = [m for m in model.modules() if type(m) in fused]
        for m in changed:
            m.__class__ = type(m).__mro__[1]
        return len(changed)
    if _kernels() is None:
        return 0
    changed = 0
    for module in model.modules():
        if type(module) in _SUBCLASSES.values():
            continue
        for test, forward in _FORWARDS:
            if test(module) and (sub := _subclass(module, forward)) is not None:
                module.__class__ = sub
                changed += 1
                break
    return changed
