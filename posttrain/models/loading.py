"""Load a policy (and its tokenizer) from an HF folder, a built-in name or a tiny random config."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.errors import UserError
from posttrain.models.builtin import REAL_MODELS, TINY_CONFIGS, TINY_TOKENIZER, build_tiny, real_model_dir

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}'; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve(name: str) -> Path | None:
    """Folder for a name (None for tiny random models). Raises with a hint when missing."""
    if name in TINY_CONFIGS:
        return None
    if name in REAL_MODELS:
        path = real_model_dir(name)
        if not (path / "config.json").is_file():
            raise UserError(f"model '{name}' is not fetched yet: run `posttrain models fetch {name}`")
        return path
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise UserError(f"{path}: no config.json (not a Hugging Face model folder)")
        return path
    known = ", ".join([*TINY_CONFIGS, *REAL_MODELS])
    raise UserError(f"model '{name}' not found: give an HF folder or a built-in name ({known}); no hub downloads at run time")


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path = resolve(name)
    tok = AutoTokenizer.from_pretrained(TINY_TOKENIZER if path is None else path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name: str, dtype: str | torch.dtype = "float32", seed: int = 0, varlen_attention: bool = True):
    """A causal LM. PEFT adapter folders load with their base model.

    `varlen_attention` switches attention to posttrain's per-sample SDPA for packed training rows
    (ops/attention.py); generation and any other call still use the stock SDPA path.
    """
    from transformers import AutoModelForCausalLM

    path = resolve(name)
    dtype = to_dtype(dtype)
    if path is None:
        model = build_tiny(name, seed=seed, dtype=dtype)
    elif (path / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if varlen_attention and getattr(model.config, "_attn_implementation", None) in (None, "sdpa", "eager"):
        from posttrain.ops.attention import install

        model.set_attn_implementation(install())
    return model
