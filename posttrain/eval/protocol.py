"""The evaluation protocol: everything that changes a score besides the model, recorded in
results.json and compared by `posttrain eval compare`.

Fields under `protocol` that must match for two results to be comparable are `COMPARED`; the
model, its hash, the seed, the backend and the dtype are what one compares *across* (two seeds,
two checkpoints, two backends) and are recorded but not compared.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# dotted keys of `protocol` that two comparable results share
COMPARED = ("data.hash", "data.items", "chat_template.applied", "chat_template.sha256", "system_prompt", "few_shot",
            "sampling.temperature", "sampling.top_p", "sampling.top_k", "sampling.max_new_tokens", "sampling.stop_strings",
            "n", "reward.spec", "reward.args", "reward.threshold", "extraction.mode", "extraction.require")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def data_hash(rows: list[dict]) -> str:
    """sha256 over the rows used, in order (canonical JSON: sorted keys)."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def model_hash(name: str, seed: int = 0) -> str:
    """sha256 of a model folder's config and weight files (names and bytes); a built-in tiny random
    model is identified by its name and seed; a Hub id by its name (the cache may hold several revisions)."""
    from posttrain.models.loading import resolve  # torch: this module stays torch-free

    path = resolve(name)
    if path is None:
        return sha256_text(f"tiny:{name}:seed={seed}")
    if isinstance(path, str):
        return sha256_text(f"hub:{path}")
    h = hashlib.sha256()
    files = sorted(p for p in Path(path).iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".bin") or p.name in ("config.json", "adapter_config.json")))
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def get(protocol: dict, dotted: str):
    node = protocol
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def differences(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """[(key, value in a, value in b)] for every compared key that differs."""
    return [(k, get(a, k), get(b, k)) for k in COMPARED if get(a, k) != get(b, k)]
