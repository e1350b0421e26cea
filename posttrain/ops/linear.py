"""CPU training matmuls on the faster kernel: fp32 ones on oneDNN, on posttrain's packed GEMM or on the BLAS behind
`torch.matmul`, bf16 ones natively or as fp32 GEMMs, each chosen by the machine.

PyTorch sends a float32 CPU matmul to its BLAS (MKL in the x86 wheels) and only bf16/fp16 ones to oneDNN.
MKL's fast code paths are Intel's own; on other vendors' CPUs it runs its AVX2 kernels. So on an AMD EPYC
with AVX-512 (Zen 4, 2 threads, 2026-12-02) a 2048³ fp32 matmul ran at 133 GFLOP/s through MKL and 199
through oneDNN, and the shapes of a 135M model's training step (1024 rows × 576/1536 features) at 100-185
against 150-210. On an AMD EPYC with AVX2 only (Zen 3, 2 threads, 2026-12-04), where AVX2 is all either
has, it is the other way round: MKL 179 vs oneDNN 138 at 2048³, MKL 170-185 vs 155-167 at the body's shapes,
and an SFT step (fp32, 4 rows of 512) took 9.8 s against 12.1 s (steps alternating in one process). On an
Intel Xeon (2 threads, 2026-12-02) MKL wins too: 180 vs 167 at 2048³, 10-20% at every body shape and 35% at
the LM head's (473 × 576 · 576 × 49152: 144 vs 106). posttrain's own GEMM (csrc/gemm_kernel.cpp, the rollout
engine's) beats MKL on AMD's AVX2 CPUs: on a Zen 2 (2 threads, 2026-12-05) at a GRPO step's shapes (768 rows)
forward 176-187 GFLOP/s against MKL's 143-149, ∂x 163-183 against 142-153, ∂W 145-159 against 125-146, and
the LM head's forward 154 against 116 and ∂W 160 against 126 (on Zen 3 MKL runs those shapes at 170-185, as fast
as the packed GEMM). So the rule (`POSTTRAIN_FP32_MATMUL=auto`, the default) is: posttrain's GEMM on AMD's
family-23 CPUs (Zen, Zen 2), the BLAS where it is MKL on its fast path (an Intel CPU, or another x86 CPU without
AVX-512), else oneDNN; `posttrain`, `onednn` or `blas` forces one. Where oneDNN or posttrain's GEMM is chosen:

    y   = x·Wᵀ + b     oneDNN (`torch.ops.mkldnn._linear_pointwise`, W dense: no packed copy to keep fresh), or
                       posttrain's GEMM (W packed per call: 2-3% of the GEMM at 768 rows, more with W cold)
    ∂x  = ∂y·W         either (W passed as the strided view Wᵀ: no copy for oneDNN; panels copied from its rows)
    ∂W  = ∂yᵀ·x        posttrain's GEMM where chosen (x's panels from its rows, ∂yᵀ transposed in row chunks),
                       else the BLAS (both operands are activations; oneDNN was no faster there)
    ∂b  = Σ_rows ∂y

posttrain's GEMM sums each output as one FMA chain in k order, so its sums longer than PACKED_MAX_K (the LM
head's ∂x over the vocabulary) run as slices of LONG_SLICE k steps whose partial products are added. Only where
it applies: CPU, float32 input and weight, plain tensors (not DTensor or other subclasses), no autocast (under bf16
autocast PyTorch already calls oneDNN).
Anything else takes `torch.nn.functional.linear` and `torch.matmul`, so CUDA, fp64 (gradcheck) and bf16 paths
are the stock ones. Every kernel sums in fp32; they differ in summation order only (about 1e-6 relative). The
rule depends on the machine only, so a run's numbers repeat on the same machine.

bf16 matmuls (autocast bf16, or bf16 weights) as fp32 GEMMs where those are faster. A bf16 matmul multiplies
bf16 operands, sums the products in fp32 and rounds the sum to bf16. The product of two bf16 numbers is exact
in fp32 (8 + 8 significant bits), so an fp32 GEMM over the same bf16 values, rounded to bf16 at the end, is
that matmul again, up to the summation order:

    y  = bf16( fp32(bf16 x) · fp32(bf16 W)ᵀ + fp32(bf16 b) )     (autocast: x, W, b cast to bf16 first)
    ∂x = bf16( fp32(∂y) · fp32(bf16 W) )          -> x's dtype   (autocast's cast backward)
    ∂W = bf16( fp32(∂y)ᵀ · fp32(bf16 x) )         -> W's dtype
    ∂b = bf16( Σ_rows fp32(∂y) )                   -> b's dtype

On an Intel Xeon whose AMX is not available (2 threads, oneDNN capped at avx512_core_bf16) oneDNN's bf16
GEMM ran at 60-115 GFLOP/s against MKL's fp32 at 130-170 for a 135M model's training shapes (1000 × 576 ·
576 × 1536 and the like): bf16 there is the slower way to compute bf16 numbers. With AMX a bf16 GEMM is ~3-5x
fp32, and on AMD's avx512_bf16 ~2x. Where the CPU has no bf16 dot-product instructions at all (x86 with AVX2
only, e.g. AMD EPYC Zen 3), torch converts bf16 in software: 8-9 GFLOP/s against 34-38 for the fp32 GEMM over
the same values, 4x. So the rule (`POSTTRAIN_BF16_MATMUL=auto`, the default): the fp32 GEMM on an x86 CPU
without bf16 instructions (`_native_bf16`), and on an Intel CPU (MKL the BLAS) without usable AMX (none in
/proc/cpuinfo, or oneDNN capped below it by ONEDNN_MAX_CPU_ISA); `native` or `fp32` forces either. Only for
matmuls of at least MIN_ROWS rows: a few rows
(decoding) read each weight once for little arithmetic, so the fp32 copy (twice the bytes, widened per call)
costs more than the faster GEMM saves. Measured there (no grad, bf16 weights): 8.8x slower at 1 row, 2-3x at
32, 0.7-1.2x at 128, and faster for every shape of the model from 256 rows on (where bf16 is software, the
native matmul loses from ~16 rows on: MIN_ROWS). The rollout engine keeps its
bf16 packed weights for the same reason, except where bf16 is software or an Intel CPU lacks usable AMX
(`WIDEN_PACKED_BF16`: widened once per weight change, not per call). The fp32 GEMMs of this route take the fp32 rule's kernel (posttrain's GEMM on
AMD's Zen 2, whose bf16 is software).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import platform

import torch
import torch.nn.functional as F

from posttrain.ops import cpu_kernels

_POINTWISE = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _usable() -> bool:
    try:
        return _POINTWISE is not None and torch.backends.mkldnn.is_available()
    except RuntimeError:
        return False


def _cpuinfo(key: str) -> str:
    """The value of the first `key` line of /proc/cpuinfo ("" where there is none: no such file, another OS)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[-1] for line in f if line.startswith(key)), "")
    except OSError:
        return ""


def _mkl_on_intel() -> bool:
    """MKL is torch's BLAS and the CPU is Intel's (its fast paths apply)."""
    return _intel() and torch.backends.mkl.is_available()


def _mkl_fast() -> bool:
    """MKL is torch's BLAS and runs its best kernels here: an Intel CPU, or an x86 CPU without AVX-512 (elsewhere
    MKL's AVX2 kernels are all such a CPU has; on AMD's AVX-512 CPUs MKL keeps to AVX2 and oneDNN is faster)."""
    return torch.backends.mkl.is_available() and (_mkl_on_intel() or (_x86() and not _cpu_flag("avx512f")))


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _fp32_kernel(choice: str) -> str:
    """Where fp32 training linears go: "blas" (torch's stock ops), "onednn" or "posttrain" (the packed GEMM of
    csrc/gemm_kernel.cpp: forward, ∂x and ∂W). `auto`: posttrain's GEMM on AMD's family-23 CPUs (Zen, Zen 2: AVX2,
    no AVX-512), where MKL runs well below its speed elsewhere (Zen 2, 2 threads, a GRPO step's shapes, 768-800
    rows: forward 176-187 GFLOP/s against MKL's 143-149, ∂x 163-183 against 142-153, ∂W 145-176 against 125-146);
    MKL on Intel and on other x86 CPUs without AVX-512 (on Zen 3 it ran those shapes at 170-185, as fast as the
    packed GEMM there: not measured in training); oneDNN elsewhere (see `_mkl_fast`)."""
    if choice not in ("auto", "onednn", "blas", "posttrain"):
        raise ValueError(f"POSTTRAIN_FP32_MATMUL must be auto, onednn, blas or posttrain, not {choice!r}")
    if choice != "auto":
        return choice
    if _x86() and not _intel() and _cpuinfo("cpu family").strip() == "23" and _cpu_flag("avx2") and _cpu_flag("fma"):
        return "posttrain"
    return "blas" if _mkl_fast() else "onednn"


def _amx_usable() -> bool:
    """oneDNN may use AMX here: the CPU has it (torch's cpuinfo) and ONEDNN_MAX_CPU_ISA does not cap below it."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa and isa not in ("ALL", "DEFAULT") and "AMX" not in isa:
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def _cpu_flag(flag: str) -> bool:
    return flag in _cpuinfo("flags").split()


def _native_bf16() -> bool:
    """A bf16 matmul has dot-product instructions under it here: avx512_bf16, AMX or avx_ne_convert on x86 (and
    ONEDNN_MAX_CPU_ISA not capped below them), or a CPU that is not x86 (left as it is). Without them (x86 with
    AVX2 only, or AVX-512 without bf16) torch converts bf16 in software: on an AMD EPYC (Zen 3, AVX2) a bf16
    GEMM of a 135M model's training shapes ran at 8-9 GFLOP/s against 34-38 as fp32 GEMMs over the same values."""
    if not _x86():
        return True
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa and isa not in ("ALL", "DEFAULT") and not any(s in isa for s in ("BF16", "AMX", "AVX2_VNNI_2")):
        return False
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe()) or _amx_usable() or _cpu_flag("avx_ne_convert")


def _prefer_fp32_for_bf16(choice: str) -> bool:
    if choice not in ("auto", "native", "fp32"):
        raise ValueError(f"POSTTRAIN_BF16_MATMUL must be auto, native or fp32, not {choice!r}")
    return choice == "fp32" or (choice == "auto" and (not NATIVE_BF16 or (_mkl_on_intel() and not _amx_usable())))


def _engine_gemm_choice(choice: str) -> str:
    if choice not in ("auto", "posttrain", "onednn"):
        raise ValueError(f"POSTTRAIN_ENGINE_GEMM must be auto, posttrain or onednn, not {choice!r}")
    return choice


def _prefer_engine_gemm(choice: str) -> bool:
    """Decode-shaped fp32 GEMMs (1 to a few hundred rows against a packed weight) on posttrain's kernel: `auto` on
    every x86 CPU, where it was measured faster than oneDNN's packed linear (2 threads, SmolLM2-135M's linears in
    decode order): AMD EPYC Zen 3 (AVX2: 8 rows 97-104 GFLOP/s vs 49-58, 32 rows 153-164 vs 105-107, 64 rows 175-180
    vs 123-128, 512 rows 156-164 vs 132-144), Zen 4 (AVX-512: 8 rows 95 vs 90, 32 rows 196 vs 171, 64 rows 208 vs
    195, 512 rows 211 vs 206) and an Intel Xeon with AVX-512 (8 rows 80 vs 65, 32 rows 245 vs 162, 64 rows 279 vs
    197, 512 rows 298 vs 291). The kernel itself runs on any x86-64 with AVX2 and FMA (`cpu_kernels.gemm_runs`)."""
    choice = _engine_gemm_choice(choice)
    return choice == "posttrain" or (choice == "auto" and _x86())


def _prefer_engine_gemm_bf16(choice: str) -> bool:
    """The same for the engine's bf16 linears: posttrain's vdpbf16ps kernel (built where the CPU has AVX-512 BF16,
    `cpu_kernels.gemm_bf16_runs`) instead of oneDNN's packed bf16 linear, unless oneDNN has AMX tiles (8-16x the
    dot-product rate). Measured on AMD EPYC Zen 4 (2 threads, decode order): 8 rows 175 vs 152 GFLOP/s, 32 rows
    366 vs 302, 64 rows 410 vs 330, 512 rows 410 vs 375; a re-pack after a weight change 28 ms vs a 255 ms reorder."""
    choice = _engine_gemm_choice(choice)
    return choice == "posttrain" or (choice == "auto" and _x86() and not _amx_usable())


def _intel() -> bool:
    return "GenuineIntel" in _cpuinfo("vendor_id")


AVAILABLE = _usable()  # this torch build has oneDNN's linear
FP32_KERNEL = _fp32_kernel(os.environ.get("POSTTRAIN_FP32_MATMUL", "auto"))  # fp32 training linears: see there
NATIVE_BF16 = _native_bf16()  # bf16 dot-product instructions (else bf16 matmuls convert in software)
BF16_VIA_FP32 = _prefer_fp32_for_bf16(os.environ.get("POSTTRAIN_BF16_MATMUL", "auto"))  # bf16 matmuls as fp32 GEMMs
# the longest sum (k steps) posttrain's GEMM takes in training: a panel holds NR·K floats (512 KB at 8192 with AVX2,
# an L2's worth: longer ones stream from L3 at every row tile, and its one FMA chain per output sums them all); the
# LM head's ∂x (k = vocabulary) runs in slices (LONG_SLICE), ∂W over more tokens than this on the BLAS
PACKED_MAX_K = 8192
# longer sums (the LM head's ∂x over the vocabulary) on posttrain's GEMM as slices of at most this many k steps, added
# (`_gemm_long`): a 256 KB panel leaves half of the L2 to the rows (Zen 2: 172-176 GFLOP/s; slices of 8192: 151-169)
LONG_SLICE = 4096
# the fewest rows of x (all but its last dim) for which a bf16 matmul takes the fp32 GEMM: 256 over bf16 instructions
# (the module's docstring); 16 where bf16 is software, whose matmuls are far slower from a few rows on (AMD EPYC Zen 2,
# 2 threads, x (M, 576)·W (1536, 576): native time / the fp32 route's 0.12 at 1 row, 0.49 at 8, 2.0 at 32, 6.5 at 192
# without grad; with its backward 1.1 at 1 row, 2.8 at 8, 8.2 at 32, 15 at 192). A training micro-batch under 256
# tokens (a small group, zero_advantage's live groups) ran at 1/15 the speed there before.
MIN_ROWS = 256 if NATIVE_BF16 else 16
# the rollout engine's float32 linears (rollout.runner._Linear) on posttrain's packed GEMM (csrc/gemm_kernel.cpp)
# instead of oneDNN's packed linear: `POSTTRAIN_ENGINE_GEMM=auto|posttrain|onednn` (see `_prefer_engine_gemm`)
ENGINE_GEMM = _prefer_engine_gemm(os.environ.get("POSTTRAIN_ENGINE_GEMM", "auto"))
ENGINE_GEMM_BF16 = _prefer_engine_gemm_bf16(os.environ.get("POSTTRAIN_ENGINE_GEMM", "auto"))  # its bf16 linears too


def _widen_packed_bf16(via_fp32: bool, native: bool) -> bool:
    """The rollout engine's packed bf16 weights kept widened to fp32 panels (rollout.runner._Linear, computed by the
    fp32 kernel), where bf16 matmuls take the fp32 route (`via_fp32`; POSTTRAIN_BF16_MATMUL=native turns it off) and
    either convert bf16 in software (x86 AVX2: at decode shapes, 64 rows, 2-3x slower than fp32) or run vdpbf16ps on
    an Intel CPU without usable AMX. There vdpbf16ps issues every other cycle, half the FMA rate (a Xeon with
    AVX-512 BF16, one core: 86 vs 177 GFLOP/s in a register-only loop), so the fp32 kernel over widened values beats
    the bf16 one from ~20 rows on (WIDEN_MIN_ROWS): SmolLM2-135M's linears in decode order, 2 threads, 32 rows 245
    vs 167 GFLOP/s, 64 rows 279 vs 170."""
    return via_fp32 and (not native or (_intel() and not _amx_usable()))


WIDEN_PACKED_BF16 = _widen_packed_bf16(BF16_VIA_FP32, NATIVE_BF16)
# where bf16 is native but the fp32 kernel is faster (Intel without AMX), the widened copy wins only from about this
# many decode rows on: with fewer, the doubled bytes cost more than the faster arithmetic saves (that Xeon, 2 threads,
# SmolLM2's linears in decode order: 1 row 13 vs 23 GFLOP/s, 8 rows 79 vs 104, 16 rows 124 vs 137, 24 rows 205 vs
# 161). An engine decoding fewer rows at a time (EngineConfig.max_num_seqs) keeps the bf16 panels. Where bf16 is
# software, widening wins from 1 row.
WIDEN_MIN_ROWS = 24 if NATIVE_BF16 else 1


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x·Wᵀ goes to oneDNN or posttrain's GEMM here (see the module's docstring)."""
    return (FP32_KERNEL != "blas" and x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and w.device.type == "cpu" and type(x) in _PLAIN and type(w) in _PLAIN and x.numel() > 0
            and not torch.is_autocast_enabled("cpu"))


def _bf16_operands(x: torch.Tensor, w: torch.Tensor) -> bool:
    """x·Wᵀ is a bf16 matmul: under CPU autocast to bf16 (float32/bf16 operands), or both operands bf16."""
    if torch.is_autocast_enabled("cpu"):
        return (torch.get_autocast_dtype("cpu") == torch.bfloat16
                and x.dtype in (torch.float32, torch.bfloat16) and w.dtype in (torch.float32, torch.bfloat16))
    return x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16


def bf16_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the bf16 matmul x·Wᵀ runs as an fp32 GEMM here (see the module's docstring)."""
    return (BF16_VIA_FP32 and x.device.type == "cpu" and w.device.type == "cpu" and type(x) in _PLAIN
            and type(w) in _PLAIN and _enough_rows(x) and _bf16_operands(x, w))


_ANY_ROWS = contextvars.ContextVar("posttrain_bf16_route_any_rows", default=False)


@contextlib.contextmanager
def route_any_rows():
    """bf16 matmuls of any number of rows take the fp32-GEMM route where it applies, inside the block (this
    thread only): a small probe pass (the planner's memory probe) then holds what the full-size step will hold."""
    token = _ANY_ROWS.set(True)
    try:
        yield
    finally:
        _ANY_ROWS.reset(token)


def _enough_rows(x: torch.Tensor) -> bool:
    """x (..., K) holds at least MIN_ROWS rows (all dims but the last), or route_any_rows() is on; never empty."""
    return x.dim() > 0 and x.numel() > 0 and (_ANY_ROWS.get() or x.numel() >= MIN_ROWS * x.shape[-1])


def _split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t as bf16, the same values as float32): one pass for a contiguous float32 CPU tensor (cpu_kernels)."""
    if t.dtype == torch.bfloat16:
        return t, t.float()
    kernels = cpu_kernels.load() if t.dtype == torch.float32 and t.is_contiguous() else None
    if kernels is None:
        tb = t.to(torch.bfloat16)
        return tb, tb.float()
    return tuple(kernels.bf16_split(t))


def _round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 GEMM result rounded to bf16, in `dtype` (float32 rounded in place where the kernel runs)."""
    if dtype == torch.float32 and t.is_contiguous() and (kernels := cpu_kernels.load()) is not None:
        return kernels.round_bf16_(t)
    return t.to(torch.bfloat16).to(dtype)


class _Widened:
    """`_split` of the last tensor asked for: q/k/v (and gate/up) projections read the same input, forward and
    backward, so it is cast once, not per projection. One entry (the tensor, its version, the split), replaced
    whole, so threads sharing it never read another tensor's split."""

    def __init__(self):
        self.entry = None

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if t.is_inference() or torch.is_inference_mode_enabled():  # no version counter (or a split that could
            return _split(t)  # not be saved for a backward later): not kept
        entry = self.entry
        if entry is not None and entry[0] is t and entry[1] == t._version:
            return entry[2]
        split = _split(t)
        self.entry = (t, t._version, split)
        return split


_FORWARD_INPUT, _SAVED_INPUT = _Widened(), _Widened()


def forget_casts() -> None:
    """Drop the kept input casts (a memory probe's pass then neither frees nor keeps another pass's)."""
    _FORWARD_INPUT.entry = _SAVED_INPUT.entry = None


def _bf16_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """(x as bf16 (..., K), W's bf16 values to save, y = bf16(x·Wᵀ + b) shaped (..., N)) through an fp32 GEMM,
    autocast off. A trained float32 weight's values are saved widened (as the GEMMs take them): the backward
    does not widen them again, for twice the bytes of the bf16 cast until then; a frozen one's (LoRA's base
    weights) stay that bf16 cast, and a bf16 weight saves itself (no copy)."""
    xb, xr = _FORWARD_INPUT(x)
    wb, wr = _split(w)
    with torch.autocast("cpu", enabled=False):
        y = _gemm(xr.reshape(-1, xr.shape[-1]), wr, None if b is None else _split(b)[1])
    y = y.view(*xr.shape[:-1], wr.shape[0])
    return xb, wr if w.requires_grad and w.dtype != torch.bfloat16 else wb, y.to(torch.bfloat16)


class _Bf16Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        # x (..., K), w (N, K), b (N,) | None -> y (..., N) bf16
        xb, ws, y = _bf16_forward(x, w, b)
        ctx.save_for_backward(xb, ws if ctx.needs_input_grad[0] else None)  # the bf16 operands (W: only for ∂x)
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        xb, ws = ctx.saved_tensors
        xdt, wdt, bdt = ctx.dtypes
        gy2 = gy.reshape(-1, gy.shape[-1]).float()
        with torch.autocast("cpu", enabled=False):
            gx = _round_to(_gemm(gy2, ws.float().t()), xdt).view(*xb.shape[:-1], ws.shape[1]) \
                if ctx.needs_input_grad[0] else None
            gw = _round_to(grad_weight(gy2, _SAVED_INPUT(xb)[1].reshape(-1, xb.shape[-1])), wdt) \
                if ctx.needs_input_grad[1] else None
            gb = _round_to(gy2.sum(0), bdt) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _gemm(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x2 (M, K) · w (N, K)ᵀ (+ b), float32, on FP32_KERNEL's GEMM: posttrain's (w packed per call into a kept
    scratch buffer outside torch's allocator, as a BLAS packs: a transposed view Wᵀ packs by plain row copies),
    oneDNN (w may be a strided view), or F.linear (the BLAS, or where neither kernel runs here)."""
    if _posttrain(w):  # sums longer than PACKED_MAX_K in slices
        return cpu_kernels.gemm_once(x2, w, b) if w.shape[-1] <= PACKED_MAX_K else _gemm_long(x2, w, b)
    if FP32_KERNEL == "onednn" and AVAILABLE:
        return _POINTWISE(x2.contiguous(), w, b, "none", [], "")
    return F.linear(x2, w, b)


def grad_weight(gy2: torch.Tensor, x2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """∂W = ∂yᵀ·x (N, K) for gy2 (M, N), x2 (M, K), float32, written into `out` (contiguous (N, K)) if given:
    posttrain's GEMM (x's panels copied from its rows, ∂yᵀ transposed a chunk of rows at a time into a buffer)
    where it is the fp32 kernel, else the BLAS (oneDNN was no faster there)."""
    if gy2.dtype == x2.dtype == torch.float32 and _packed(x2.t()) and (out is None or out.is_contiguous()):
        return cpu_kernels.gemm_once(gy2.t(), x2.t(), out=out)
    return gy2.t() @ x2 if out is None else torch.mm(gy2.t(), x2, out=out)


def _posttrain(w: torch.Tensor) -> bool:
    """x·wᵀ on posttrain's GEMM: chosen and built here."""
    return FP32_KERNEL == "posttrain" and cpu_kernels.gemm_runs(w)


def _packed(w: torch.Tensor) -> bool:
    """x·wᵀ in one call of posttrain's GEMM: `_posttrain` and w (N, K) with K <= PACKED_MAX_K."""
    return w.shape[-1] <= PACKED_MAX_K and _posttrain(w)


def _gemm_long(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x2 (M, K) · w (N, K)ᵀ (+ b) for K > PACKED_MAX_K (the LM head's ∂x, k over the vocabulary) as a sum of
    packed GEMMs over k slices of at most LONG_SLICE, each one FMA chain: y = Σ_s x[:, s]·w[:, s]ᵀ, the partial
    products added in slice order; x's slices are read in place (rows with a stride). On AMD Zen 2 (2 threads) at
    the LM head's (600 | 1024) × 49152 · 49152 × 576: 172-176 GFLOP/s, MKL's sgemm 148-152."""
    K = w.shape[-1]
    slices = -(-K // LONG_SLICE)
    bounds = [K * i // slices for i in range(slices + 1)]
    y = cpu_kernels.gemm_once(x2[:, : bounds[1]], w[:, : bounds[1]], b)
    for k0, k1 in zip(bounds[1:-1], bounds[2:]):
        y += cpu_kernels.gemm_once(x2[:, k0:k1], w[:, k0:k1])
    return y


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) · b (K, N) -> (M, N): oneDNN or the bf16-as-fp32 GEMM where either applies (b as the strided
    view (bᵀ)ᵀ), else torch.matmul; differentiable."""
    return linear(a, b.t()) if applies(a, b) or bf16_applies(a, b) else a @ b


def _forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as (M, K), y = x·Wᵀ + b shaped (..., N)) on oneDNN or posttrain's GEMM."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2, _gemm(x2, w, b).view(*x.shape[:-1], w.shape[0])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        # x (..., K), w (N, K), b (N,) | None -> y (..., N)
        x2, y = _forward(x, w, b)
        ctx.save_for_backward(x2, w)
        ctx.lead = x.shape[:-1]
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x2, w = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1])
        gx = _gemm(gy2, w.t()).view(*ctx.lead, w.shape[1]) if ctx.needs_input_grad[0] else None
        gw = grad_weight(gy2, x2) if ctx.needs_input_grad[1] else None
        gb = gy2.sum(0) if ctx.needs_input_grad[2] else None  # False for a None bias
        return gx, gw, gb


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear`, differentiable, with its fp32 CPU matmuls on oneDNN where that applies
    and its bf16 ones as fp32 GEMMs where that is faster (without a graph when nothing needs a gradient: no
    autograd node, nothing saved)."""
    plain_b = b is None or type(b) in _PLAIN
    graph = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
    if plain_b and bf16_applies(x, w):
        return _Bf16Linear.apply(x, w, b) if graph else _bf16_forward(x, w, b)[2]
    if not (applies(x, w) and plain_b and (b is None or b.dtype == torch.float32)):
        return F.linear(x, w, b)
    return _Linear.apply(x, w, b) if graph else _forward(x, w, b)[1]


class Linear(torch.nn.Linear):
    """torch.nn.Linear whose forward is `linear` above: same parameters, state dict and isinstance."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_onednn_linears(model: torch.nn.Module, enabled: bool = True) -> int:
    """Turn every plain torch.nn.Linear of `model` into `Linear` in place (the class only: the parameters,
    hooks and state dict stay), or with enabled=False every `Linear` back; returns how many changed.
    Turning on is a no-op where neither rule applies (fp32 on MKL, bf16 natively)."""
    if enabled and not (FP32_KERNEL != "blas" or BF16_VIA_FP32):
        return 0
    src, dst = (torch.nn.Linear, Linear) if enabled else (Linear, torch.nn.Linear)
    changed = 0
    for module in model.modules():
        if type(module) is src:
            module.__class__ = dst
            changed += 1
    return changed
