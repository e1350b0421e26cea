"""Model runner: a compact decoder forward over a paged KV cache, from the HF module's weights.

It holds references to the HF model's modules (a PEFT-wrapped model is unwrapped; its LoRA layers are
read as merged weights, see arch.effective_weight). With pack_weights (the default) it computes from a
packed copy of the linear weights that `refresh_weights()` rebuilds (the engine calls it when the
weights change); without, it reads the modules' weights at every forward. What differs between
architectures (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, olmo2: norms and where they sit,
q/k norm, activation, soft-caps, sliding window per layer, RoPE table per layer, embedding scale) is
resolved once into an `arch.Recipe`; one `_forward` reads it. The math follows transformers'
modeling files: RMSNorm in float32 then cast, RoPE cos/sin from the model's own `inv_freq` and
`attention_scaling` (so rope types with static frequencies match), GQA attention with SDPA (HF's eager
order where scores are soft-capped; decode on CPU through a kernel that visits only the visible keys, in
float32), gated MLP. In fp32 greedy decoding equals HF's token for token
(tested for every family). In bf16 it is not bit-identical: other matmul kernels, the residual add fused
into the matmul (one rounding instead of two), and the fused RMSNorm's sum order move a few values by one
bf16 ulp (the decode attention kernel keeps its probabilities in float32 where SDPA rounds them to bf16);
measured on SmolLM2, the behaviour log-probs differ from an HF bf16 forward by 0.042 nats on
average with or without these fusions.

KV storage: k/v of shape (layers, num_blocks * block_size, kv_heads, head_dim), allocated once;
prefill writes and reads it. Decode attends a contiguous group KV (see `_slot_attend`): per group
slot the shared prompt once and its samples' tokens interleaved, each sample seeing the prompt and its own. Without it (slot_kv_seqs=0) decode
gathers each sequence's blocks with one `index_select` per layer and masks the padding. Sliding-window
layers keep every position's KV (so the prefix cache is unchanged) and mask keys with i - j >= window
in all three attention paths (prefill, group KV, gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.models.device import is_cpu
from posttrain.models.forward import unwrap
from posttrain.ops import cpu_kernels, layers
from posttrain.ops.linear import ENGINE_GEMM, ENGINE_GEMM_BF16, WIDEN_MIN_ROWS, WIDEN_PACKED_BF16
from posttrain.rollout import arch
from posttrain.rollout.arch import effective_weight

SUPPORTED = arch.SUPPORTED  # model_types the runner runs


def check_supported(model, max_model_len: int | None = None) -> None:
    """UserError (naming the model type and the backends that run it) for a model the runner cannot run."""
    _recipe(unwrap(model), max_model_len)


def _recipe(hf, max_model_len: int | None) -> arch.Recipe:
    recipe = arch.resolve(hf, max_model_len)
    arch.check_adapters(hf, recipe.model_type)
    return recipe


class _Norm:
    """An HF RMSNorm module's forward, h = x * rsqrt(mean(x^2) + eps) in float32, then by family kind:
    "llama" w * cast(h) (fused for bf16 CPU tensors, any leading shape; float32 through training's kernel where the
    module runs it, `ops.layers.is_fused`), "gemma" cast(h * (1 + w)),
    "olmo" cast(w * h). Reads the module's live weight (in another compute dtype: its cast, kept by `refresh()`)."""

    def __init__(self, mod, kind: str, dtype: torch.dtype | None = None):
        self.mod, self.kind, self.dtype, self.w = mod, kind, dtype, None
        self.fused = layers.is_fused(mod)  # the module's forward runs the fused float32 kernel: so does the engine
        eps = getattr(mod, "variance_epsilon", None)
        self.eps = mod.eps if eps is None else eps

    @torch.no_grad()
    def refresh(self) -> None:
        """Another compute dtype (fp32 master weights, bf16 compute): the weight cast once per weight change."""
        self.w = None if self.dtype is None else self.mod.weight.to(self.dtype)

    def weight(self) -> torch.Tensor:
        return self.mod.weight if self.w is None else self.w

    def loop_kernel(self, dtype: torch.dtype) -> bool:
        """Whether `__call__` on a 2-d `dtype` x runs one kernel the decode layer loop calls in its place: the bf16
        `cpu_kernels.rmsnorm`, or training's float32 kernel (`layers.rmsnorm`) where the module runs it."""
        w = self.weight()
        if self.kind != "llama" or w.dtype != dtype or not w.is_contiguous() or not is_cpu(w):
            return False
        return dtype == torch.bfloat16 or (dtype == torch.float32 and self.fused and layers.kernels_on())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight()
        if self.kind == "llama":
            if self.fused and (out := layers.rmsnorm(x, w, self.eps)) is not None:  # float32: training's kernel
                return out
            if x.dim() == 2:
                return cpu_kernels.rmsnorm(x, w, self.eps)
            return cpu_kernels.rmsnorm(x.reshape(-1, x.shape[-1]), w, self.eps).view(x.shape)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + w.float())).type_as(x) if self.kind == "gemma" else (w * h).to(x.dtype)


class _Embedding:
    """tokens -> rows of the (effective) embedding weight [* scale cast to its dtype, gemma]. A LoRA'd
    embedding's merged weight is kept by `refresh()` when packing; a plain one is read in place."""

    def __init__(self, mod, scale: float | None, pack: bool, dtype: torch.dtype | None = None):
        self.mod, self.pack, self.w, self.lora = mod, pack, None, arch.is_lora(mod)
        w = mod.weight  # (a LoRA embedding's base weight: same device and dtype)
        self.dtype = dtype or w.dtype
        self.scale = None if scale is None else torch.tensor(scale).to(device=w.device, dtype=self.dtype)

    @torch.no_grad()
    def refresh(self) -> None:
        self.w = effective_weight(self.mod)[0] if self.pack and self.lora else None

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.w if self.w is not None else (effective_weight(self.mod)[0] if self.lora else self.mod.weight)
        x = F.embedding(tokens, w).to(self.dtype)  # rows cast, as from a model loaded in the compute dtype
        return x if self.scale is None else x * self.scale


def _attention(q, k, v, scale: float, mask=None, causal: bool = False, softcap: float | None = None):
    """softmax(q k^T * scale + mask) v over the last two dims: q (..., n, D), k/v (..., L, D); mask bool
    (True = visible) or additive, broadcast to (..., n, L). With `softcap`, HF's eager order: scores
    tanh(s / c) * c before the mask, softmax in float32, cast back (SDPA cannot soft-cap)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        n, L = s.shape[-2:]
        mask = torch.ones(n, L, dtype=torch.bool, device=s.device).tril(L - n)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.matmul(torch.softmax(s, -1, dtype=torch.float32).to(q.dtype), v)


def _residual(lin, a: torch.Tensor, x: torch.Tensor, post) -> torch.Tensor:
    """x + lin(a) (the add fused into the matmul), or x + post(lin(a)) with a post-norm (gemma, olmo2)."""
    return lin(a, residual=x) if post is None else post(lin(a)).add_(x)


class _Linear:
    """x -> concat of `mods`' outputs (e.g. q|k|v, gate|up): one matmul over a packed copy.

    Packed on CPU, float32: posttrain's own panels (`cpu_kernels.gemm_pack`, csrc/gemm_kernel.cpp) where
    `ops.linear.ENGINE_GEMM` chooses it (any x86: 1.2-2x oneDNN's packed linear at 8-64 rows); bf16 on CPUs with
    AVX-512 BF16 and no AMX: bf16 panels for vdpbf16ps (`gemm_pack_bf16`, `ENGINE_GEMM_BF16`; 1.15-1.24x oneDNN's
    packed bf16 linear at 8-64 rows on AMD Zen 4), except on Intel, whose vdpbf16ps runs at half the FMA rate
    (widened, below). On those panels a SiLU MLP's gate|up
    (`swiglu=True`, bf16 or widened bf16) returns silu(gate) * up from the GEMM's epilogue (`self.glu`);
    else the concatenated weight reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`,
    what torch.compile's CPU freezing uses), so no call re-lays it out: at decode shapes (M = 64) bf16/AMX
    matmuls run 1.3-2.7x faster than `x @ W^T`, fp32 ones up to 1.3x. Elsewhere (or if this torch build lacks
    the op): W^T of the concatenation, contiguous (in, out), which MKL runs ~30% faster than F.linear at decode
    sizes. On a CPU without bf16 dot-product instructions (x86 AVX2), or an Intel one without AMX
    (`ops.linear.WIDEN_PACKED_BF16`), a bf16 copy is kept widened to fp32 and run as fp32 GEMMs (bf16 in, bf16
    out, one rounding): twice the bytes, and at decode shapes 2-3x faster than torch's software bf16 GEMM (AMD
    EPYC Zen 3), 1.5-1.6x our vdpbf16ps kernel at 32-64 rows on an Intel Xeon. The copy is rebuilt by
    `refresh()` (the engine calls it when the weights change). Unpacked: reads the modules' weights
    at every call (no extra memory; a LoRA layer's merged weight is recomputed per call)."""

    def __init__(self, mods, pack: bool, batch_hint: int = 64, dtype: torch.dtype | None = None, swiglu: bool = False):
        self.mods, self.pack, self.batch_hint, self.dtype = mods, pack, batch_hint, dtype
        self.lora = [arch.is_lora(m) for m in mods]  # LoRA layers: read merged (arch.effective_weight)
        self.w = self.b = None  # the packed copy: posttrain's panels (self.kind "gemm"), oneDNN blocked, or W^T
        self.kind, self.widen = "wt", False
        # a SiLU-gated MLP's [gate; up]: on posttrain's panels of bf16 values the epilogue returns silu(gate) * up (`self.glu`)
        self.swiglu, self.glu = swiglu, False

    @torch.no_grad()
    def refresh(self) -> None:
        if not self.pack:
            return
        self.glu = False
        wb = [effective_weight(m) for m in self.mods]  # LoRA layers: W + scale * B @ A
        ws, bs = [w for w, _ in wb], [b for _, b in wb]
        w = self._concat(ws)  # (out, in) in the compute dtype
        self.b = None if all(b is None for b in bs) else self._concat(
            [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(bs, ws)])
        # no bf16 dot-product instructions (x86 AVX2), or slow ones (Intel without AMX) and a decode batch of at least
        # WIDEN_MIN_ROWS: the bf16 values kept widened to fp32 and multiplied by fp32 GEMMs, each result rounded to
        # bf16 once (products of bf16 numbers are exact in fp32: the same matmul)
        self.widen = w.dtype == torch.bfloat16 and is_cpu(w) and WIDEN_PACKED_BF16 and self.batch_hint >= WIDEN_MIN_ROWS
        pairs = w.dtype == torch.bfloat16 and not self.widen and ENGINE_GEMM_BF16 and cpu_kernels.gemm_bf16_runs(w)
        if self.widen or pairs:  # the bias is added to float32 sums (before the one bf16 rounding)
            self.b = None if self.b is None else self.b.float()
        into = self.w if self.kind == "gemm" else None  # re-packed in place after a weight change
        if (w.dtype == torch.float32 or self.widen) and ENGINE_GEMM and cpu_kernels.gemm_runs(w):
            w = self._glu_order(w, self.widen)  # the SwiGLU epilogue has bf16 semantics: widened bf16 only
            self.kind, self.w, self.n = "gemm", cpu_kernels.gemm_pack(w, into), w.shape[0]  # bf16 widened while packed
            return
        if pairs:  # bf16 panels of k pairs for vdpbf16ps
            w = self._glu_order(w, True)
            self.kind, self.w, self.n = "gemm", cpu_kernels.gemm_pack_bf16(w, into), w.shape[0]
            return
        w = w.float() if self.widen else w
        blocked = _onednn_pack(w, self.batch_hint)
        self.kind = "onednn" if blocked is not None else "wt"
        self.w = blocked if blocked is not None else w.t().contiguous()

    def _glu_order(self, w, bf16: bool):
        """A SiLU MLP's [gate; up] (bf16 values) in the order of the GEMM's SwiGLU epilogue (`glu_rows`), which
        then returns silu(gate) * up as `silu_mul` computes it from the bf16 gate|up output (`self.glu`)."""
        self.glu = self.swiglu and bf16 and w.shape[0] % cpu_kernels.gemm_panel_width() == 0
        if not self.glu:
            return w
        self.b = None if self.b is None else cpu_kernels.glu_rows(self.b)
        return cpu_kernels.glu_rows(w)

    def __call__(self, x, residual=None):
        """linear(x) (+ residual, fused into the matmul's epilogue where the packed path allows)."""
        if self.widen and self.kind != "gemm":  # bf16 in and out, fp32 GEMM (see refresh; only for a packed copy;
            # posttrain's panels take the bf16 x and residual and round once themselves)
            return self._matmul(x.float(), None if residual is None else residual.float()).to(torch.bfloat16)
        return self._matmul(x, residual)

    def _matmul(self, x, residual):
        if self.kind == "gemm":
            return cpu_kernels.gemm_packed(x, self.w, self.n, self.b, residual, self.glu)
        if self.kind == "onednn":
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual, self.w, self.b, "add")
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.w, self.b, "none", [], "")
        if self.pack:
            out = x @ self.w if self.b is None else torch.addmm(self.b, x, self.w)
        else:
            outs = [F.linear(x, *self._cast(*(effective_weight(m) if lora else (m.weight, getattr(m, "bias", None)))))
                    for m, lora in zip(self.mods, self.lora)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        return out if residual is None else out.add_(residual)

    def _concat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The parts stacked along dim 0 in the compute dtype: each cast while it is copied (one pass per part)."""
        dtype = self.dtype or parts[0].dtype
        if len(parts) == 1:
            return parts[0].to(dtype)
        out = parts[0].new_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype)
        row = 0
        for p in parts:
            out[row : row + p.shape[0]].copy_(p)
            row += p.shape[0]
        return out

    def _cast(self, w: torch.Tensor, b: torch.Tensor | None):
        """(weight, bias) in the compute dtype (a bf16 copy of fp32 master weights: what autocast multiplies)."""
        if self.dtype is None or w.dtype == self.dtype:
            return w, b
        return w.to(self.dtype), None if b is None else b.to(self.dtype)


_PACK_WORKS: dict[torch.dtype, bool] = {}  # whether oneDNN's packed linear ran here, per weight dtype


def _onednn_pack(w: torch.Tensor, batch_hint: int):
    """`w` (out, in) in oneDNN's blocked layout for about `batch_hint` rows, or None off CPU / without the op.

    Chosen by the weight's own device: oneDNN (mkldnn) ops run CPU tensors only, so CUDA weights take
    the W^T path (cuBLAS) and `_Linear.__call__` never reaches torch.ops.mkldnn for them."""
    if not is_cpu(w) or not torch.backends.mkldnn.is_available() or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    if _PACK_WORKS.get(w.dtype) is False:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    if w.dtype not in _PACK_WORKS:  # does the packed linear run in this build? once per dtype, not per weight sync
        try:
            torch.ops.mkldnn._linear_pointwise(w.new_zeros(1, w.shape[1]), packed, None, "none", [], "")
            _PACK_WORKS[w.dtype] = True
        except (AttributeError, RuntimeError, NotImplementedError):
            _PACK_WORKS[w.dtype] = False
    return packed if _PACK_WORKS[w.dtype] else None


def _or(t: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if t is None else t


def _weight(module):
    """A linear module's weight tensor (a LoRA layer's base weight)."""
    return getattr(module, "base_layer", module).weight


class Runner:
    def __init__(self, model, num_blocks: int, block_size: int, max_model_len: int, pack_weights: bool = True,
                 slot_kv_seqs: int = 0, dtype: torch.dtype | None = None):
        hf = unwrap(model)  # a PEFT model's transformers CausalLM, LoRA layers in place
        self.recipe = r = _recipe(hf, max_model_len)
        cfg = hf.config
        self.model = model
        self.layers = hf.model.layers
        self.embed = hf.model.embed_tokens
        # compute dtype: the weights' own, or `dtype` (e.g. bf16 over fp32 master weights: every matrix, norm and
        # embedding row cast when read or packed, the KV cache and activations in it: the same numbers as the
        # model cast to that dtype)
        self.device, self.dtype = self.embed.weight.device, dtype or self.embed.weight.dtype
        self._modules(hf, pack_weights, slot_kv_seqs or 64)  # hint: the decode batch size, the shape that matters
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.n_heads // self.n_kv
        self.block_size, self.num_blocks = block_size, num_blocks
        self.windows = r.windows  # per layer: sliding window or None
        self.window_set = list(dict.fromkeys(r.windows))  # the distinct ones: one mask each per step
        self.rope_of, self.rope_fp32 = r.rope_of, r.family.rope_fp32
        tables = [self._rope_table(t, max_model_len) for t in r.ropes]  # one per layer type (gemma3), else one
        self.cos = torch.stack([c for c, _ in tables])  # (tables, max_len, rotary_dim)
        self.sin_signed = torch.stack([s for _, s in tables])
        self._tables = [(self.cos[t], self.sin_signed[t]) for t in range(len(tables))]  # views, indexed per step
        rotary = self.cos.shape[2]
        self.qk_norm = r.family.qk_norm
        # Llama's path: q and k heads rotated in one (fused) call, straight from the q|k|v projection
        self.fast_qk = self.qk_norm is None and not self.rope_fp32 and rotary == self.head_dim
        shape = (len(self.layers), num_blocks * block_size, self.n_kv, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # group KV (decode attends it without gathering blocks): one contiguous region per group slot of
        # `width` sequences, (layers, group slots, kv, L, D): the group's prompt once at [0, P), then the
        # samples' tokens interleaved: position p >= P of sample m at P + (p - P) * width + m. Width 1 is
        # one region per sequence. L grows (doubling) with the longest group. Off (0 slots): gather blocks.
        self.slot_seqs, self.max_model_len = slot_kv_seqs, max_model_len
        self.k_slot = self.v_slot = None
        # decode attention over the group KV: the fused kernel where it runs, else masked SDPA (`_slot_attend`)
        self.group_kernel = r.attn_softcap is None and cpu_kernels.group_attention_runs(self.device, self.dtype, self.head_dim)
        # the step's bookkeeping in C++ (slot layout and paged rows; the engine's draw records): each small tensor op it
        # replaces costs tens of microseconds in a decode step. False: their tensor-op twins, as on other devices.
        self.step_kernels = cpu_kernels.step_kernels_run(self.device)
        # decode over the group KV with every layer in one C++ call where the model allows (`_loop_args`)
        self.layer_loop, self._loop = True, None
        self.refresh_weights()  # the packed copies (and `_loop`)
        self.set_width(1)

    def _modules(self, hf, pack: bool, hint: int) -> None:
        """Projections (packed; fused qkv_proj / gate_up_proj as they are), norms per the recipe's family."""
        fam = self.recipe.family

        cast = None if self.dtype == self.embed.weight.dtype else self.dtype

        def lin(mods, swiglu=False):
            return _Linear(mods, pack, hint, cast, swiglu)

        def norm(mod):
            return _Norm(mod, fam.norm, cast)

        def norms(name):
            return [None if name is None else norm(getattr(l, name)) for l in self.layers]

        attn, mlp = [l.self_attn for l in self.layers], [l.mlp for l in self.layers]
        silu = self.recipe.act is F.silu  # bf16 panels: silu(gate) * up in the gate|up GEMM's epilogue
        if fam.fused:
            self.qkv, self.gate_up = [lin([a.qkv_proj]) for a in attn], [lin([m.gate_up_proj], silu) for m in mlp]
        else:
            self.qkv = [lin([a.q_proj, a.k_proj, a.v_proj]) for a in attn]
            self.gate_up = [lin([m.gate_proj, m.up_proj], silu) for m in mlp]
        self.o, self.down = [lin([a.o_proj]) for a in attn], [lin([m.down_proj]) for m in mlp]
        self.lm_head = lin([hf.lm_head])
        self.embedding = _Embedding(self.embed, self.recipe.embed_scale, pack, cast)
        self.attn_in, self.attn_out = norms(fam.attn_in), norms(fam.attn_out)
        self.mlp_in, self.mlp_out = norms(fam.mlp_in), norms(fam.mlp_out)
        self.norm = norm(hf.model.norm)
        self.q_norm = [norm(a.q_norm) for a in attn] if fam.qk_norm else None
        self.k_norm = [norm(a.k_norm) for a in attn] if fam.qk_norm else None
        self.act = self.recipe.act
        self.fused_mlp = [layers.is_fused(m) for m in mlp]  # SiLU-gated MLPs switched to the fused kernel (ops.layers)

    def _rope_table(self, rope: arch.Rope, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed), each (max_len, rotary_dim): HF's emb = cat(freqs, freqs), cos/sin times
        attention_scaling, cast to the model dtype (float32 kept for olmo2); sin_signed = cat(-sin1, sin2)
        (see cpu_kernels.rope_ref)."""
        pos = torch.arange(max_len, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * rope.inv_freq.to(self.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dt = torch.float32 if self.rope_fp32 else self.dtype
        cos, sin = (emb.cos() * rope.scaling).to(dt), (emb.sin() * rope.scaling).to(dt)
        half = sin.shape[1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=1)

    def set_width(self, width: int) -> None:
        """Sequences per group slot (the engine sets it while nothing runs); drops the group KV."""
        self.width = width
        self.k_slot = self.v_slot = None
        self.slot_need = 0  # positions the groups can reach in their regions, at most (`plan_slot_kv`)
        self.prompt_len = torch.ones(max(1, self.slot_seqs // width), dtype=torch.long, device=self.device)  # P per group slot

    def plan_slot_kv(self, need: int) -> None:
        """A joining group's region reaches at most `need` positions (its P + width x the tokens it may still feed):
        the group KV then grows by doubling as decode reaches further, but never past the largest such need
        (doubling alone overshoots the longest sequence by up to 2x: memory that nothing would ever use)."""
        self.slot_need = max(self.slot_need, need)

    def _ensure_slot_kv(self, L: int) -> None:
        cap = 0 if self.k_slot is None else self.k_slot.shape[3]
        if L <= cap:
            return
        new_cap = min(self.width * self.max_model_len, max(L, 2 * cap, 64))
        if L <= self.slot_need:  # an underestimate (L past it) falls back to doubling: never a growth per step
            new_cap = min(new_cap, self.slot_need)
        shape = (len(self.layers), self.slot_seqs // self.width, self.n_kv, new_cap, self.head_dim)
        k, v = torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device)
        if cap:
            k[:, :, :, :cap], v[:, :, :, :cap] = self.k_slot, self.v_slot
        self.k_slot, self.v_slot = k, v

    @torch.inference_mode()
    def load_groups(self, groups: list[tuple[int, list[int], int]]) -> None:
        """(group slot, block table, prompt tokens) of groups joining decode: copy the prompt KV from the
        paged cache into the group slot's region, once per group slot."""
        if not self.slot_seqs or not groups:
            return
        self._ensure_slot_kv(max(n for *_, n in groups) + self.width)
        bs = self.block_size
        for gs, table, n in groups:
            idx = torch.tensor([table[j // bs] * bs + j % bs for j in range(n)], device=self.device)
            self.k_slot[:, gs, :, :n] = self.k_cache[:, idx].transpose(1, 2)
            self.v_slot[:, gs, :, :n] = self.v_cache[:, idx].transpose(1, 2)
            self.prompt_len[gs] = n

    def refresh_weights(self) -> None:
        """Rebuild the packed weight copies (LoRA layers merged) and cast norm weights from the model's current weights."""
        norms = (*self.attn_in, *self.attn_out, *self.mlp_in, *self.mlp_out, self.norm, *(self.q_norm or ()),
                 *(self.k_norm or ()))
        for part in (*self.qkv, *self.o, *self.gate_up, *self.down, self.lm_head, self.embedding, *norms):
            if part is not None:  # a family without that norm
                part.refresh()
        self._loop = self._loop_args()
        self._ends = self._loop is not None and self._set_ends(self._loop)

    def _set_ends(self, plan) -> bool:
        """Give the plan the step's two ends for `cpu_kernels.decode_step` where they compute what `embedding`, the RoPE
        rows, `norm` and `logits` would: the embedding read in place (its rows cast to the compute dtype as `embedding`
        casts them; no scale, no LoRA merged per call), the final norm on the loop's kernel, the LM head on the packed
        GEMM without a soft-cap.
        -> whether it did."""
        e, head, (cos, sin) = self.embedding, self.lm_head, self._tables[0]
        w = e.w if e.w is not None else (None if e.lora else e.mod.weight)
        if (w is None or e.scale is not None or self.norm is None
                or not self.norm.loop_kernel(self.dtype) or head.kind != "gemm" or head.glu
                or self.recipe.final_softcap is not None):
            return False
        plan.set_ends(w, cos, sin, self.norm.weight(), float(self.norm.eps), head.w, _or(head.b, torch.empty(0)), head.n)
        return True

    def _loop_args(self):
        """The `cpu_kernels.decode_plan` (layer weights, widths, glu, eps, windows) for `decode_layers`, or None where a
        layer needs something it does not do: Llama-style pre-norm layers (RMSNorm, no post-norms, no q/k norm, RoPE
        on whole heads, one RoPE table), the group-KV attention kernel, every linear on posttrain's packed GEMM, SiLU-gated MLPs, and each
        norm and SwiGLU on the kernel `__call__` / `_gated` would run (so the loop computes what they compute)."""
        r, dt = self.recipe, self.dtype
        if not (self.slot_seqs and self.group_kernel and self.fast_qk and len(self._tables) == 1 and r.act is F.silu
                and dt in (torch.bfloat16, torch.float32) and cpu_kernels.decode_layers_runs()):
            return None
        empty = torch.empty(0)
        parts, widths, glu, eps = [], [], [], []
        for i in range(len(self.layers)):
            norms, lins = (self.attn_in[i], self.mlp_in[i]), (self.qkv[i], self.o[i], self.gate_up[i], self.down[i])
            if (self.attn_out[i] is not None or self.mlp_out[i] is not None or any(lin.kind != "gemm" for lin in lins)
                    or any(n is None or not n.loop_kernel(dt) for n in norms)):
                return None
            if not lins[2].glu and dt == torch.float32 and not (self.fused_mlp[i] and layers.kernels_on()):
                return None  # float32 SwiGLU: training's kernel where the module runs it, else eager (`_gated`)
            parts.append([norms[0].weight(), lins[0].w, _or(lins[0].b, empty), lins[1].w, _or(lins[1].b, empty),
                          norms[1].weight(), lins[2].w, _or(lins[2].b, empty), lins[3].w, _or(lins[3].b, empty)])
            widths.append([lin.n for lin in lins])
            glu.append(lins[2].glu)
            eps += [float(norms[0].eps), float(norms[1].eps)]
        return cpu_kernels.decode_plan(parts, widths, glu, eps, [w or 0 for w in self.windows])

    def memory_bytes(self) -> int:
        """What the runner allocates beside the model: the paged KV cache and the packed weight copies."""
        kv = self.k_cache.numel() * self.k_cache.element_size() * 2
        packed = sum(_weight(m).numel() * (4 if lin.widen else self.dtype.itemsize)  # widened: bf16 values as fp32
                     for lin in (*self.qkv, *self.o, *self.gate_up, *self.down, self.lm_head) if lin.pack for m in lin.mods)
        return kv + packed

    @staticmethod
    def kv_bytes_per_token(model, dtype=None) -> int:
        cfg = unwrap(model).config
        arch.check_type(cfg)  # the engine sizes its cache first: refuse an unknown architecture before reading its shape
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        el = (dtype or next(model.parameters()).dtype).itemsize
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * el

    # ------------------------------------------------------------ KV helpers
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        bs = self.block_size
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in (self.k_cache, self.v_cache):
            view = cache.view(cache.shape[0], self.num_blocks, bs, self.n_kv, self.head_dim)
            view[:, dst] = view[:, src]

    def _gather(self, cache_l: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """cache_l (slots, kv, D), tables (B, nb) -> (B, kv, nb*bs, D)."""
        B, nb = tables.shape
        blocks = cache_l.view(self.num_blocks, self.block_size, self.n_kv, self.head_dim)
        return blocks.index_select(0, tables.reshape(-1)).view(B, nb * self.block_size, self.n_kv, self.head_dim).transpose(1, 2)

    # ------------------------------------------------------------ forward
    def _forward(self, tokens, positions, slots, attend) -> torch.Tensor:
        """tokens/positions (N,) -> final hidden (N, H). `attend(layer, q, k, v)` -> (N, heads*D);
        k/v (N, kv_heads, D) are the new tokens' keys/values, already written to the paged cache at
        `slots` (N,) unless slots is None (decode over the group KV, which writes its own)."""
        x = self.embedding(tokens)
        ropes = [(cos[positions], sin[positions]) for cos, sin in self._tables]  # (N, rotary_dim) per table
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, x, *ropes[self.rope_of[i]])
            if slots is not None:
                self.k_cache[i].index_copy_(0, slots, k)
                self.v_cache[i].index_copy_(0, slots, v)
            x = _residual(self.o[i], attend(i, q, k, v), x, self.attn_out[i])  # x + [post-norm] o_proj(attn)
            h = self._gated(i, self.gate_up[i](x if self.mlp_in[i] is None else self.mlp_in[i](x)))
            x = _residual(self.down[i], h, x, self.mlp_out[i])  # x + down(act(gate) * up)
        return self.norm(x)

    def _gated(self, i: int, gu):
        """act(gate) * up from layer i's gate|up output: the GEMM's epilogue computed it already (`_Linear.glu`); float32
        through training's SwiGLU kernel where layer i's MLP module runs it (same exp), bf16 SiLU through one pass
        with eager's roundings (cpu_kernels.silu_mul)."""
        if self.gate_up[i].glu:
            return gu
        I = gu.shape[1] // 2
        g, u = gu[:, :I], gu[:, I:]
        if self.fused_mlp[i] and (h := layers.swiglu_rows(g, u)) is not None:
            return h
        if self.act is F.silu:
            return cpu_kernels.silu_mul(g, u)
        return self.act(g) * u

    def _qkv(self, i: int, x, cos, sin):
        """Layer i's attention inputs from the residual stream x (N, H): q (N, heads, D), k/v (N, kv_heads, D),
        q/k normed (over all of q / k, or per head) and rotated."""
        N, H, KV, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = self.qkv[i](x if self.attn_in[i] is None else self.attn_in[i](x))
        nq, nk = H * D, KV * D
        v = qkv[:, nq + nk:].view(N, KV, D)
        if self.fast_qk:  # q and k heads at once (fused kernel for bf16 CPU, eager elsewhere)
            qk = cpu_kernels.rope(qkv[:, :nq + nk].view(N, H + KV, D), cos, sin)
            return qk[:, :H], qk[:, H:], v
        q, k = qkv[:, :nq], qkv[:, nq:nq + nk]
        if self.qk_norm == "full":  # olmo2: over the whole projection, before the reshape into heads
            q, k = self.q_norm[i](q), self.k_norm[i](k)
        q, k = q.reshape(N, H, D), k.reshape(N, KV, D)
        if self.qk_norm == "head":  # qwen3, gemma3: over head_dim of each head
            q, k = self.q_norm[i](q), self.k_norm[i](k)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _rope(self, x, cos, sin):
        """x (N, heads, D) rotated on its first rotary_dim = cos.shape[1] dims, the rest passed through
        (partial rotary, phi3); olmo2 rotates in float32 (its cos/sin) and casts back."""
        rd = cos.shape[1]
        if rd < x.shape[-1]:
            return torch.cat((self._rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
        if self.rope_fp32:
            return cpu_kernels.rope_ref(x, cos, sin).to(x.dtype)
        return cpu_kernels.rope(x, cos, sin)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden)
        c = self.recipe.final_softcap
        return out if c is None else torch.tanh(out / c) * c  # gemma: final logit soft-cap

    def _prefill_masks(self, cached: int, L: int) -> dict:
        """{window: bool mask (L - cached, L) of queries at positions cached..L-1 over keys 0..L-1, or None
        for plain causal attention from position 0}; key j visible to query i iff j <= i and i - j < window."""
        qpos = torch.arange(cached, L, device=self.device)[:, None]
        kpos = torch.arange(L, device=self.device)[None, :]
        masks = {}
        for w in self.window_set:
            if cached == 0 and (w is None or w >= L):
                masks[w] = None
            else:
                masks[w] = (kpos <= qpos) if w is None else (kpos <= qpos) & (qpos - kpos < w)
        return masks

    @torch.inference_mode()
    def prefill(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """seqs: (all token ids, tokens already cached, block table). Computes KV of the uncached
        tokens of each and returns the logits at each sequence's last position (S, V)."""
        bs, dev = self.block_size, self.device
        toks, pos, slots, spans = [], [], [], []
        for token_ids, cached, table in seqs:
            L = len(token_ids)
            p = range(cached, L)
            toks.extend(token_ids[cached:])
            pos.extend(p)
            slots.extend(table[j // bs] * bs + j % bs for j in p)
            spans.append((len(toks) - (L - cached), L - cached, L, self._prefill_masks(cached, L)))
        tokens = torch.tensor(toks, device=dev)
        positions = torch.tensor(pos, device=dev)
        tables = [torch.tensor(t, device=dev).unsqueeze(0) for _, _, t in seqs]
        G, scale, cap = self.group, self.recipe.scale, self.recipe.attn_softcap

        def attend(i, q, _k, _v):
            out = []
            for (start, n, L, masks), table in zip(spans, tables):
                qi = q[start:start + n].transpose(0, 1)  # (heads, n, D)
                k = self._gather(self.k_cache[i], table)[0, :, :L].repeat_interleave(G, dim=0)  # (heads, L, D)
                v = self._gather(self.v_cache[i], table)[0, :, :L].repeat_interleave(G, dim=0)
                mask = masks[self.windows[i]]  # None: causal from 0; else query j (position cached + j) sees keys <= cached + j
                o = _attention(qi, k, v, scale, mask, causal=mask is None, softcap=cap)
                out.append(o.transpose(0, 1).reshape(n, -1))
            return torch.cat(out, 0)

        hidden = self._forward(tokens, positions, torch.tensor(slots, device=dev), attend)
        last = torch.tensor([s + n - 1 for s, n, *_ in spans], device=dev)
        return self.logits(hidden[last])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One new token per sequence. tokens/positions/rows (engine slots) (B,), block_tables (slots, max
        blocks) block ids of every engine slot -> logits (B, V). With the group KV, decode attends there and the
        new KV also goes to its paged row (the prefix cache holds a finished sequence's KV without a copy)."""
        if self.layer_loop and self._loop is not None:  # (only where decode runs over the group KV)
            if self._ends:  # the embedding and the LM head in the same C++ call
                return self._decode_layers(tokens, positions, rows, block_tables, cpu_kernels.decode_step)
            return self.logits(self.norm(self._decode_layers(tokens, positions, rows, block_tables)))
        if self.slot_seqs:
            return self.logits(self._forward(tokens, positions, None, self._slot_attend(positions, rows, block_tables)))
        bs, B = self.block_size, tokens.shape[0]
        tables = block_tables[rows, :int(positions.max()) // bs + 1]  # (B, nb)
        slots = self._paged_rows(positions, rows, block_tables)
        T = tables.shape[1] * bs
        kpos, qpos = torch.arange(T, device=self.device)[None, :], positions[:, None]
        masks = {w: ((kpos <= qpos) if w is None else (kpos <= qpos) & (qpos - kpos < w)).view(B, 1, 1, T)
                 for w in self.window_set}
        scale, cap = self.recipe.scale, self.recipe.attn_softcap

        def attend(i, q, _k, _v):
            q = q.reshape(B, self.n_kv, self.group, self.head_dim)  # the G query heads of a KV head as G rows
            k, v = self._gather(self.k_cache[i], tables), self._gather(self.v_cache[i], tables)
            return _attention(q, k, v, scale, masks[self.windows[i]], softcap=cap).reshape(B, -1)

        return self.logits(self._forward(tokens, positions, slots, attend))

    def _slot_masks(self, positions, rows, last, ngs: int, L: int) -> dict:
        """{window: additive mask (ngs, 1, W*G, L)} over the group KV: key o is visible to slot s iff o < P
        (prompt) or it is s's own token ((o - P) % W == s % W and o <= last[s]), and, with a window, its
        position (o, or P + (o - P) // W) is within the window of s's position. Idle slots see key 0."""
        W, G, S = self.width, self.group, ngs * self.width
        o = torch.arange(L, device=self.device)
        P_s = self.prompt_len[:ngs].repeat_interleave(W).unsqueeze(1)  # (S, 1)
        own = ((o - P_s) % W == (torch.arange(S, device=self.device) % W).unsqueeze(1)) & (o <= last.unsqueeze(1))
        vis = (o < P_s) | own
        if self.window_set == [None]:
            vis[:, 0] = True  # idle slots: something finite (live ones see key 0, their prompt's first token, anyway)
        else:
            vis[:, 0] |= last < 0  # only idle slots: key 0 may lie outside a live slot's window
            kpos = torch.where(o < P_s, o, P_s + torch.div(o - P_s, W, rounding_mode="floor"))  # (S, L) key positions
            qpos = torch.zeros(S, dtype=torch.long, device=self.device).index_copy_(0, rows, positions).unsqueeze(1)
        masks = {}
        for w in self.window_set:
            v = vis if w is None else vis & (qpos - kpos < w)
            m = torch.zeros(S, L, dtype=self.dtype, device=self.device).masked_fill_(~v, float("-inf"))
            masks[w] = m.view(ngs, W, 1, L).expand(ngs, W, G, L).reshape(ngs, 1, W * G, L)
        return masks

    def _slot_attend(self, positions, rows, tables):
        """Decode attention over the group KV. Group slot g holds its prompt's P keys once, then its `width`
        samples' tokens interleaved (sample m's j-th token at P + j*W + m); sample m sees the prompt and its
        own tokens. The new k/v go to `off` first. Where the fused kernel runs (CPU, bf16/fp32, no soft-cap),
        it visits only the keys each query sees (`cpu_kernels.group_attention`); elsewhere one masked SDPA
        call covers every group (`_masked_slot_attend`). Either way the new k/v also go to their paged rows."""
        if self.group_kernel:
            off, member, dst = self._slot_layout(positions, rows, tables)
            prompt, scale = self.prompt_len[:member.shape[0]], self.recipe.scale
            return lambda i, q, k, v: cpu_kernels.group_attention(
                q, k, v, self.k_slot[i], self.v_slot[i], member, off, prompt, scale, self.windows[i],
                pages=(self.k_cache[i], self.v_cache[i], dst))
        return self._masked_slot_attend(positions, rows, *self._slot_offsets(positions, rows),
                                        self._paged_rows(positions, rows, tables))

    def _slot_offsets(self, positions, rows) -> tuple[torch.Tensor, int]:
        """(off (B,): where each row's new token goes in its group region, the group slots in use); the region
        grown to hold them."""
        W = self.width
        gs = rows // W
        P = self.prompt_len[gs]
        off = P + (positions - P) * W + rows % W
        ngs = int(gs.max()) + 1
        self._ensure_slot_kv(int(off.max()) + 1)
        return off, ngs

    def _paged_rows(self, positions, rows, tables) -> torch.Tensor:
        """(B,) the paged KV row of each row's new token: its block (tables (slots, max blocks)) * block + offset."""
        bs = self.block_size
        return tables[rows, positions // bs] * bs + positions % bs

    def _slot_layout(self, positions, rows, tables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(off (B,), members (group slots in use, W), dst (B,)) for the group-attention kernel, the region grown to
        hold them: `_slot_offsets`, `_members` and `_paged_rows` in one C++ call where the kernels run (each small
        tensor op costs tens of microseconds in a decode step)."""
        if self.step_kernels:
            off, members, top, dst = cpu_kernels.slot_layout(rows, positions, self.prompt_len, self.width, tables,
                                                             self.block_size)
            self._ensure_slot_kv(top)
            return off, members, dst
        off, ngs = self._slot_offsets(positions, rows)
        return off, self._members(rows, ngs), self._paged_rows(positions, rows, tables)

    def _members(self, rows, ngs: int) -> torch.Tensor:
        """(ngs, W) int64: the batch row of each group slot's sample, -1 where the slot is idle."""
        return torch.full((ngs * self.width,), -1, dtype=torch.long, device=self.device).index_copy_(
            0, rows, torch.arange(rows.shape[0], device=self.device)).view(ngs, self.width)

    def _decode_layers(self, tokens, positions, rows, tables, step=None) -> torch.Tensor:
        """`_forward`'s layers over the group KV in one C++ call (`cpu_kernels.decode_layers`, see `_loop_args`): the
        same kernels on the same tensors in the same order, without the interpreter between them. With
        step=`cpu_kernels.decode_step` (the plan has its ends): from the tokens to the logits in that call."""
        off, members, dst = self._slot_layout(positions, rows, tables)
        rest = (self.k_slot, self.v_slot, members, off, self.prompt_len[:members.shape[0]], self.recipe.scale,
                self.n_heads, self.n_kv, self.head_dim)
        if step is not None:
            return step(tokens, positions, self._loop, *rest, pages=(self.k_cache, self.v_cache, dst))
        cos, sin = self._tables[0]
        return cpu_kernels.decode_layers(self.embedding(tokens), self._loop, cos[positions], sin[positions], *rest,
                                         pages=(self.k_cache, self.v_cache, dst))

    def _masked_slot_attend(self, positions, rows, off, ngs: int, dst):
        """One SDPA call per layer, one task per (group slot, KV head): queries of a group slot are its
        `width` sequences x the G query heads of each KV head, (W*G, D); keys the region's first P + W*(t+1)
        entries, with an additive mask (`_slot_masks`). A group of 8 samples thus reads its prompt once instead
        of 8 times, in 8x fewer, larger tasks (CPU flash attention pays a fixed cost per task), but meets every
        sample's keys. Queries go into slot order (idle slots in range see finite garbage, then dropped)."""
        W, G, kv, D = self.width, self.group, self.n_kv, self.head_dim
        gs, S = rows // W, ngs * W
        ident = S == rows.shape[0] and bool((rows == torch.arange(S, device=self.device)).all())  # rows are slots 0..S-1
        last = torch.full((S,), -1, dtype=torch.long, device=self.device).index_copy_(0, rows, off)  # idle: -1
        L = int(last.max()) + 1
        masks = self._slot_masks(positions, rows, last, ngs, L)
        scale, cap = self.recipe.scale, self.recipe.attn_softcap

        def attend(i, q, k, v):
            self.k_slot[i, gs, :, off] = k
            self.v_slot[i, gs, :, off] = v
            self.k_cache[i, dst], self.v_cache[i, dst] = k, v  # the paged rows (the prefix cache's copy)
            q = q.reshape(-1, kv, G, D)
            qs = q if ident else q.new_zeros(S, kv, G, D).index_copy_(0, rows, q)
            qs = qs.view(ngs, W, kv, G, D).transpose(1, 2).reshape(ngs, kv, W * G, D)
            o_ = _attention(qs, self.k_slot[i, :ngs, :, :L], self.v_slot[i, :ngs, :, :L], scale, masks[self.windows[i]], softcap=cap)
            o_ = o_.view(ngs, kv, W, G, D).transpose(1, 2).reshape(S, -1)
            return o_ if ident else o_[rows]

        return attend
