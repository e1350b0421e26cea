"""Fused RMSNorm, SwiGLU and RoPE for CPU training: one pass forward and one backward instead of eager op chains.

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

RoPE in training is HF's `apply_rotary_pos_emb`: q·cos + rotate_half(q)·sin, with rotate_half(q) = cat(−q₂, q₁),
about 5 eager ops forward per tensor and twice that backward (slices whose backward each fill a zero tensor).
The kernel does it in one pass each way, float32 or bf16 q with float32 cos/sin (fp32 training, and bf16
autocast, where q·cos promotes to float32), bit for bit what the eager ops give:

    y₁ = q₁c₁ − q₂s₁,  y₂ = q₂c₂ + q₁s₂          ∂q₁ = ∂y₁c₁ + ∂y₂s₂,  ∂q₂ = ∂y₂c₂ − ∂y₁s₁

`use_fused_layers(model)` gives each RMSNorm and gated-MLP module class of the model a subclass whose forward
takes the kernels where they apply (CPU, plain tensors, float32 RMSNorm input and MLP activations)
and the class's own forward otherwise; isinstance, parameters, state dict and hooks stay. A class is switched
only after its own forward agreed with the fused one, values and gradients, on random input: variants with
another formula (Gemma's (1 + w) norm, a GELU MLP) keep theirs. Attention classes get a subclass whose forward
runs the class's own with the fused RoPE turned on: their modeling module's `apply_rotary_pos_emb` is replaced
by a dispatcher that takes the kernel only inside such a forward (other models of the same class, TRL's in a
benchmark say, keep the eager ops) and only after it gave exactly the module's own results on random input
(an interleaved or partial rotary keeps its own). POSTTRAIN_FUSED_LAYERS=0 turns all of it off.
"""

from __future__ import annotations

import contextvars
import functools
import os
import sys

import torch

from posttrain.ops import cpu_kernels

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SUBCLASSES: dict[type, type | None] = {}  # original class -> fused subclass, or None where it disagreed
_ROPE_ON = contextvars.ContextVar("posttrain_fused_rope", default=False)  # inside a fused attention's forward


def _kernels():
    return cpu_kernels.load() if os.environ.get("POSTTRAIN_FUSED_LAYERS", "1") != "0" else None


def kernels_on() -> bool:
    """Whether the fused float32 kernels run (built, and not turned off with POSTTRAIN_FUSED_LAYERS=0)."""
    return _kernels() is not None


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


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        # x (B, H, T, D) float32 | bf16, cos/sin (B | 1, T, D) float32 -> float32 (B, H, T, D), (B, T, H, D) memory
        ctx.save_for_backward(cos, sin)
        ctx.bf16 = x.dtype == torch.bfloat16
        return cpu_kernels.load().rope_fwd(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        cos, sin = ctx.saved_tensors
        gy = gy if gy.dtype == torch.float32 and gy.stride(-1) == 1 else gy.float().contiguous()
        return cpu_kernels.load().rope_bwd(gy, cos, sin, ctx.bf16), None, None


def _rope_shapes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x (B, H, T, D), D even, last dimension contiguous; cos/sin (B | 1, T, D)."""
    return (x.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape and cos.shape[0] in (1, x.shape[0])
            and cos.shape[1:] == x.shape[2:] and x.shape[-1] % 2 == 0 and x.stride(-1) == 1 and x.numel() > 0)


def _rope_applies(x, cos, sin) -> bool:
    tensors = all(isinstance(t, torch.Tensor) for t in (x, cos, sin))
    return (tensors and x.dtype in (torch.float32, torch.bfloat16) and cos.dtype == sin.dtype == torch.float32
            and _rope_shapes(x, cos, sin) and not (cos.requires_grad or sin.requires_grad)
            and _plain_cpu(x, cos, sin) and _kernels() is not None)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """HF's x·cos + rotate_half(x)·sin for x (B, H, T, D) and cos/sin (B | 1, T, D) (float32, the result float32,
    laid out (B, T, H, D) in memory as the eager ops lay out HF's q, a transposed view), or None where the kernel
    does not apply. Differentiable once (its backward is not itself differentiable)."""
    return _rope_kernel(x, cos.contiguous(), sin.contiguous()) if _rope_applies(x, cos, sin) else None


def _rope_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope` once `_rope_applies` held (cos/sin contiguous): a graph only where x needs gradients."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RoPE.apply(x, cos, sin)
    return cpu_kernels.load().rope_fwd(x, cos, sin)


def _rope_dispatch(original):
    """A modeling module's `apply_rotary_pos_emb` that takes the kernel inside a fused attention's forward for
    the plain call (q, k, cos, sin[, unsqueeze_dim=1]) where it applies, and `original` for anything else."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(*args, **kwargs):
        if (_ROPE_ON.get() and len(args) == 4 and set(kwargs) <= {"unsqueeze_dim"} and kwargs.get("unsqueeze_dim", 1) == 1
                and _rope_applies(args[0], args[2], args[3]) and _rope_applies(args[1], args[2], args[3])):
            q, k, cos, sin = args
            cos, sin = cos.contiguous(), sin.contiguous()
            return _rope_kernel(q, cos, sin), _rope_kernel(k, cos, sin)  # checked above: not again per tensor
        return original(*args, **kwargs)

    apply_rotary_pos_emb.posttrain_original = original
    return apply_rotary_pos_emb


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
def _fused_attention_forward(self, *args, **kwargs):
    token = _ROPE_ON.set(True)
    try:
        return super(type(self), self).forward(*args, **kwargs)
    finally:
        _ROPE_ON.reset(token)


def _norm_eps(module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _fused_norm_forward(self, x):
    out = rmsnorm(x, self.weight, _norm_eps(self))
    return super(type(self), self).forward(x) if out is None else out


def _fused_mlp_forward(self, x):
    g, u = self.gate_proj(x), self.up_proj(x)
    h = swiglu(g, u)
    if h is None:  # bf16 (autocast) and other cases the kernel leaves: the same formula in eager ops (the class
        h = self.act_fn(g) * u  # agreed with down(silu(gate(x)) * up(x)) when it was switched), g and u computed once
    return self.down_proj(h)


def _is_norm(module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(w, torch.nn.Parameter) and w.dim() == 1
            and _norm_eps(module) is not None)


def _is_gated_mlp(module) -> bool:
    act = getattr(module, "act_fn", None)
    return (all(isinstance(getattr(module, n, None), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def _is_rope_attention(module) -> bool:
    return (type(module).__name__.endswith("Attention") and all(hasattr(module, n) for n in ("q_proj", "k_proj"))
            and callable(getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)))


def _rope_exact(original, fused) -> bool:
    """Whether `fused` (the dispatcher, flag on) gives exactly what `original` gives on random float32 and bf16
    q, k with float32 cos, sin whose halves differ: values, dtypes and the gradients of q and k under random
    output gradients. Exact, not close: the kernel is HF's formula with the same roundings, so anything else
    (another formula, a compiler that fused the products) keeps the module's own function."""
    gen = torch.Generator().manual_seed(0)
    cos, sin = torch.randn(2, 2, 5, 8, generator=gen).unbind(0)
    token = _ROPE_ON.set(True)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            q, k = (torch.randn(2, h, 5, 8, generator=gen).to(dtype).requires_grad_(True) for h in (3, 1))
            up = [torch.randn(2, h, 5, 8, generator=gen) for h in (3, 1)]
            results = []
            for f in (original, fused):
                with torch.enable_grad():
                    out = f(q, k, cos, sin)
                    grads = torch.autograd.grad(out, [q, k], [u.to(o.dtype) for u, o in zip(up, out)])
                results.append([*(o.detach() for o in out), *grads])
            if not all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*results)):
                return False
        return True
    except Exception:  # another signature or formula: the module keeps its own
        return False
    finally:
        _ROPE_ON.reset(token)


def _rope_agrees(module, sub: type) -> bool:
    """Whether the attention module's modeling file computes RoPE as the kernel does; on the first agreement
    the file's `apply_rotary_pos_emb` becomes the dispatcher (`sub`, whose forward turns it on, is not needed)."""
    home = sys.modules[type(module).__module__]
    fn = home.apply_rotary_pos_emb
    if getattr(fn, "posttrain_original", None) is not None:
        return True  # installed after an earlier agreement
    fused = _rope_dispatch(fn)
    if not _rope_exact(fn, fused):
        return False
    home.apply_rotary_pos_emb = fused
    return True


# ------------------------------------------------------------------ switching a model's classes
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


_FORWARDS = ((_is_norm, _fused_norm_forward, _agrees), (_is_gated_mlp, _fused_mlp_forward, _agrees),
             (_is_rope_attention, _fused_attention_forward, _rope_agrees))


def _subclass(module, forward, agrees) -> type | None:
    cls = type(module)
    if cls not in _SUBCLASSES:
        name = f"Fused{cls.__name__}"
        sub = type(name, (cls,), {"forward": forward, "__module__": __name__, "__qualname__": name})
        _SUBCLASSES[cls] = sub if agrees(module, sub) else None
        if _SUBCLASSES[cls] is not None:
            globals().setdefault(name, sub)  # picklable by name once a model of this class was switched
    return _SUBCLASSES[cls]


def is_fused(module) -> bool:
    """Whether the module runs a fused subclass's forward (training computes it with the kernels where they apply):
    the rollout engine then computes the same kernels for it (`rmsnorm`, `swiglu_rows`), so sampler and trainer agree."""
    return module is not None and type(module) in _SUBCLASSES.values()


def swiglu_rows(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """silu(g) * u of 2-d float32 CPU rows with contiguous columns (the halves of a wider tensor, no copies), no
    gradient: `swiglu`'s kernel and exp, or None where it does not apply."""
    if not (g.dim() == 2 and g.dtype == u.dtype == torch.float32 and g.shape == u.shape and g.stride(1) == u.stride(1) == 1
            and _plain_cpu(g, u) and g.numel() and _kernels() is not None):
        return None
    return cpu_kernels.load().swiglu_fwd(g, u)


def use_fused_layers(model: torch.nn.Module, enabled: bool = True) -> int:
    """Give the RMSNorm, gated-MLP and RoPE attention modules of a CPU model their fused subclasses
    (enabled=False: back to the original classes); returns how many modules changed. A no-op where the kernels
    cannot be built."""
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
        for test, forward, agrees in _FORWARDS:
            if test(module) and (sub := _subclass(module, forward, agrees)) is not None:
                module.__class__ = sub
                changed += 1
                break
    return changed
