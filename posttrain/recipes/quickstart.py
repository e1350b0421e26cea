"""`posttrain quickstart`: the flagship recipe on the real SmolLM2-135M-Instruct, ending in a report.

Runs configs/quickstart.yaml (any key can be overridden: `posttrain quickstart max_steps=5`).
Needs `posttrain models fetch smollm2-135m-instruct` first (`make quickstart` does both).
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config import parse_args
from posttrain.recipes import sft

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def main(argv: list[str]) -> None:
    args = ["--config", str(CONFIG)] if CONFIG.is_file() else []
    cfg = parse_args(sft.SFTConfig, [*args, *argv], prog="posttrain quickstart")
    if Path(cfg.output_dir).exists() and not cfg.resume:
        import shutil

        shutil.rmtree(cfg.output_dir)  # the quickstart always starts fresh
    summary = sft.train(cfg)
    print(f"\nquickstart done: loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}, "
          f"eval loss {summary['final_eval_loss']:.3f}, forgetting probe Δ {summary.get('probe_loss_delta', float('nan')):+.3f} nats")
    print(f"report: {Path(cfg.output_dir).resolve() / 'report.html'}")
