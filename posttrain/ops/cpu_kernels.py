"""Fused bf16 CPU kernels for the engine's decode step, with the eager PyTorch ops they replace.

At decode shapes (64 rows x 576) an eager bf16 elementwise op costs ~10 us, mostly fixed overhead;
RMSNorm is 8 such ops and RoPE 4. The kernels in csrc/cpu_kernels.cpp do each in one pass (measured
at 64 rows: RMSNorm 66-80 -> 20-30 us, RoPE of 12 heads 70-100 -> 31-43 us) and reproduce the eager
ops' roundings: RoPE bit for bit; RMSNorm up to its sum of squares, which it adds in another
order than PyTorch's reduction, so a few outputs move by a bf16 ulp (tests bound this).

The extension is compiled on first use with torch.utils.cpp_extension (g++ and ninja; ~30 s on the
2-core CI machine), cached by PyTorch under ~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR), and
keyed by this machine's CPU flags (it is built with -march=native) and by the checkout. If it cannot be built, the
eager ops run instead (one warning). POSTTRAIN_CPU_KERNELS=0 turns the kernels off. Tensors on any
other device (CUDA) always take the eager ops, and never build the extension.

Each function takes the same arguments as its `*_ref` twin and returns the same values.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_module = None
_tried = False


_BUILD_PROTOCOL = b"flock-1"  # in the name: builders that take no flock (older versions) use other directories


def _cpu_tag() -> str:
    """This machine's CPU flags, the shared headers (torch hashes the sources it compiles, not what they include)
    and where the sources are: a new CPU or a changed header builds afresh, and two checkouts keep two builds.
    (One shared build would be rebuilt whenever the other checkout loads it: ninja sees other source paths in the
    build file. Two checkouts running at once then rebuilt each other's extension, minutes each under load.)"""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    where = str(_SOURCE.parent.resolve()).encode()
    headers = b"".join(h.read_bytes() for h in sorted(_SOURCE.parent.glob("*.h")))
    return hashlib.sha1(flags.encode() + headers + _BUILD_PROTOCOL + where).hexdigest()[:8]


def load():
    """The compiled module, or None (disabled, not Linux/x86, or the build failed)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("POSTTRAIN_CPU_KERNELS", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    if shutil.which("ninja") is None:  # the venv's ninja (a dependency) when the venv is not on PATH
        os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    try:
        _module = _build(f"posttrain_cpu_kernels_{_cpu_tag()}")
    except Exception as e:  # any build problem means: use the eager ops
        warnings.warn(f"posttrain: fused CPU kernels unavailable ({type(e).__name__}: {str(e)[:200]}); using eager ops", stacklevel=2)
        _module = None
    return _module


def _build(name: str):
    """Compile (or load the cached build of) the extension, one process at a time.

    torch guards a build with a `lock` file that a killed build leaves behind, and every later load then
    waits on it forever. An flock, which the kernel drops when its holder dies, serializes our builders
    instead; whoever holds it knows any `lock` file left in the directory is stale and removes it. (Every
    builder of this directory takes the flock: `_BUILD_PROTOCOL` is part of its name.) Where the file system
    has no flock (some network mounts), the build runs as torch alone runs it."""
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build

    build_dir = Path(_get_build_directory(name, verbose=False))
    # -fno-trapping-math: FP compares may be if-converted, so loops with clamps vectorize on AVX2 (GCC 12 left the
    # SwiGLU loops scalar there: 2-3x slower than eager; an SFT step -4% with them vectorized, AMD Zen 3). It allows
    # no reassociation or contraction: every element's result is the same.
    parts = ("train_kernels.cpp", "sample_kernel.cpp", "attention_kernel.cpp", "gemm_kernel.cpp", "decode_kernel.cpp",
             "step_kernel.cpp")
    args = dict(name=name, sources=[str(_SOURCE), *(str(_SOURCE.with_name(f)) for f in parts)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
                extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)  # torch's libgomp at run time
    with open(build_dir / "posttrain.flock", "w") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)  # released on close, or by the kernel if this process dies
        except OSError:
            return build(**args)
        stale = build_dir / "lock"
        if stale.exists():
            warnings.warn(f"posttrain: removing {stale}, left by an interrupted build", stacklevel=3)
            stale.unlink(missing_ok=True)
        return build(**args)


def _usable(*ts: torch.Tensor) -> bool:
    """The fused kernels take contiguous-row bf16 CPU tensors only; decided per call from the tensors
    themselves, so CUDA tensors (or fp32 ones) take the eager ops and never trigger the build."""
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in ts) and load() is not None


# ------------------------------------------------------------------ eager references
def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) in float32, cast back, times the weight."""
    h = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # x * rsqrt(mean(x^2) + eps)
    return w * h.to(x.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x (N, heads, D); cos/sin_signed (N, D): x*cos + rotate_half(x)*sin.

    rotate_half(x) = cat(-x2, x1), so rotate_half(x)*sin = cat(x2, x1)*sin_signed with
    sin_signed = cat(-sin1, sin2): no negation pass, and bit-identical to HF."""
    half = x.shape[-1] // 2
    return x * cos.unsqueeze(1) + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed.unsqueeze(1)


# ------------------------------------------------------------------ dispatch (fused for bf16 CPU tensors, eager otherwise)
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and w.is_contiguous() and _usable(x, w):
        return _module.rmsnorm(x, w, eps)
    return rmsnorm_ref(x, w, eps)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """F.silu(g) * u: one pass over bf16 CPU rows (g, u (M, I), each row contiguous: the halves of a gate|up
    output), with eager's exp and roundings (bit for bit); eager elsewhere."""
    if g.dim() == 2 and g.shape == u.shape and _usable(g, u):
        return _module.silu_mul(g, u)
    return F.silu(g) * u


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`rope_ref` in one pass for bf16 or float32 CPU tensors of one dtype (the same roundings: bit for bit)."""
    if (x.dim() == 3 and cos.is_contiguous() and sin_signed.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32)
            and all(t.device.type == "cpu" and t.dtype == x.dtype and t.stride(-1) == 1 for t in (x, cos, sin_signed))
            and load() is not None):
        return _module.rope(x, cos, sin_signed)
    return rope_ref(x, cos, sin_signed)


def sample_plain(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor, chunks: int = 256):
    """(tokens (N,), log-probs (N,)) drawn from softmax(logits / t) by the inverse CDF with `uniforms` (N,):
    `sampling.sample_logits`' plain rows in two passes over the logits (csrc/sample_kernel.cpp), or None
    where the kernel does not run (not a bf16/float32 CPU tensor with contiguous rows, no AVX2, kernels off)."""
    if (logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype not in (torch.bfloat16, torch.float32)
            or logits.stride(1) != 1 or load() is None or not _module.sample_kernel_available()):
        return None
    t = temperature.to(torch.float32).contiguous()
    return tuple(_module.sample_plain(logits, t, uniforms.to(torch.float64).contiguous(), chunks))


def _float_rows(z: torch.Tensor) -> bool:
    """Whether the row kernels (softmax_rows_, exp_rows_) run on `z`: float32 CPU rows, AVX2, kernels built."""
    return (z.dim() == 2 and z.device.type == "cpu" and z.dtype == torch.float32 and z.stride(1) == 1
            and load() is not None and _module.sample_kernel_available())


def softmax_rows_(z: torch.Tensor, targets: torch.Tensor, want_entropy: bool):
    """z (N, V) float32 logits -> (logp (N,), lse (N,), entropy (N,) | None), z overwritten by softmax(z): a max
    pass and two exp passes per row (csrc/sample_kernel.cpp; `logprobs._softmax_in_place` is the eager twin), or
    None where the kernel does not run. p = exp(z − lse) by the exp of `exp_rows_`, as a recomputing backward forms it; the
    sums run in double."""
    if not _float_rows(z):
        return None
    logp, lse, entropy = _module.softmax_rows_(z, targets.to(torch.int64).contiguous(), want_entropy)
    return logp, lse, entropy if want_entropy else None


def exp_rows_(z: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """z (N, V) <- exp(z − shift[:, None]) in place (float32; SLEEF's expf, which may differ from torch.exp by an
    ulp); the eager ops elsewhere."""
    if _float_rows(z) and shift.dtype == torch.float32:
        return _module.exp_rows_(z, shift.contiguous())
    return z.sub_(shift[:, None]).exp_()


def group_attention_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `group_attention` runs for tensors of this device, dtype and head size."""
    return (torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float32) and head_dim % 16 == 0
            and head_dim <= 256 and load() is not None and _module.group_attention_available())


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    member: torch.Tensor, off: torch.Tensor, prompt: torch.Tensor, scale: float, window: int | None,
                    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, pages=None):
    """Decode attention over one layer's group KV visiting only the keys each query sees
    (csrc/attention_kernel.cpp; `group_attention_runs` says where it runs, elsewhere the runner's masked SDPA).

    q (B, H, D), k/v (B, KV, D): the step's queries and new keys/values (heads contiguous); k_cache/v_cache
    (groups, KV, cap, D) contiguous, the new k/v written at `off` (B,); member (n, W) int64: the batch row of
    each of the first n groups' W samples, or -1; prompt (n,) int64: each group's prompt length; window: the
    sliding window or None; cos/sin (B, D) contiguous, q's dtype: `rope`'s rows, q and k rotated as they are read
    (bit for bit `rope` then this), or None where q and k come rotated; pages: None or (k_pages, v_pages (rows, KV,
    D) contiguous, dst (B,) int64): the layer's paged KV, where row n's new k/v (rotated) also go, at row dst[n].
    -> (B, H*D) in q's dtype."""
    q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in (q, k, v))
    return load().group_attention(q, k, v, k_cache, v_cache, member, off, prompt, scale, window or 0, cos, sin,
                                  *(pages or (None, None, None)))


def gemm_runs(w: torch.Tensor) -> bool:
    """Whether `gemm_pack` / `gemm_packed` run for the weight `w`: a 2-d float32 or bf16 CPU tensor, and the kernel
    built (x86-64 with AVX2 and FMA)."""
    return (w.dim() == 2 and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and load() is not None and _module.gemm_kernel_available())


def counter_uniforms(seed: torch.Tensor, sample_index: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """`sampling.counter_uniforms` on contiguous int64 CPU tensors of one size, in one C++ pass (float64 out)."""
    return _module.counter_uniforms(seed, sample_index, step)


def slot_layout(rows: torch.Tensor, positions: torch.Tensor, prompt_len: torch.Tensor, width: int,
                tables: torch.Tensor | None = None, block_size: int = 1):
    """(off (N,), members (groups, width), top, dst (N,) or None) in one C++ call (csrc/step_kernel.cpp; the runner's
    tensor-op twin is `Runner._slot_offsets` + `_members` + `_paged_rows`): where running slot rows[i] at positions[i]
    puts its new KV in its group region, the batch row of each group slot's sample (-1: idle), how far the region
    must reach, and given the block tables (slots, max blocks), the paged row of that KV. Contiguous int64 CPU tensors."""
    off, members, top, dst = _module.slot_layout(rows, positions, prompt_len, width, tables, block_size)
    return off, members, int(top), (dst if tables is not None else None)


def step_kernels_run(device: torch.device) -> bool:
    """Whether the engine's per-step C++ (`record_tokens`, `row_uniforms`, `slot_layout`) runs for
    its state on `device`: the CPU, the kernels built."""
    return torch.device(device).type == "cpu" and load() is not None


def row_uniforms(seed: torch.Tensor, sample_index: torch.Tensor, ngen: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`counter_uniforms(seed[rows], sample_index[rows], ngen[rows])` in one call: contiguous int64 CPU tensors
    (the engine's per-slot state (slots,) and its running slots (N,)) -> (N,) float64."""
    return _module.row_uniforms(seed, sample_index, ngen, rows)


def record_tokens(rows, tok, lp, kept, ngen, ntok, last, out_tok, out_lp, out_kept, stop_ids, max_new, has_stop_str) -> list[int]:
    """The engine's bookkeeping of one draw per running slot in one C++ call (csrc/step_kernel.cpp; its tensor-op
    twin is `Engine._record`): row i's token, log-prob and kept count (N,) go to slot rows[i] of out_tok / out_lp /
    out_kept (slots, L) at completion index ngen[slot]; ngen, ntok, last (slots,) advance; returns the indices i
    whose slot stopped (its token is in stop_ids (slots, k), or ngen reached max_new) or has stop strings to check
    (has_stop_str). Contiguous CPU tensors: int64, float32 for lp / out_lp, int32 out_kept, bool has_stop_str."""
    return _module.record_tokens(rows, tok, lp, kept, ngen, ntok, last, out_tok, out_lp, out_kept, stop_ids, max_new,
                                 has_stop_str).tolist()


def gemm_pack(w: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """w (N, K), float32 or bf16 (widened exactly) -> float32 panels (⌈N/NR⌉, K, NR) for `gemm_packed`
    (csrc/gemm_kernel.cpp; NR = 16 with AVX2, 32 with AVX-512), written into `into` (a previous packing of a
    weight of the same shape) when it fits: a weight sync then re-packs in place. w may be the transposed view
    of a contiguous (K, N) float32 tensor (copied row by row). Only where `gemm_runs(w)`."""
    return _module.gemm_pack(w.detach(), into)


def gemm_bf16_runs(w: torch.Tensor) -> bool:
    """Whether `gemm_pack_bf16` and a bf16 `gemm_packed` run for the weight `w`: a 2-d bf16 CPU tensor with an
    even number of columns, and the kernel built with AVX-512 BF16 (vdpbf16ps)."""
    return (w.dim() == 2 and w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0
            and load() is not None and _module.gemm_bf16_kernel_available())


def gemm_pack_bf16(w: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """w (N, K) bf16 -> bf16 panels of k pairs (⌈N/NR⌉, K/2, NR, 2) for `gemm_packed` with bf16 x (NR = 32), written
    into `into` when it fits (as `gemm_pack`). Only where `gemm_bf16_runs(w)`."""
    return _module.gemm_pack_bf16(w.detach(), into)


def gemm_packed(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """x (M, K) -> x·Wᵀ (+ bias) (+ residual), (M, n), W the (n, K) weight `packed` holds. float32 (`gemm_pack`):
    each output is a float32 FMA chain over k in order, then + bias, then + residual; with bf16 x and residual
    (the engine's widened bf16: panels of bf16 values) the same float32 value rounded once to bf16, what the float32
    call on x.float() then .to(bf16) gives, without those two passes. bf16 (`gemm_pack_bf16`, x and residual bf16):
    a float32 sum over the k pairs in order (vdpbf16ps adds a pair's two exact products to
    the lane), + bias and + residual in float32, rounded once to bf16. Either way the same values for any M and
    thread count, F.linear's values up to the summation order.

    glu (panels of `glu_rows(W)`, W = [gate; up] (2I, K) of bf16 values, bias in the same order, no residual): the
    SwiGLU MLP's h = silu(gate) * up (M, I) from the tile's float32 sums, bit for bit `silu_mul` of the two halves
    of the product rounded to bf16; float32 panels with float32 x return those bf16 values as float32.
    The (M, 2I) gate|up output is never written.

    x may be the transposed view of a contiguous (K, M) float32 tensor (training's ∂W = ∂yᵀ·x: transposed into a
    buffer a chunk of rows at a time, the same values)."""
    return _module.gemm_packed(x, packed, n, bias, residual, glu)


def decode_layers_runs() -> bool:
    """Whether `decode_layers` runs: the kernels built with the packed GEMM (x86-64 with AVX2 and FMA) and the group
    attention (GCC >= 12 or Clang)."""
    return load() is not None and _module.gemm_kernel_available() and _module.group_attention_available()


def decode_plan(layers, widths, glu, eps, windows: list[int]):
    """The weights `decode_layers` runs, held by the C++ side between steps (built again at each weight sync).
    layers[i]: [norm_in w, qkv panels, qkv bias, o panels, o bias, norm_post w, gate|up panels, gate|up bias, down
    panels, down bias] (no bias: an empty tensor); widths[i]: those four linears' output columns; glu[i]: gate|up
    packed for the SwiGLU epilogue; eps: two per layer; windows[i]: layer i's sliding window or 0."""
    return _module.DecodePlan(layers, widths, glu, eps, windows)


def decode_layers(x, plan, cos, sin, k_slot, v_slot, member, off, prompt, scale: float, heads: int, kv_heads: int,
                  head_dim: int, pages=None) -> torch.Tensor:
    """A decode step's Llama-style decoder layers in one call (csrc/decode_kernel.cpp): per layer the kernels
    `runner.Runner._forward` calls on its fast path (RMSNorm, q|k|v `gemm_packed`, `rope`, `group_attention`, o with
    the residual, RMSNorm, gate|up with the SwiGLU epilogue or `swiglu_fwd` / `silu_mul`, down with the residual), in
    that order: the Python loop's result bit for bit. plan: `decode_plan`'s; cos/sin (N, D) the step's RoPE rows;
    k_slot/v_slot (layers, groups, KV, cap, D) and member/off/prompt/scale as `group_attention` takes them; pages:
    None or (k_pages, v_pages (layers, rows, KV, D), dst (N,)), each layer's as `group_attention` takes them. -> x
    after the last layer, before the final norm."""
    return _module.decode_layers(x, plan, cos, sin, k_slot, v_slot, member, off, prompt, scale, heads, kv_heads, head_dim,
                                 *(pages or (None, None, None)))


def decode_step(tokens, positions, plan, k_slot, v_slot, member, off, prompt, scale: float, heads: int, kv_heads: int,
                head_dim: int, pages=None) -> torch.Tensor:
    """A whole decode step's forward in one call (csrc/decode_kernel.cpp): tokens (N,), positions (N,) int64 ->
    logits (N, V). The runner's embedding and RoPE-row gathers, `decode_layers`, the final norm and the LM head, on
    the ends `plan.set_ends` gave (the same kernels: the same values). Other arguments as `decode_layers` takes them."""
    return _module.decode_step(tokens, positions, plan, k_slot, v_slot, member, off, prompt, scale, heads, kv_heads,
                               head_dim, *(pages or (None, None, None)))



def gemm_once(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) · w (N, K)ᵀ (+ bias), float32, for a weight that changes between calls (training): `gemm_pack` into
    this thread's scratch buffer (kept at the largest weight packed so far, outside torch's allocator, as a BLAS
    keeps its packing buffers), then `gemm_packed`; w and x may be transposed views as there. Only where
    `gemm_runs(w)`."""
    return _module.gemm_once(x, w, bias, out)


def glu_rows(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] (2I, ...) rows -> the order `gemm_packed(glu=True)` takes: each panel of NR columns holds NR/2 gate
    rows then the same NR/2 up rows (NR = 32 with AVX-512, 16 with AVX2; 2I a multiple of NR). Works for weights
    (2I, K) and biases (2I,)."""
    half = gemm_panel_width() // 2
    two_i = w.shape[0]
    return w.reshape(2, two_i // 2 // half, half, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def gemm_panel_width() -> int:
    """NR, the output columns of one packed panel (32 with AVX-512, 16 with AVX2; 0 where the kernel is not built)."""
    return _module.gemm_panel_width() if load() is not None else 0

