"""`posttrain quickstart`: the flagship pipeline on the real SmolLM2-135M-Instruct, ending in a report.

    stage 1  sft   assistant-only SFT on the built-in arithmetic task (boxed answers)
    stage 2  rl    GRPO from the SFT model with the math verifier as reward
    report         output_dir/report.html links both runs' reports, plan vs measured included

Runs configs/quickstart.yaml; any key can be overridden (`posttrain quickstart rl.max_steps=2`).
Needs `posttrain models fetch smollm2-135m-instruct` first (`make quickstart` does both).
"""

from __future__ import annotations

import html
import json
import shutil
import time
from pathlib import Path

from pydantic import Field

from posttrain.config import Config, parse_args
from posttrain.recipes import rl as rl_recipe
from posttrain.recipes import sft as sft_recipe

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


class QuickstartConfig(Config):
    """posttrain quickstart: SFT then GRPO on SmolLM2-135M-Instruct, with one report."""

    output_dir: str = Field("runs/quickstart", description="parent folder of the sft/ and rl/ runs and the report")
    sft: sft_recipe.SFTConfig = Field(default_factory=sft_recipe.SFTConfig)
    rl: rl_recipe.RLConfig = Field(default_factory=rl_recipe.RLConfig)


def main(argv: list[str]) -> None:
    args = ["--config", str(CONFIG)] if CONFIG.is_file() else []
    cfg = parse_args(QuickstartConfig, [*args, *argv], prog="posttrain quickstart")
    out = Path(cfg.output_dir)
    shutil.rmtree(out, ignore_errors=True)  # the quickstart always starts fresh
    cfg.sft.output_dir = str(out / "sft")
    cfg.rl.output_dir = str(out / "rl")
    cfg.rl.model = str(out / "sft" / "final")

    t0 = time.perf_counter()
    print(f"[1/2] SFT on {cfg.sft.model} ({cfg.sft.max_steps} steps)", flush=True)
    s1 = sft_recipe.train(cfg.sft)
    print(f"      loss {s1['first_loss']:.3f} -> {s1['last_loss']:.3f}, eval {s1['final_eval_loss']:.3f}, "
          f"forgetting probe {s1.get('probe_loss_delta', float('nan')):+.3f} nats", flush=True)
    print(f"[2/2] RL ({cfg.rl.algo}, reward={cfg.rl.reward}) from the SFT model ({cfg.rl.max_steps} steps)", flush=True)
    s2 = rl_recipe.train(cfg.rl)
    print(f"      reward {s2['first_reward']:.3f} -> {s2['last_reward']:.3f}", flush=True)
    report = write_index(out, {"sft": s1, "rl": s2}, time.perf_counter() - t0)
    print(f"\nquickstart done in {time.perf_counter() - t0:.0f} s; report: {report.resolve()}")


def write_index(out: Path, summaries: dict, seconds: float) -> Path:
    rows = "".join(
        f"<h2><a href='{name}/report.html'>{name}</a></h2><pre>{html.escape(json.dumps(s, indent=1, default=str))}</pre>"
        for name, s in summaries.items()
    )
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>posttrain quickstart</title></head>"
            f"<body style='font-family:sans-serif;margin:24px'><h1>posttrain quickstart</h1>"
            f"<p>SFT then GRPO on SmolLM2-135M-Instruct, {seconds:.0f} s on this machine.</p>{rows}</body></html>")
    path = out / "report.html"
    path.write_text(page)
    return path
