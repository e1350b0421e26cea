"""`posttrain distill`: the entry points, dispatching on `mode` (logit.py, sequence.py, on_policy.py)."""

from __future__ import annotations

import time

from posttrain.config import parse_args
from posttrain.recipes.distill import logit, sequence
from posttrain.recipes.distill.config import DistillConfig


def train(cfg: DistillConfig) -> dict:
    """Run the distillation `cfg.mode` says; returns its summary."""
    if cfg.mode == "logit":
        return logit.train(cfg)
    if cfg.mode == "sequence":
        return sequence.train(cfg)
    from posttrain.recipes.distill import on_policy  # here: importing it registers the reward "none"

    return on_policy.train(cfg)


def main(argv: list[str]) -> None:
    cfg = parse_args(DistillConfig, argv, prog="posttrain distill")  # a bad key or value: ConfigError, reported by the CLI
    t0 = time.perf_counter()
    s = train(cfg)
    shown = {k: v for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    print(f"distill ({cfg.mode}): " + "  ".join(f"{k}={v:.4g}" for k, v in shown.items())
          + f"; {time.perf_counter() - t0:.0f} s; run directory: {cfg.output_dir}")
