"""Architecture arithmetic from a Hugging Face `config.json`: parameters, LoRA size, KV bytes.

Everything here is counted from the config's numbers, never by building a model, so a 70B plan is
instant. Supported decoders: llama, mistral, qwen2, qwen3 (the dense families the library trains).
The counts equal `sum(p.numel() for p in model.parameters())` of the transformers model (tests check
it for every committed architecture on the `meta` device).

Notation (per layer unless said): h = hidden_size, L = num_hidden_layers, a = num_attention_heads,
k = num_key_value_heads, d = head_dim (default h / a), i = intermediate_size, V = vocab_size.

    attention   q: h·a·d  k: h·k·d  v: h·k·d  o: a·d·h      (+ biases: qwen2 has q/k/v biases a·d + 2·k·d;
                                                              llama `attention_bias` adds o's h too)
    mlp         gate: h·i  up: h·i  down: i·h                (+ 2i + h with llama `mlp_bias`)
    norms       2h (input + post-attention RMSNorm)           (+ 2d for qwen3's per-head q/k norms)
    total       L·(attention + mlp + norms) + V·h (embeddings) + h (final norm) + V·h (lm_head, untied only)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import UserError

ARCH_DIR = Path(__file__).resolve().parent / "architectures"

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")

# Module names PEFT's "all-linear" targets on these decoders (lm_head is excluded by PEFT).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # qwen3: RMSNorm over each head's q and k (d weights each)

    # ------------------------------------------------------------------ parameters

    def linear_shapes(self) -> dict[str, tuple[int, int, bool]]:
        """Per-layer linear modules: name -> (in_features, out_features, has_bias)."""
        h, a, k, d, i = self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate
        return {
            "q_proj": (h, a * d, self.qkv_bias),
            "k_proj": (h, k * d, self.qkv_bias),
            "v_proj": (h, k * d, self.qkv_bias),
            "o_proj": (a * d, h, self.o_bias),
            "gate_proj": (h, i, self.mlp_bias),
            "up_proj": (h, i, self.mlp_bias),
            "down_proj": (i, h, self.mlp_bias),
        }

    def layer_params(self) -> int:
        linear = sum(fi * fo + (fo if bias else 0) for fi, fo, bias in self.linear_shapes().values())
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return linear + norms

    def embedding_params(self) -> int:
        """Input embedding plus, when untied, the lm_head (V·h each)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.hidden  # + final norm

    def lora_params(self, r: int, targets: tuple[str, ...] = ALL_LINEAR) -> int:
        """LoRA adds B·A with A: r×in, B: out×r to each targeted linear: r·(in + out) per module."""
        shapes = self.linear_shapes()
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise UserError(f"lora_targets: unknown module(s) {unknown}; choose from {', '.join(shapes)} or all-linear")
        return self.layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)

    # ------------------------------------------------------------------ KV cache

    def kv_bytes_per_token(self, bytes_per_value: float = 2) -> float:
        """K and V for every layer: 2 × L × k × d × bytes (Llama-3-8B in BF16: 2·32·8·128·2 = 128 KiB)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    def to_dict(self) -> dict:
        return {
            "name": self.name, "model_type": self.model_type, "hidden_size": self.hidden,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate, "vocab_size": self.vocab, "tie_word_embeddings": self.tied,
        }


def _int_key(cfg: dict, key: str, source: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{source}: config key '{key}' must be a positive integer (got {value!r})")
    return value


def from_config(cfg, name: str = "config") -> Arch:
    """An `Arch` from a config dict or a transformers `PretrainedConfig`."""
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if not isinstance(cfg, dict):
        raise UserError(f"model: expected a config dict or transformers config, got {type(cfg).__name__}")
    if isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg:
        cfg = cfg["text_config"]  # multimodal wrappers keep the decoder under text_config
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED:
        raise UserError(
            f"{name}: model_type '{model_type}' is not supported by the planner (supported: {', '.join(SUPPORTED)}); "
            "give a parameter count instead, e.g. model=7e9"
        )
    hidden = _int_key(cfg, "hidden_size", name)
    heads = _int_key(cfg, "num_attention_heads", name)
    kv_heads = cfg.get("num_key_value_heads") or heads  # absent = multi-head attention
    head_dim = cfg.get("head_dim") or hidden // heads
    return Arch(
        name=name,
        model_type=model_type,
        hidden=hidden,
        layers=_int_key(cfg, "num_hidden_layers", name),
        heads=heads,
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        intermediate=_int_key(cfg, "intermediate_size", name),
        vocab=_int_key(cfg, "vocab_size", name),
        tied=bool(cfg.get("tie_word_embeddings", False)),  # every supported config class defaults to untied
        # Qwen2 hard-codes bias=True on q/k/v and False on o; Qwen3 and Llama use `attention_bias` for all four.
        qkv_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
        o_bias=False if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
    )


def known_architectures() -> dict[str, Path]:
    """Committed configs: name (file stem, lower case) -> path."""
    return {p.stem: p for p in sorted(ARCH_DIR.glob("*.json"))}


# Other spellings users type for the committed names.
ALIASES = {
    "meta-llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b", "llama-3.1-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b", "llama3-70b": "llama-3-70b", "llama-3.1-70b": "llama-3-70b",
    "qwen2.5-0.5b-instruct": "qwen2.5-0.5b", "qwen2.5-7b-instruct": "qwen2.5-7b",
    "smollm2-135m-instruct": "smollm2-135m",
}


def load_known(name: str) -> Arch | None:
    """The committed architecture for a name such as `Llama-3-8B` (case-insensitive), else None."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = ALIASES.get(key, key)
    path = known_architectures().get(key)
    if path is None:
        return None
    return from_config(json.loads(path.read_text()), name=key)


def load_folder(path: Path) -> Arch:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise UserError(f"model: {path} has no config.json (not a Hugging Face model folder)")
    try:
        data = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"model: {config}: invalid JSON: {e}") from None
    return from_config(data, name=str(path))


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
