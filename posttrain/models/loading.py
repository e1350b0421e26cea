"""Load a policy (and its tokenizer) from an HF folder, a built-in name, a tiny random config or a Hub id.

A Hub id (`org/name`, not an existing path) goes to transformers' `from_pretrained`: it loads from the
Hugging Face cache (also offline, HF_HUB_OFFLINE=1) or downloads when the Hub is reachable; otherwise
a UserError says which of the two failed and why.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from posttrain.data.templates import set_chat_template
from posttrain.errors import UserError
from posttrain.models.builtin import REAL_MODELS, TINY_CONFIGS, TINY_TOKENIZER, build_tiny, real_model_dir
from posttrain.models.device import resolve_device
from posttrain.ops.attention import install
from posttrain.ops.host_memory import keep_freed_memory
from posttrain.ops.layers import use_fused_layers
from posttrain.ops.linear import use_onednn_linears

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}'; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


# `org/name` (one slash, Hub-legal characters): read as a Hugging Face Hub id unless it is an existing path
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(name: str) -> bool:
    return HUB_ID.fullmatch(name) is not None and not Path(name).exists()


def resolve(name: str) -> Path | str | None:
    """Folder for a name, the name itself for a Hub id (`org/name`), None for tiny random models.
    Raises with a hint when a folder or built-in model is missing."""
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
    if is_hub_id(name):
        org = Path(name.split("/", 1)[0])
        if org.is_dir():  # `runs/sft` typed for `runs/sft/final`: a local path, not worth a Hub round trip
            raise UserError(f"model '{name}' not found: {org}/ is a local folder and has no {path.name}/ with a "
                            f"config.json (a run's model is in <output_dir>/final)")
        return name
    known = ", ".join([*TINY_CONFIGS, *REAL_MODELS])
    raise UserError(f"model '{name}' not found: give an HF folder, a built-in name ({known}) or a Hub id (org/name)")


def _hub_error(name: str, err: BaseException) -> UserError:
    """One readable line for a Hub id that could not be loaded (not cached, and offline or unknown)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    chain = [err]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    reason = " ".join(f"{type(root).__name__}: {root}".split())  # the underlying reason, on one line
    where = "neither a local folder, a built-in name, nor in the Hugging Face cache"
    if any(isinstance(e, (RepositoryNotFoundError, GatedRepoError)) for e in chain):
        return UserError(f"model '{name}' is {where}, and the Hub has no public model of that name "
                         f"(gated or private models need `hf auth login`): {reason}")
    offline = " (HF_HUB_OFFLINE is set: no downloads)" if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") else ""
    return UserError(f"model '{name}' is {where}, and the Hub could not be reached: {reason}{offline}")


def _from_hub(load, name: str, **kwargs):
    """`load(name)` for a Hub id: from the HF cache (works offline, HF_HUB_OFFLINE=1) or downloaded."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return load(name, **kwargs)
    except (OSError, HfHubHTTPError) as e:
        raise _hub_error(name, e) from e


def load_tokenizer(name: str, chat_template: str = "", chat_template_args: dict | None = None):
    """The tokenizer of a model name; `chat_template` (a built-in name or a .jinja file, data/templates.py)
    replaces its chat template, e.g. for a base model that has none; `chat_template_args` fix template
    variables (enable_thinking=false)."""
    from transformers import AutoTokenizer

    path = resolve(name)
    if isinstance(path, str):
        tok = _from_hub(AutoTokenizer.from_pretrained, path)
    else:
        tok = AutoTokenizer.from_pretrained(TINY_TOKENIZER if path is None else path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    set_chat_template(tok, chat_template, chat_template_args)
    return tok


def _build(path: Path | str | None, name: str, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM

    if path is None:
        return build_tiny(name, seed=seed, dtype=dtype)
    if isinstance(path, str):
        return _from_hub(AutoModelForCausalLM.from_pretrained, path, dtype=dtype)
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        return _adapter(path, dtype, seed)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _adapter(path: Path, dtype: torch.dtype, seed: int):
    """A PEFT adapter folder: its base (`base_model_name_or_path`, resolved as any `model=`: a built-in name, a
    folder or a Hub id, so a missing base fails at once instead of on the Hub) with the adapter merged in
    (W + (alpha / r) B A): a plain model every recipe trains, samples and scores like any other."""
    import json

    from peft import PeftModel

    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}/adapter_config.json: unreadable ({e})") from None
    merged = f"; the merged model next to it loads as model={path.parent}" if (path.parent / "config.json").is_file() else ""
    if not base:
        raise UserError(f"{path} is a LoRA adapter whose adapter_config.json names no base model "
                        f"(base_model_name_or_path){merged}")
    try:
        model = _build(resolve(base), base, dtype, seed)
    except UserError as e:
        raise UserError(f"{path} is a LoRA adapter of '{base}', which cannot be loaded: {e}{merged}") from None
    return PeftModel.from_pretrained(model, str(path)).merge_and_unload().requires_grad_(True)  # PEFT froze the base


def load_model(name: str, dtype: str | torch.dtype = "float32", seed: int = 0, varlen_attention: bool = True,
               device: str | torch.device | None = None):
    """A causal LM (HF folder, built-in name or Hub id). PEFT adapter folders load with their base model.

    `device` ('auto' | 'cpu' | 'cuda[:N]' | torch.device; None: stay on the CPU where it was built)
    is where the model is moved. `varlen_attention` switches attention to posttrain's per-sample
    SDPA for packed training rows (ops/attention.py) on every device: on CUDA its causal per-bucket
    SDPA calls run the flash / memory-efficient kernels, which a block-diagonal mask would rule out.
    Generation and any other call still use the stock SDPA path. A model on the CPU keeps freed host memory
    in the process (ops/host_memory.py): a training step's large temporaries reuse heap pages; its
    torch.nn.Linear layers run their fp32 matmuls on oneDNN where MKL is slower (ops/linear.py: AVX-512 CPUs
    not Intel's); its RMSNorm and SiLU-gated MLP layers and the attention's RoPE run fused forward and backward
    kernels (ops/layers.py).
    """
    model = _build(resolve(name), name, to_dtype(dtype), seed)
    if device is not None:
        model = model.to(resolve_device(device))
    if next(model.parameters()).device.type == "cpu":
        keep_freed_memory()
        use_onednn_linears(model)
        use_fused_layers(model)
    if varlen_attention and getattr(model.config, "_attn_implementation", None) in (None, "sdpa", "eager"):
        model.set_attn_implementation(install())
    return model
