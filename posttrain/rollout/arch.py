"""What the built-in engine's forward needs to know about one architecture, resolved once from a model.

`resolve(model, max_model_len)` reads a transformers CausalLM (config and modules) and returns a
`Recipe`: everything in which its decoder layer differs from Llama's, so that the runner's single
`_forward` only takes the branches the recipe selects. The math follows transformers 5.x
`models/<type>/modeling_<type>.py`:

| family | layer (x: residual stream) | RMSNorm | extras |
|---|---|---|---|
| llama, qwen2, mistral, phi3 | x + attn(n1(x)); x + mlp(n2(x)) | w * cast(h) | mistral/phi3: `sliding_window` on every layer; qwen2: on `layer_types` "sliding_attention"; phi3: fused qkv_proj / gate_up_proj, partial rotary |
| qwen3 | as llama | w * cast(h) | per-head RMSNorm of q and k (over head_dim) before RoPE |
| gemma2 | x + n2(attn(n1(x))); x + n4(mlp(n3(x))) | cast(h * (1 + w)) | embedding * sqrt(hidden) in the embedding dtype, gelu-tanh, scale query_pre_attn_scalar**-0.5, tanh soft-caps of attention and final logits, sliding/full per layer_types |
| gemma3_text | as gemma2 | cast(h * (1 + w)) | per-head q/k norm, one RoPE table per layer type (local / global base); attention not soft-capped (its modeling file passes no softcap) |
| olmo2 | x + n2(attn(x)); x + n4(mlp(x)) | cast(w * h) | q/k RMSNorm over all heads' q / k before the reshape; RoPE in float32, cast back |

with h = x * rsqrt(mean(x^2) + eps) in float32. Sliding windows follow masking_utils
(`sliding_window_overlay`): key j is visible to query i iff j <= i and i - j < window.

Refused, with the backends that run it (UserError): unknown model types, mixtures of experts,
bidirectional attention, layer types other than full/sliding attention, LoRA variants (DoRA), and RoPE
whose frequencies change within the engine's lengths. "dynamic" RoPE recomputes its frequencies only
past max_position_embeddings and "longrope" switches to its long factors only past
original_max_position_embeddings: below those lengths both are static, so they run when the engine's
max_model_len stays below them (always for dynamic: the engine caps max_model_len at
max_position_embeddings).

LoRA (peft): `effective_weight(module)` is W + sum over active adapters of peft's own delta
(`get_delta_weight`: scale * B @ A), i.e. the weight `merge_and_unload` would write, or the base weight
when adapters are disabled or already merged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from posttrain.errors import UserError


@dataclass(frozen=True)
class Family:
    """Where a family's decoder layer differs from Llama's; norms are named as in its modeling file."""

    attn_in: str | None = "input_layernorm"  # norm before attention (None: olmo2)
    attn_out: str | None = None  # norm of the attention output, before the residual add
    mlp_in: str | None = "post_attention_layernorm"  # norm before the MLP
    mlp_out: str | None = None  # norm of the MLP output, before the residual add
    norm: str = "llama"  # RMSNorm output: "llama" w * cast(h), "gemma" cast(h * (1 + w)), "olmo" cast(w * h)
    qk_norm: str | None = None  # "head": over head_dim of each head; "full": over all of q / k
    fused: bool = False  # qkv_proj and gate_up_proj modules (phi3)
    gemma: bool = False  # embedding * sqrt(hidden), final logit soft-cap
    attn_softcap: bool = False  # tanh soft-cap of attention scores (gemma2)
    windows: str = "none"  # "none" | "all": config.sliding_window on every layer | "layer_types"
    rope_fp32: bool = False  # cos/sin stay float32; q/k rotated in float32 and cast back (olmo2)


_GEMMA = dict(attn_out="post_attention_layernorm", mlp_in="pre_feedforward_layernorm",
              mlp_out="post_feedforward_layernorm", norm="gemma", gemma=True, windows="layer_types")

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(windows="all"),
    "qwen2": Family(windows="layer_types"),
    "qwen3": Family(qk_norm="head", windows="layer_types"),
    "gemma2": Family(**_GEMMA, attn_softcap=True),
    "gemma3_text": Family(**_GEMMA, qk_norm="head"),
    "phi3": Family(fused=True, windows="all"),
    "olmo2": Family(attn_in=None, attn_out="post_attention_layernorm", mlp_in=None,
                    mlp_out="post_feedforward_layernorm", norm="olmo", qk_norm="full", rope_fp32=True),
}
SUPPORTED = tuple(FAMILIES)

# model types vLLM runs (named in refusals; vLLM's registry has more)
VLLM_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3",
    "gemma3_text", "phi", "phi3", "phimoe", "olmo", "olmo2", "olmoe", "deepseek_v2", "deepseek_v3", "gpt2",
    "gpt_neox", "gptj", "gpt_bigcode", "falcon", "starcoder2", "stablelm", "granite", "granitemoe", "internlm2",
    "cohere", "cohere2", "dbrx", "exaone", "jamba", "mamba", "minicpm", "nemotron", "opt", "bloom", "mpt",
    "baichuan", "chatglm", "glm", "glm4", "persimmon", "arctic",
})
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def backends(model_type: str) -> str:
    return "backend=hf or backend=vllm" if model_type in VLLM_TYPES else "backend=hf"


def refuse(model_type: str, why: str) -> UserError:
    return UserError(f"the builtin engine cannot run this '{model_type}' model: {why}; use {backends(model_type)}")


@dataclass(frozen=True)
class Rope:
    """One RoPE table: inverse frequencies (rotary_dim / 2,) float32 and the cos/sin factor."""

    inv_freq: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class Recipe:
    model_type: str
    family: Family
    act: Callable  # MLP activation: the function behind the model's activation module (F.silu, F.gelu tanh, ...)
    scale: float  # attention scores q.k * scale
    attn_softcap: float | None  # scores -> tanh(s / c) * c
    final_softcap: float | None  # logits -> tanh(l / c) * c
    embed_scale: float | None  # embedding * scale, the scale cast to the embedding dtype
    windows: tuple  # per layer: sliding window (keys visible: i - j < window) or None
    rope_of: tuple  # per layer: index into ropes
    ropes: tuple  # of Rope


def resolve(model, max_model_len: int | None = None) -> Recipe:
    """The recipe of a transformers CausalLM (unwrapped from PEFT); UserError for what the engine cannot run.
    `max_model_len`: the longest sequence the engine will hold (default: max_position_embeddings)."""
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    check_type(cfg)
    fam = FAMILIES[mt]
    if getattr(cfg, "use_bidirectional_attention", False):
        raise refuse(mt, "bidirectional attention")
    n = cfg.num_hidden_layers
    max_len = max_model_len or getattr(cfg, "max_position_embeddings", None) or 0
    ropes, rope_of = _ropes(model.model.rotary_emb, cfg, mt, max_len)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    act = _plain(getattr(mlp, "act_fn", None) or mlp.activation_fn)
    cap = getattr(cfg, "final_logit_softcapping", None) if fam.gemma else None
    return Recipe(
        model_type=mt, family=fam, act=act,
        scale=float(getattr(attn, "scaling", attn.head_dim ** -0.5)),
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if fam.attn_softcap else None,
        final_softcap=cap, embed_scale=cfg.hidden_size ** 0.5 if fam.gemma else None,
        windows=_windows(cfg, fam, mt, n), rope_of=rope_of, ropes=ropes)


def _plain(act) -> Callable:
    """The function behind an HF activation module (no module call per layer): F.silu for SiLU, the
    `act` attribute of GELUTanh / GELUActivation (functools.partial(F.gelu, approximate="tanh"), F.gelu)."""
    if isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return F.silu
    return getattr(act, "act", act)


def check_type(cfg) -> None:
    """The model type alone: UserError for a mixture of experts or a type without a recipe."""
    mt = getattr(cfg, "model_type", None)
    if any(getattr(cfg, k, None) for k in _MOE_KEYS) or "moe" in str(mt):
        raise refuse(mt, "mixtures of experts are not implemented")
    if mt not in FAMILIES:
        raise refuse(mt, f"it runs {', '.join(SUPPORTED)}")


def _windows(cfg, fam: Family, mt: str, n: int) -> tuple:
    """Per layer: the sliding window, or None (full causal attention)."""
    w = getattr(cfg, "sliding_window", None)
    if fam.windows == "all":
        return (w,) * n
    if fam.windows == "none":
        return (None,) * n
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise refuse(mt, f"layer types {sorted(unknown)}")
    return tuple(w if t == "sliding_attention" else None for t in types)


def _ropes(rot, cfg, mt: str, max_len: int) -> tuple[tuple, tuple]:
    """(tables, per-layer table index): one table, or one per layer type (gemma3: `{type}_inv_freq`)."""
    if not isinstance(rot.rope_type, dict):
        return (_rope(rot, cfg.rope_parameters, rot.rope_type, "", mt, max_len),), (0,) * cfg.num_hidden_layers
    keys = list(dict.fromkeys(cfg.layer_types))
    tables = tuple(_rope(rot, cfg.rope_parameters[k], rot.rope_type[k], f"{k}_", mt, max_len) for k in keys)
    return tables, tuple(keys.index(t) for t in cfg.layer_types)


def _rope(rot, params: dict, rope_type: str, prefix: str, mt: str, max_len: int) -> Rope:
    """The RoPE table HF uses at every length up to `max_len`, or a refusal where it would change.

    Static types (default, linear, llama3, yarn, ...) keep `inv_freq`. dynamic_rope_update recomputes
    "dynamic" frequencies only past max_seq_len_cached (max_position_embeddings) and picks "longrope"'s
    long factors only past original_max_position_embeddings; below, both use `original_inv_freq`."""
    inv = getattr(rot, f"{prefix}inv_freq")
    if "dynamic" in rope_type:
        if max_len > rot.original_max_seq_len:
            raise refuse(mt, f"rope type '{rope_type}' changes its frequencies past {rot.original_max_seq_len} tokens (max_model_len {max_len})")
        inv = getattr(rot, f"{prefix}original_inv_freq")
    elif rope_type == "longrope":
        limit = params["original_max_position_embeddings"]
        if max_len > limit and list(params["long_factor"]) != list(params["short_factor"]):
            raise refuse(mt, f"rope type 'longrope' switches to its long factors past {limit} tokens: "
                             f"set max_model_len <= {limit} (now {max_len})")
        inv = getattr(rot, f"{prefix}original_inv_freq")
    return Rope(inv.detach().float(), float(getattr(rot, f"{prefix}attention_scaling")))


# ------------------------------------------------------------------ PEFT adapters
def is_lora(mod) -> bool:
    """A peft LoRA layer (lora.Linear, lora.Embedding): base_layer + lora_A/lora_B per adapter."""
    return hasattr(mod, "base_layer") and hasattr(mod, "get_delta_weight") and hasattr(mod, "scaling")


def check_adapters(model, mt: str) -> None:
    """LoRA variants (DoRA, ...) change the forward beyond W + scale * B @ A: refused."""
    for name, mod in model.named_modules():
        if is_lora(mod) and getattr(mod, "lora_variant", None):
            kinds = sorted({type(v).__name__ for v in mod.lora_variant.values()})
            raise refuse(mt, f"LoRA variant {', '.join(kinds)} (DoRA, ...) on {name}: merge it (merge_and_unload) first")


def effective_weight(mod) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) the module computes with: for a LoRA layer with unmerged active adapters
    W + sum_a delta_a (peft's get_delta_weight: scaling[a] * B_a @ A_a, what a merge adds) and
    b + scaling[a] * bias(B_a) where the adapter has a bias; else the plain (or wrapped) weight."""
    if not is_lora(mod):
        return mod.weight, getattr(mod, "bias", None)
    base = mod.get_base_layer()
    w, b = base.weight, getattr(base, "bias", None)
    if mod.disable_adapters or mod.merged:
        return w, b
    names = getattr(mod, "lora_A", None) or getattr(mod, "lora_embedding_A", {})
    for a in mod.active_adapters:
        if a not in names:
            continue
        w = (w + mod.get_delta_weight(a)).to(base.weight.dtype)  # as peft's in-place merge rounds
        if getattr(mod, "lora_bias", {}).get(a):
            b = b + mod.lora_B[a].bias * mod.scaling[a]
    return w, b
