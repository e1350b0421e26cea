"""A model, given any way a user or a recipe can give one, resolved to what the planner counts with.

    resolve_model("llama-3-8b")            # a committed architecture
    resolve_model(model.config)            # a transformers config (what the recipes pass), or a dict
    resolve_model(model)                   # the model itself: parameters counted from it, exactly
    resolve_model("runs/sft/final")        # a folder; "org/name" from the Hugging Face cache; "8B"

Parameters come, first that applies: the architecture arithmetic of a known family (plan/arch.py), the
model object when one is given, a build of the config on the `meta` device (transformers knows the type;
no memory, no weights), the safetensors headers of the checkpoint's files (shapes only, never a tensor
loaded), the `metadata.total_size` of its weight index divided by the dtype's bytes, and last the generic
reading of the config. Whatever could not be counted exactly is said in `ModelSpec.notes`; only input
that names nothing (a missing folder, an unknown name) raises UserError.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import UserError
from posttrain.models.builtin import REAL_MODELS, TINY_CONFIGS, real_model_dir, tiny_config
from posttrain.models.loading import is_hub_id
from posttrain.plan import arch as archmod
from posttrain.plan.arch import Arch, ArchUnknown

Linears = tuple  # ((path, in_features, out_features), ...) of every nn.Linear but lm_head


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: int | None  # every parameter held in memory; None: could not be counted (see notes)
    arch: Arch | None  # None for a bare parameter count or a config the planner cannot read
    source: str  # "architecture", "folder", "built-in", "config", "model", "parameter count"
    active_params: int | None = None  # per token's forward (MoE: K of E experts; multimodal: the decoder); None = params
    linears: Linears | None = None  # LoRA's candidates, when counted from a model (else from `arch`)
    notes: tuple[str, ...] = ()

    @property
    def compute_params(self) -> int | None:
        """Parameters the FLOPs count per token (6N, 2N): the active ones."""
        return self.active_params if self.active_params is not None else self.params


def resolve_model(spec: Any, key: str = "model") -> ModelSpec:
    """A model given any way a user can give one -> its parameter counts and, when known, architecture."""
    if isinstance(spec, bool):
        raise UserError(f"{key}: expected a model, got {spec!r}")
    if isinstance(spec, (int, float)):
        return _count(str(spec), key)
    if hasattr(spec, "named_parameters") and hasattr(spec, "named_modules"):
        return from_module(spec)
    if isinstance(spec, dict) or hasattr(spec, "to_dict"):
        name = str(getattr(spec, "name_or_path", "") or "config")
        return from_config_source(spec, name, "config", folder=_folder_of(name))
    text = str(spec).strip()
    if not text:
        raise UserError(f"{key}: empty")
    return _from_text(text, key)


def _from_text(text: str, key: str) -> ModelSpec:
    if text in TINY_CONFIGS:  # the same config `posttrain.models.builtin.build_tiny` instantiates
        return from_config_source(tiny_config(text, vocab_size=1024), text, "built-in")
    if text in REAL_MODELS and (real_model_dir(text) / "config.json").is_file():
        folder = real_model_dir(text)
        return from_config_source(archmod.read_config(folder), text, "built-in", folder=folder)
    known = archmod.load_known(text)  # committed configs; also smollm2-135m-instruct when not fetched
    if known is not None:
        return ModelSpec(known.name, known.params(), known, "architecture", known.active_params())
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
            return _adapter(path, key)
        if not (path / "config.json").is_file():
            raise UserError(f"{key}: {path} has no config.json (not a Hugging Face model folder)")
        return from_config_source(archmod.read_config(path), str(path), "folder", folder=path)
    if archmod.parse_count(text) is None and is_hub_id(text):
        folder = cached_hub_folder(text)
        if folder is None:
            raise UserError(f"{key}: '{text}' is not in the Hugging Face cache (the planner reads config.json from it, "
                            f"offline): download it (`hf download {text} config.json`), or give a folder or a parameter count")
        return from_config_source(archmod.read_config(folder), text, "Hugging Face cache", folder=folder)
    return _count(text, key)


def _count(text: str, key: str) -> ModelSpec:
    n = archmod.parse_count(text)
    if n is None:
        names = ", ".join([*archmod.known_architectures(), "tiny-random", "smollm2-135m-instruct"])
        raise UserError(f"{key}: '{text}' is not a folder, a known architecture ({names}), a cached Hub id "
                        "(org/name) or a parameter count (8e9, 8B)")
    if n < 1:
        raise UserError(f"{key}: parameter count must be positive (got {text})")
    return ModelSpec(f"{n:.4g}", int(round(n)), None, "parameter count")


def _adapter(path: Path, key: str) -> ModelSpec:
    """A PEFT adapter folder: planned as its base model (`base_model_name_or_path`)."""
    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{key}: {path}/adapter_config.json: {e}") from None
    if not base:
        raise UserError(f"{key}: {path} is a PEFT adapter without base_model_name_or_path")
    spec = resolve_model(base, key)
    note = f"{path} is a PEFT adapter: planned as its base model {base}"
    return ModelSpec(str(path), spec.params, spec.arch, spec.source, spec.active_params, spec.linears, (*spec.notes, note))


def _folder_of(name_or_path: str) -> Path | None:
    """The folder a config was loaded from (a local path or a cached Hub id), for the checkpoint's tensors."""
    if not name_or_path or name_or_path == "config":
        return None
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    return cached_hub_folder(name_or_path) if is_hub_id(name_or_path) else None


def cached_hub_folder(repo_id: str) -> Path | None:
    """The snapshot folder of a Hub id in the local Hugging Face cache (holding its config.json), else None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id the hub library rejects, a broken cache: not cached
        return None
    return Path(hit).parent if isinstance(hit, str) else None


# ---------------------------------------------------------------------- counting from a config


def from_config_source(cfg, name: str, source: str, folder: Path | None = None, module=None) -> ModelSpec:
    """A spec from a config (dict or transformers config): the family arithmetic when exact, else the
    parameters counted from the model / a meta build / the checkpoint, with notes saying how."""
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    _, nested = archmod.text_config(d)
    notes: list[str] = []
    try:
        arch = archmod.from_config(d, name=name)
    except ArchUnknown as e:
        arch = None
        notes.append(f"{name}: the config does not give a decoder's numbers ({e}): no KV cache, activations or LoRA "
                     "size from it")
    if arch is not None and arch.exact and not nested and module is None:
        return ModelSpec(name, arch.params(), arch, source, arch.active_params())
    counted = _count_elsewhere(cfg, folder, module, d)
    if arch is not None and not arch.exact:
        notes.append(f"{name}: model_type '{arch.model_type}' is not a family the planner knows (plan/arch.py FAMILIES): "
                     "KV cache and activations read from its config's usual keys (approximate)")
    if counted is None:
        return _uncounted(name, source, arch, nested, notes)
    params, linears, how, more = counted
    notes += more
    if nested:
        notes.append(f"{name}: multimodal config: the decoder under text_config is planned (KV, activations, FLOPs per "
                     f"token); parameters in memory counted {how} (vision tower and projector included)")
    elif not (arch is not None and arch.exact) and how != "from the model":
        notes.append(f"{name}: parameters counted {how}")
    return ModelSpec(name, params, arch, source, _active(params, arch, nested), linears, tuple(notes))


def from_module(module) -> ModelSpec:
    """A spec from an nn.Module (a transformers causal LM, possibly under PEFT): its own parameter count
    (adapter weights excluded: the planner adds LoRA itself), its linears, its config's architecture."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    config = getattr(base, "config", None)
    name = str(getattr(config, "name_or_path", "") or type(base).__name__)
    if config is None:
        params, linears = _module_counts(base)
        return ModelSpec(name, params, None, "model", None, linears,
                         (f"{name}: a module without a config: no KV cache, activations or per-layer numbers",))
    return from_config_source(config, name, "model", module=base)


def _active(params: int, arch: Arch | None, nested: bool) -> int:
    """Active parameters from an exact total: the decoder's own for a multimodal model, minus idle experts."""
    if arch is None:
        return params
    if nested:
        return arch.active_params()
    return params - (arch.params() - arch.active_params())


def _uncounted(name: str, source: str, arch: Arch | None, nested: bool, notes: list[str]) -> ModelSpec:
    """Nothing counted the parameters: the decoder's arithmetic (approximate, or without a vision tower), or none."""
    if arch is None:
        notes.append(f"{name}: parameters unknown (no known family, no model object, no buildable config, no checkpoint "
                     "tensors): memory, FLOPs and time are not predicted")
        return ModelSpec(name, None, None, source, None, None, tuple(notes))
    if nested:
        notes.append(f"{name}: multimodal config: only the decoder under text_config is counted (its vision tower and "
                     "projector could not be)")
    else:
        notes.append(f"{name}: parameters counted as a llama-like decoder from the config (approximate)")
    return ModelSpec(name, arch.params(), arch, source, arch.active_params(), None, tuple(notes))


def _count_elsewhere(cfg, folder: Path | None, module, d: dict):
    """(params, linears, how, notes) from the model, a meta build, the checkpoint's headers or its index; None."""
    notes: list[str] = []
    if module is not None:
        params, linears = _module_counts(module)
        return params, linears, "from the model", notes
    for how, count in (("on the meta device", lambda: _meta_counts(cfg)),
                       ("from the checkpoint's safetensors headers", lambda: _checkpoint_counts(folder, d)),
                       ("from the weight index's total_size", lambda: _index_counts(folder, d))):
        try:
            got = count()
        except Exception as e:  # one source failing (an unknown type, a truncated file) leaves the next
            notes.append(f"counting {how} failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}")
            continue
        if got is not None:
            params, linears, extra = got
            return params, linears, how + extra, notes
    return None


def _module_counts(module) -> tuple[int, Linears]:
    """Parameters (tied ones once, PEFT adapter weights left out) and nn.Linear shapes but the output layer."""
    import torch

    params = sum(p.numel() for n, p in module.named_parameters() if ".lora_" not in n and "lora_" not in n.split(".")[0])
    out_emb = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    linears = tuple((n.removesuffix(".base_layer"), m.in_features, m.out_features) for n, m in module.named_modules()
                    if isinstance(m, torch.nn.Linear) and m is not out_emb and ".lora_" not in n)
    return int(params), linears


def _meta_counts(cfg):
    """Build the causal LM of the config on the meta device (no memory, no weights) and count it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(cfg, dict):
        d = {k: v for k, v in cfg.items() if k not in ("transformers_version", "architectures", "auto_map")}
        model_type = d.pop("model_type", None)
        if not model_type:
            return None
        config = AutoConfig.for_model(model_type, **d)
    else:
        config = copy.deepcopy(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params, linears = _module_counts(model)
    return params, linears, ""


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}


def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file: name -> {dtype, shape, data_offsets}. Reads 8 + N bytes only."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= 100 * 2**20:  # an LFS pointer or another format: no plausible header
            raise ValueError(f"{path.name}: not a safetensors file (header length {n})")
        return json.loads(f.read(n))


def _checkpoint_counts(folder: Path | None, d: dict):
    """Parameters from the shapes in the safetensors headers of the folder's files (a tied lm_head once)."""
    files = sorted(Path(folder).glob("*.safetensors")) if folder is not None else []
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for f in files:
        shapes.update({k: v["shape"] for k, v in safetensors_header(f).items() if k != "__metadata__"})
    if d.get("tie_word_embeddings") and any("embed" in k for k in shapes):
        shapes = {k: s for k, s in shapes.items() if not k.endswith("lm_head.weight")}
    params = sum(math.prod(s) for s in shapes.values())
    linears = tuple((k.removesuffix(".weight"), s[1], s[0]) for k, s in shapes.items()
                    if k.endswith(".weight") and len(s) == 2 and not any(w in k for w in ("embed", "lm_head", "wte", "wpe")))
    extra = " (LoRA candidates: its 2-D weights, approximate)" if linears else ""
    if d.get("quantization_config"):
        extra += " (a quantized checkpoint: packed values, not parameters)"
    return params, linears or None, extra


def _index_counts(folder: Path | None, d: dict):
    """Parameters ≈ metadata.total_size of model.safetensors.index.json (or the .bin one) / bytes of the dtype."""
    if folder is None:
        return None
    index = next((p for p in (Path(folder) / "model.safetensors.index.json", Path(folder) / "pytorch_model.bin.index.json")
                  if p.is_file()), None)
    if index is None:
        return None
    total = json.loads(index.read_text())["metadata"]["total_size"]
    dtype = str(d.get("torch_dtype") or d.get("dtype") or "bfloat16").removeprefix("torch.")
    return int(total / DTYPE_BYTES.get(dtype, 2)), None, f" at {DTYPE_BYTES.get(dtype, 2)} bytes per parameter ({dtype})"
