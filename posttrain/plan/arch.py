"""Architecture arithmetic from a Hugging Face `config.json`: parameters (total and active), LoRA size, KV bytes.

Everything here is counted from the config's numbers, never by building a model, so a 70B plan is
instant. `FAMILIES` says how each decoder family builds a layer (biases, fused projections, extra norms,
q/k norms, sliding layers, mixture of experts); the counts equal `sum(p.numel() for p in
model.parameters())` of the transformers model (tests check every family on the `meta` device). Other
model types get a `generic` reading of the usual keys (`exact=False`): the planner then counts
parameters elsewhere (the model, the checkpoint's tensors, a meta-device build; see plan/resolve.py)
and keeps this reading only for the KV cache and activations, saying so in the plan's notes.

Notation (per layer unless said): h = hidden_size, L = num_hidden_layers, a = num_attention_heads,
k = num_key_value_heads, d = head_dim (explicit, else the family's default, else h / a),
i = intermediate_size, V = vocab_size; MoE: E experts of intermediate m, K of them per token.

    attention   q: h·a·d  k: h·k·d  v: h·k·d  o: a·d·h        (phi3 fuses q, k, v into qkv_proj: h·(a + 2k)·d)
                + biases a·d + 2·k·d on q/k/v (qwen2), + h on o (`attention_bias` of llama, qwen3, gemma, olmo)
    q/k norms   2d per-head (qwen3, gemma3) | a·d + k·d over all heads (olmo2) | h + (h/a)·k (olmoe)
    mlp         gate, up: h·i each, down: i·h                (phi3 fuses gate and up into gate_up_proj: h·2i;
                starcoder2: c_fc h·i, c_proj i·h, with biases)
    MoE layer   router E·h + E·3·h·m  (+ qwen2_moe's shared expert 3·h·s and its gate h)
    norms       n·h per layer: n = 2 (input + post-attention), 4 for gemma2/3 (+ pre/post feed-forward);
                LayerNorm with bias doubles it (starcoder2), olmo's has no parameters
    total       Σ layers + V·h (embeddings) + h (final norm) + V·h (lm_head, untied only)
    active      total − Σ_MoE layers (E − K)·3·h·m   (the parameters one token's forward touches)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import UserError

ARCH_DIR = Path(__file__).resolve().parent / "architectures"

A, M = "attention_bias", "mlp_bias"  # the config keys most families switch biases with


@dataclass(frozen=True)
class Family:
    """How a model_type builds its decoder layer, beyond the shared numbers (h, L, a, k, d, i, V)."""

    bias: tuple = (A, A, M)  # q/k/v, o, mlp: a bool, or the config key that switches it
    fused: bool = False  # phi3: qkv_proj = [q; k; v], gate_up_proj = [gate; up]
    gated: bool = True  # gate/up/down (SwiGLU, GeGLU); False: starcoder2's c_fc/c_proj
    norms: int = 2  # h-wide norms per layer
    norm_params: int = 1  # values per channel: RMSNorm weight 1, LayerNorm weight + bias 2, olmo's parameter-free 0
    qk_norm: str = ""  # "" | "head" (d each) | "full" (a·d and k·d) | "olmoe" (h and (h/a)·k)
    sliding: str = "none"  # sliding layers when the config lists no layer_types: none | all | alternate | pattern | qwen
    moe: str = ""  # "" | "mixtral" (E experts of intermediate_size) | "qwen" (moe_intermediate_size, sparse step, shared)
    defaults: tuple = ()  # (key, value): config-class defaults that differ from the generic ones


_QWEN_WINDOW = (("use_sliding_window", False), ("max_window_layers", 28))
_GEMMA = (("head_dim", 256), ("tie_word_embeddings", True))

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "granite": Family(),
    "smollm3": Family(defaults=(("tie_word_embeddings", True),)),
    "mistral": Family(bias=(False, False, False), sliding="all", defaults=(("sliding_window", 4096),)),
    "mixtral": Family(bias=(False, False, False), sliding="all", moe="mixtral"),
    "qwen2": Family(bias=(True, False, False), sliding="qwen", defaults=_QWEN_WINDOW),
    "qwen2_moe": Family(bias=("qkv_bias", False, False), sliding="qwen", moe="qwen", defaults=(("qkv_bias", True), *_QWEN_WINDOW)),
    "qwen3": Family(bias=(A, A, False), qk_norm="head", sliding="qwen", defaults=(("head_dim", 128), *_QWEN_WINDOW)),
    "qwen3_moe": Family(bias=(A, A, False), qk_norm="head", sliding="qwen", moe="qwen", defaults=_QWEN_WINDOW),
    "gemma": Family(bias=(A, A, False), defaults=_GEMMA),
    "gemma2": Family(bias=(A, A, False), norms=4, sliding="alternate", defaults=(*_GEMMA, ("sliding_window", 4096))),
    "gemma3_text": Family(bias=(A, A, False), norms=4, qk_norm="head", sliding="pattern",
                          defaults=(*_GEMMA, ("sliding_window", 4096), ("sliding_window_pattern", 6))),
    "phi3": Family(bias=(False, False, False), fused=True, sliding="all"),
    "olmo": Family(bias=(A, A, False), norm_params=0),
    "olmo2": Family(bias=(A, A, False), qk_norm="full"),
    "olmoe": Family(bias=(A, A, False), qk_norm="olmoe", moe="mixtral"),
    "starcoder2": Family(bias=("use_bias",) * 3, gated=False, norm_params=2, sliding="all",
                         defaults=(("use_bias", True), ("tie_word_embeddings", True))),
}
SUPPORTED = tuple(FAMILIES)
GENERIC = Family()  # an unknown model_type read as a llama-like decoder: KV and activations only, never exact counts


class ArchUnknown(Exception):
    """The config does not give the numbers a decoder's arithmetic needs (the message says which and why)."""


@dataclass(frozen=True)
class Moe:
    """A mixture-of-experts MLP: E experts of intermediate m, K routed per token, an optional shared expert."""

    experts: int  # E
    top_k: int  # K
    intermediate: int  # m
    shared_intermediate: int = 0  # qwen2_moe's always-on expert (0: none), with a sigmoid gate h → 1
    sparse: tuple[bool, ...] = ()  # per layer: the MoE block (True) or a dense MLP of intermediate_size

    def expert_params(self, hidden: int) -> int:
        return 3 * hidden * self.intermediate  # gate, up (fused as gate_up_proj) and down of one expert

    def to_dict(self) -> dict:
        return {"experts": self.experts, "experts_per_token": self.top_k, "expert_intermediate_size": self.intermediate,
                "shared_expert_intermediate_size": self.shared_intermediate, "moe_layers": sum(self.sparse)}


@dataclass(frozen=True)
class Arch:
    """The numbers of a decoder-only transformer that the cost model needs."""

    name: str
    model_type: str
    hidden: int  # h
    layers: int  # L
    heads: int  # a
    kv_heads: int  # k
    head_dim: int  # d
    intermediate: int  # i
    vocab: int  # V
    tied: bool  # lm_head shares the embedding matrix
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = ""  # see Family.qk_norm
    fused: bool = False
    gated: bool = True
    norms: int = 2
    norm_params: int = 1
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention (empty: all full)
    moe: Moe | None = None
    exact: bool = True  # a known family: parameter counts equal the transformers model's

    # ------------------------------------------------------------------ parameters

    def attention_linears(self) -> dict[str, tuple[int, int, bool]]:
        """The attention's linear modules: name -> (in_features, out_features, has_bias)."""
        h, a, k, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        o = {"o_proj": (a * d, h, self.o_bias)}
        if self.fused:
            return {"qkv_proj": (h, (a + 2 * k) * d, self.qkv_bias), **o}
        return {"q_proj": (h, a * d, self.qkv_bias), "k_proj": (h, k * d, self.qkv_bias),
                "v_proj": (h, k * d, self.qkv_bias), **o}

    def mlp_linears(self, i: int) -> dict[str, tuple[int, int, bool]]:
        """A dense MLP of intermediate size i: name -> (in_features, out_features, has_bias)."""
        h, b = self.hidden, self.mlp_bias
        if not self.gated:
            return {"c_fc": (h, i, b), "c_proj": (i, h, b)}
        if self.fused:
            return {"gate_up_proj": (h, 2 * i, b), "down_proj": (i, h, b)}
        return {"gate_proj": (h, i, b), "up_proj": (h, i, b), "down_proj": (i, h, b)}

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse[layer]

    def layer_linears(self, layer: int) -> dict[str, tuple[int, int, bool]]:
        """Every nn.Linear of decoder layer `layer`, by its path inside the layer (the names LoRA targets).
        MoE experts and routers are not nn.Linear in transformers 5 (3-D parameters, router modules)."""
        out = {f"self_attn.{n}": s for n, s in self.attention_linears().items()}
        if not self.is_sparse(layer):
            out.update({f"mlp.{n}": s for n, s in self.mlp_linears(self.intermediate).items()})
        elif self.moe.shared_intermediate:
            out.update({f"mlp.shared_expert.{n}": s for n, s in self.mlp_linears(self.moe.shared_intermediate).items()})
            out["mlp.shared_expert_gate"] = (self.hidden, 1, False)
        return out

    def qk_norm_params(self) -> int:
        h, a, k, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        return {"": 0, "head": 2 * d, "full": (a + k) * d, "olmoe": h + (h // a) * k}[self.qk_norm]

    def layer_params(self, layer: int = 0) -> int:
        linear = sum(fi * fo + (fo if bias else 0) for fi, fo, bias in self.layer_linears(layer).values())
        experts = 0
        if self.is_sparse(layer):  # router E·h + E experts
            experts = self.moe.experts * (self.hidden + self.moe.expert_params(self.hidden))
        return linear + experts + self.norms * self.norm_params * self.hidden + self.qk_norm_params()

    def embedding_params(self) -> int:
        """Input embedding plus, when untied, the lm_head (V·h each)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def params(self) -> int:
        layers = sum(self.layer_params(n) for n in range(self.layers))
        return layers + self.embedding_params() + self.norm_params * self.hidden  # + final norm

    def active_params(self) -> int:
        """Parameters one token's forward touches: every MoE layer runs K of its E experts."""
        if self.moe is None:
            return self.params()
        idle = (self.moe.experts - self.moe.top_k) * self.moe.expert_params(self.hidden)
        return self.params() - idle * sum(self.moe.sparse)

    def linear_names(self) -> list[str]:
        """Distinct module names (last path component) LoRA can target, in layer order."""
        names = [p.rsplit(".", 1)[-1] for n in range(self.layers) for p in self.layer_linears(n)]
        return list(dict.fromkeys(names))

    def linears(self) -> list[tuple[str, int, int]]:
        """(path, in_features, out_features) of every nn.Linear except lm_head: layers.N.<path in the layer>."""
        return [(f"layers.{n}.{p}", fi, fo) for n in range(self.layers) for p, (fi, fo, _) in self.layer_linears(n).items()]

    def lora_params(self, r: int, targets: tuple[str, ...] | None = None) -> int:
        """LoRA parameters of rank r on `targets` (None: all-linear); see `lora_params` below."""
        return lora_params(self.linears(), r, targets)[0]

    # ------------------------------------------------------------------ KV cache

    def kv_bytes_per_token(self, bytes_per_value: float = 2) -> float:
        """K and V of every layer: 2 × L × k × d × bytes (Llama-3-8B in BF16: 2·32·8·128·2 = 128 KiB). The
        rate while a context fits every layer's window; `kv_bytes_per_sequence` caps the sliding layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    def sliding_layers(self) -> int:
        return sum(t == "sliding_attention" for t in self.layer_types) if self.sliding_window else 0

    def kv_bytes_per_sequence(self, context: int, bytes_per_value: float = 2) -> float:
        """KV of one sequence of `context` tokens: 2·k·d·bytes × [full layers · context + sliding layers ·
        min(context, window)] (a sliding layer keeps at most `sliding_window` tokens)."""
        per_layer_token = 2 * self.kv_heads * self.head_dim * bytes_per_value
        sliding = self.sliding_layers()
        window = min(context, self.sliding_window or context)
        return per_layer_token * ((self.layers - sliding) * context + sliding * window)

    # ------------------------------------------------------------------ activations

    def activation_values_per_token(self) -> tuple[float, float]:
        """(values saved per token in one layer, the largest layer's), as counted for llama with saved-tensor
        hooks: 8h + 4i + 2·k·d (cost.activation_bytes). Extra norms save their inputs and outputs (2h each,
        gemma2/3), q/k norms theirs (2·(a + k)·d); an MoE layer's MLP terms use the K routed experts' and the
        shared expert's intermediates. Mean over layers (MoE and dense layers may differ) and the maximum."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        base = 8 * h + 2 * kv + 2 * h * max(self.norms - 2, 0) + (2 * (self.heads + self.kv_heads) * self.head_dim if self.qk_norm else 0)
        per_layer = []
        for n in range(self.layers):
            i = self.moe.top_k * self.moe.intermediate + self.moe.shared_intermediate if self.is_sparse(n) else self.intermediate
            per_layer.append(base + 4 * i)
        return sum(per_layer) / len(per_layer), max(per_layer)

    def to_dict(self) -> dict:
        out = {
            "name": self.name, "model_type": self.model_type, "hidden_size": self.hidden,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate, "vocab_size": self.vocab, "tie_word_embeddings": self.tied,
            "fused_projections": self.fused, "qk_norm": self.qk_norm or None, "norms_per_layer": self.norms,
            "sliding_window": self.sliding_window, "sliding_layers": self.sliding_layers(),
            "moe": self.moe.to_dict() if self.moe else None, "exact": self.exact,
        }
        return out


# ---------------------------------------------------------------------- reading a config


def _int_key(cfg: dict, key: str, source: str, default=None) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ArchUnknown(f"{source}: config key '{key}' must be a positive integer (got {value!r})")
    return value


def _first(cfg: dict, *keys, default=None):
    """The first of `keys` the config sets (not None): transformers spells some numbers several ways."""
    return next((cfg[k] for k in keys if cfg.get(k) is not None), default)


def text_config(cfg: dict) -> tuple[dict, bool]:
    """(the decoder's config, nested): multimodal wrappers keep the decoder under text_config (gemma3,
    llava, qwen2_vl ...). A nested one without a model_type of its own takes `<parent>_text` when known."""
    inner = cfg.get("text_config")
    if not isinstance(inner, dict) or "hidden_size" in cfg:
        return cfg, False
    inner = dict(inner)
    if not inner.get("model_type"):
        parent = cfg.get("model_type", "")
        inner["model_type"] = f"{parent}_text" if f"{parent}_text" in FAMILIES else parent
    return inner, True


def _layer_types(cfg: dict, family: Family, layers: int, window: int | None) -> tuple[str, ...]:
    """Which layers attend within the sliding window: the config's `layer_types` when given, else the family's
    rule (as its transformers config class derives them)."""
    listed = cfg.get("layer_types")
    if isinstance(listed, (list, tuple)) and len(listed) == layers:
        return tuple(str(t) for t in listed)
    if window is None:
        return ()
    rule = family.sliding
    if rule == "all":
        return ("sliding_attention",) * layers
    if rule == "alternate":  # gemma2: even layers slide
        return tuple("sliding_attention" if (n + 1) % 2 else "full_attention" for n in range(layers))
    if rule == "pattern":  # gemma3: every sliding_window_pattern-th layer is global
        p = int(cfg.get("sliding_window_pattern") or 6)
        return tuple("sliding_attention" if (n + 1) % p else "full_attention" for n in range(layers))
    if rule == "qwen" and cfg.get("use_sliding_window"):
        start = int(cfg.get("max_window_layers", 28))
        return tuple("sliding_attention" if n >= start else "full_attention" for n in range(layers))
    return ()


def _moe(cfg: dict, family: Family, layers: int, intermediate: int, name: str) -> Moe | None:
    """The MoE block of mixtral/olmoe (every layer, experts of intermediate_size) or of the qwen MoE
    families (moe_intermediate_size; layers (n + 1) % decoder_sparse_step == 0 and not in mlp_only_layers)."""
    experts = _first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    if not experts:
        return None
    top_k = _int_key(cfg, "num_experts_per_tok", name)
    if family.moe == "mixtral" or (not family.moe and not cfg.get("moe_intermediate_size")):
        return Moe(experts, top_k, intermediate, sparse=(True,) * layers)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if not shared and cfg.get("n_shared_experts"):  # the generic reading of deepseek-style configs
        shared = int(cfg["n_shared_experts"]) * int(cfg["moe_intermediate_size"])
    sparse = tuple(n not in dense and (n + 1) % step == 0 for n in range(layers))
    return Moe(experts, top_k, _int_key(cfg, "moe_intermediate_size", name), shared, sparse)


def _bias(cfg: dict, spec) -> bool:
    return spec if isinstance(spec, bool) else bool(cfg.get(spec, False))


def from_config(cfg, name: str = "config") -> Arch:
    """An `Arch` from a config dict or a transformers `PretrainedConfig` (its decoder, for multimodal ones).
    A model_type outside FAMILIES is read generically (`exact=False`); raises ArchUnknown when the config
    lacks the numbers (hidden size, layers, heads, intermediate size, vocabulary)."""
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if not isinstance(cfg, dict):
        raise ArchUnknown(f"{name}: expected a config dict or transformers config, got {type(cfg).__name__}")
    cfg, _ = text_config(cfg)
    model_type = str(cfg.get("model_type") or "")
    family = FAMILIES.get(model_type, GENERIC)
    cfg = {**dict(family.defaults), **{k: v for k, v in cfg.items() if v is not None}}
    hidden = _int_key(cfg, "hidden_size", name, _first(cfg, "n_embd", "d_model"))
    heads = _int_key(cfg, "num_attention_heads", name, _first(cfg, "n_head", "num_heads"))
    layers = _int_key(cfg, "num_hidden_layers", name, _first(cfg, "n_layer", "num_layers"))
    intermediate = _int_key(cfg, "intermediate_size", name, _first(cfg, "ffn_hidden_size", "n_inner"))
    window = cfg.get("sliding_window") if family.sliding != "qwen" or cfg.get("use_sliding_window") else None
    window = window if isinstance(window, int) and window > 0 else None
    return Arch(
        name=name, model_type=model_type, hidden=hidden, layers=layers, heads=heads,
        kv_heads=_int_key(cfg, "num_key_value_heads", name, _first(cfg, "num_kv_heads", default=heads)),
        head_dim=_int_key(cfg, "head_dim", name, hidden // heads),
        intermediate=intermediate,
        vocab=_int_key(cfg, "vocab_size", name, _first(cfg, "padded_vocab_size")),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=_bias(cfg, family.bias[0]), o_bias=_bias(cfg, family.bias[1]), mlp_bias=_bias(cfg, family.bias[2]),
        qk_norm=family.qk_norm, fused=family.fused, gated=family.gated, norms=family.norms, norm_params=family.norm_params,
        sliding_window=window, layer_types=_layer_types(cfg, family, layers, window),
        moe=_moe(cfg, family, layers, intermediate, name),
        exact=model_type in FAMILIES,
    )


def lora_params(linears, r: int, targets: tuple[str, ...] | None) -> tuple[int, list[str]]:
    """LoRA adds B·A with A: r×in, B: out×r to each targeted linear: r·(in + out) per module. `linears`:
    (path, in, out) of every nn.Linear but lm_head; `targets` None = all of them (PEFT's all-linear), else
    names matched as PEFT does (the path equals the name or ends with "." + name). -> (params, targets
    that match nothing)."""
    def hit(path: str, t: str) -> bool:
        return path == t or path.endswith("." + t)

    chosen = [(p, fi, fo) for p, fi, fo in linears if targets is None or any(hit(p, t) for t in targets)]
    missing = [t for t in (targets or ()) if not any(hit(p, t) for p, _, _ in linears)]
    return sum(r * (fi + fo) for _, fi, fo in chosen), missing


def known_architectures() -> dict[str, Path]:
    """Committed configs: name (file stem, lower case) -> path."""
    return {p.stem: p for p in sorted(ARCH_DIR.glob("*.json"))}


# Other spellings users type for the committed names.
ALIASES = {
    "meta-llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b", "llama-3.1-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b", "llama3-70b": "llama-3-70b", "llama-3.1-70b": "llama-3-70b",
    "qwen2.5-0.5b-instruct": "qwen2.5-0.5b", "qwen2.5-7b-instruct": "qwen2.5-7b",
    "smollm2-135m-instruct": "smollm2-135m", "gemma-3-1b-it": "gemma-3-1b", "gemma-3-1b-pt": "gemma-3-1b",
    "qwen3-0.6b-base": "qwen3-0.6b",
}


def load_known(name: str) -> Arch | None:
    """The committed architecture for a name such as `Llama-3-8B` (case-insensitive), else None."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = ALIASES.get(key, key)
    path = known_architectures().get(key)
    if path is None:
        return None
    return from_config(json.loads(path.read_text()), name=key)


def read_config(path: Path) -> dict:
    """`path/config.json` as a dict (UserError when the folder has none or it is not JSON)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise UserError(f"model: {path} has no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"model: {config}: invalid JSON: {e}") from None


def load_folder(path: Path) -> Arch:
    return from_config(read_config(path), name=str(path))


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_count(text: str) -> float | None:
    """`8e9`, `8000000000`, `8B`, `135M`, `0.5b` -> a parameter count; None if not a number."""
    s = str(text).strip().lower().replace("_", "")
    scale = 1.0
    if s and s[-1] in _SUFFIX:
        s, scale = s[:-1], _SUFFIX[s[-1]]
    try:
        value = float(s) * scale
    except ValueError:
        return None
    return value if math.isfinite(value) else None
