"""`posttrain models [list]` and `posttrain models fetch NAME [--force]`."""

from __future__ import annotations

from posttrain.errors import UserError
from posttrain.models.builtin import REAL_MODELS, TINY_CONFIGS, real_model_dir
from posttrain.models.fetch import fetch


def main(argv: list[str]) -> None:
    if not argv or argv[0] == "list":
        for name, cfg in TINY_CONFIGS.items():
            print(f"{name:24s} tiny random {cfg['model_type']} for tests (built from a config, no files)")
        for name, spec in REAL_MODELS.items():
            state = "fetched" if (real_model_dir(name) / "config.json").is_file() else "not fetched"
            print(f"{name:24s} {spec['summary']} [{state}: {real_model_dir(name)}]")
        print(f"{'org/name':24s} a Hugging Face Hub id: loaded from the HF cache (also offline), or downloaded when the Hub is reachable")
        return
    if argv[0] == "fetch" and len(argv) >= 2:
        fetch(argv[1], force="--force" in argv[2:])
        return
    raise UserError("usage: posttrain models [list] | posttrain models fetch NAME [--force]")
