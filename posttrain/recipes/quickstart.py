"""`posttrain quickstart`: does RL teach the real SmolLM2-135M-Instruct something, and is the gain real?

    1/4  evaluate   the base model on 27 held-out single-digit additions (n samples each, pass@k with intervals)
    2/4  GRPO       on the 54 other additions, reward = a verifier (the planner's prediction printed first)
    3/4  evaluate   the trained model with the same protocol
    4/4  compare    paired tests over problems (+ McNemar over samples, conditional on these problems) -> report.html

Runs configs/quickstart.yaml; any key can be overridden (`posttrain quickstart rl.max_steps=10`).
Stopping it and running it again resumes: finished evaluations are reused, GRPO continues from its last
checkpoint (`rl.save_every`), unless `fresh=true`. `posttrain report runs/quickstart` rebuilds the page.
Needs `posttrain models fetch smollm2-135m-instruct` first (`make quickstart` does both).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import yaml
from pydantic import Field

from posttrain.config import Config, parse_args
from posttrain.errors import UserError
from posttrain.eval.cli import run_eval
from posttrain.eval.compare import compare, print_comparison
from posttrain.eval.config import EvalConfig
from posttrain.monitor.quickstart_report import machine, write_quickstart_report
from posttrain.outputs import check_output_dir, write_json
from posttrain.recipes import rl as rl_recipe
from posttrain.training import resume

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


class QuickstartConfig(Config):
    """posttrain quickstart: held-out eval -> GRPO -> held-out eval -> paired test -> report.html."""

    output_dir: str = Field("runs/quickstart", description="folder of eval_before/, rl/, eval_after/, compare.json and report.html")
    model: str = Field("smollm2-135m-instruct", description="the model to train (built-in name, HF folder or Hub id)")
    fresh: bool = Field(False, description="delete output_dir first (default: reuse finished stages, resume GRPO)")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="the held-out evaluation, before and after")
    rl: rl_recipe.RLConfig = Field(default_factory=rl_recipe.RLConfig, description="the GRPO run")


def clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


def run_eval_stage(cfg: EvalConfig, model: str, out: Path, label: str, trained_by: dict | None = None) -> dict:
    """`posttrain eval` with the quickstart's protocol; a finished result with the same config (and, after
    training, the same RL run: `trained_by`) is reused."""
    stage = cfg.model_copy(update={"model": model, "output_dir": str(out)})
    key = stage.model_dump(mode="json") | ({"trained_by": trained_by} if trained_by is not None else {})
    marker = out / "quickstart_stage.json"
    if (out / "results.json").is_file() and marker.is_file() and json.loads(marker.read_text()) == key:
        doc = json.loads((out / "results.json").read_text())
        print(f"{label}: reusing {out}/results.json", flush=True)
    else:
        t0 = time.perf_counter()
        doc = run_eval(stage)
        marker.write_text(json.dumps(key))
        print(f"{label}: done in {clock(time.perf_counter() - t0)}", flush=True)
    m = doc["metrics"]
    shown = "  ".join(f"{k} {v['value']:.3f} [{v['low']:.3f}, {v['high']:.3f}]" for k, v in m.items() if k.startswith("pass@"))
    print(f"      {doc['counts']['items']} problems x {doc['protocol']['n']} samples: {shown}", flush=True)
    return doc


def print_plan(run_dir: Path) -> None:
    p = json.loads((run_dir / "plan.json").read_text())["predicted"]
    if any(p.get(k) is None for k in ("params", "peak_bytes_estimate", "flops_per_step")):  # the planner could not tell
        print(f"      plan: not predicted ({'; '.join(p.get('notes', [])) or 'see plan.json'})", flush=True)
        return
    gib = p["peak_bytes_estimate"] / 2**30
    secs = p.get("seconds_per_step")
    per_step = f"{secs:.1f} s/step" if isinstance(secs, (int, float)) else "time: no hardware profile"
    print(f"      plan: {p['params'] / 1e6:.0f}M parameters, {p['models_in_memory']} model(s) in memory, "
          f"peak ≈ {gib:.1f} GiB, {p['tokens_per_step']:.0f} tokens and {p['flops_per_step'] / 1e12:.2f} TFLOP per step, "
          f"{per_step}", flush=True)


def progress_line(step: int, total: int, row: dict, t0: float, start: int, tail_s: float) -> str:
    """`step 12/40 | reward 0.53 | held-out pass@1 0.61 [0.52, 0.70] | 0:45 elapsed, ~1:50 left`"""
    done = time.perf_counter() - t0
    left = done / max(step - start, 1) * (total - step) + tail_s
    text = f"      step {step:>3}/{total} | reward {row['reward/mean']:.3f}"
    if "eval/pass@1" in row:
        text += f" | held-out pass@1 {row['eval/pass@1']:.3f} [{row['eval/pass@1_low']:.3f}, {row['eval/pass@1_high']:.3f}]"
    return text + f" | {clock(done)} elapsed, ~{clock(left)} left"


def trajectory(cfg: rl_recipe.RLConfig) -> dict:
    """The RL keys that decide the trained weights (training/resume.py: all but where output goes, how often it
    is saved or logged, alarms), max_steps included: what a reused evaluation of its model must match."""
    return {k: v for k, v in resume.flatten(cfg.model_dump(mode="json")).items() if not resume._matches(k, resume.FREE)}


def check_rl_stage(cfg: rl_recipe.RLConfig, out: Path) -> bool:
    """Whether the RL stage in `out` is finished with this very config (then it is reused). A run in `out` made
    with other trajectory keys is refused naming them (rl.resume=force continues it with the new ones)."""
    saved = out / "config.yaml"
    if not saved.is_file() or not any(out.glob("checkpoints/step-*")):
        return False
    old = yaml.safe_load(saved.read_text()) or {}
    diffs = resume.differences(old, cfg.model_dump(mode="json"))
    if diffs and cfg.resume != "force":
        listed = "; ".join(f"rl.{k}: {a!r} -> {b!r}" for k, a, b in diffs)
        raise UserError(f"{out} holds an RL run made with other keys ({listed}): pass fresh=true to start the "
                        "quickstart over, rl.resume=force to continue that run with the new values, or choose another output_dir")
    finished = (out / "summary.json").is_file() and (out / "final" / "config.json").is_file()
    return finished and not diffs and old.get("max_steps") == cfg.max_steps


def rl_stage_config(cfg: rl_recipe.RLConfig) -> rl_recipe.RLConfig:
    """The RL stage always resumes (a rerun continues it); rl.resume=force is kept."""
    return cfg.model_copy(update={"resume": "force" if cfg.resume == "force" else True})


def run_rl_stage(cfg: rl_recipe.RLConfig, eval_s: float) -> dict:
    """GRPO, resumed from its newest checkpoint when one exists; skipped when it already finished."""
    out = Path(cfg.output_dir)
    cfg = rl_stage_config(cfg)
    if check_rl_stage(cfg, out):
        print(f"[2/4] {cfg.algo.upper()}: reusing the finished run in {out}", flush=True)
        return json.loads((out / "summary.json").read_text())
    print(f"[2/4] {cfg.algo.upper()} on {cfg.data}, reward {cfg.reward}, {cfg.max_steps} steps of "
          f"{cfg.prompts_per_step} prompts x {cfg.group_size} samples", flush=True)
    run = rl_recipe.setup(cfg)
    print_plan(out)
    if run.life.start:
        print(f"      resuming from step {run.life.start}", flush=True)
    t0 = time.perf_counter()

    def show(done: int, row: dict) -> None:
        print(progress_line(done, cfg.max_steps, row, t0, run.life.start, eval_s), flush=True)

    return rl_recipe.run_steps(run, on_step=show)


QUICKSTART_FILES = ("quickstart.json", "compare.json", "report.html", "eval_before", "rl", "eval_after")


def validate(cfg: QuickstartConfig) -> None:
    """The model, the tokenizer and both datasets exist and the reward fits the data: checked before `fresh=true`
    deletes anything and before the first evaluation (UserError naming what is wrong)."""
    from posttrain.data import formats
    from posttrain.eval.prompts import load_rows
    from posttrain.models.loading import load_tokenizer
    from posttrain.rewards.build import build_reward

    load_tokenizer(cfg.model, cfg.rl.chat_template, cfg.rl.chat_template_args)
    rows, _ = formats.load(cfg.rl.data, allowed=("prompt_only", "prompt_completion"), seed=cfg.rl.seed)
    build_reward(cfg.rl.reward, cfg.rl.reward_args, rows, cfg.rl.sampling.max_new_tokens)
    load_rows(cfg.eval.data)


def remove_quickstart_folder(out: Path) -> None:
    """fresh=true: delete `out` only when it is a quickstart folder (it holds only what the quickstart writes)."""
    if not out.exists():
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in QUICKSTART_FILES)
    if foreign:
        raise UserError(f"fresh=true would delete {out}, which holds files the quickstart did not write "
                        f"({', '.join(foreign[:5])}): choose another output_dir, or delete the folder yourself")
    shutil.rmtree(out)


def main(argv: list[str]) -> None:
    args = ["--config", str(CONFIG)] if CONFIG.is_file() else []
    cfg = parse_args(QuickstartConfig, [*args, *argv], prog="posttrain quickstart")
    out = check_output_dir(cfg.output_dir)
    cfg.rl.model, cfg.rl.output_dir = cfg.model, str(out / "rl")
    validate(cfg)  # before anything is deleted or computed
    if cfg.fresh:
        remove_quickstart_folder(out)
    else:  # an RL stage made with other keys is refused before the first evaluation
        check_rl_stage(rl_stage_config(cfg.rl), out / "rl")
    t0 = time.perf_counter()
    print(f"[1/4] evaluate {cfg.model} on {cfg.eval.data}", flush=True)
    before = run_eval_stage(cfg.eval, cfg.model, out / "eval_before", "      base model")
    eval_s = before["timing"].get("wall_s", 30.0)
    run_rl_stage(cfg.rl, eval_s)
    print(f"[3/4] evaluate the trained model ({out / 'rl' / 'final'})", flush=True)
    after = run_eval_stage(cfg.eval, str(out / "rl" / "final"), out / "eval_after", "      trained model",
                           trained_by=trajectory(cfg.rl))
    print("[4/4] compare (paired over the same problems and sample seeds)", flush=True)
    before["_path"], after["_path"] = str(out / "eval_before" / "results.json"), str(out / "eval_after" / "results.json")
    result = compare(before, after, curve=True)  # + pass@k at every k: sharpening or expanding
    from posttrain.eval.selection import equal_tokens

    try:  # RL's gain next to best-of-N and majority on the base model, at equal generated tokens (the same samples)
        result["equal_tokens"] = equal_tokens(before, after)
    except ValueError as e:  # an evaluation without saved samples or a math verifier
        print(f"      no equal-token comparison: {e}", flush=True)
    write_json(out / "compare.json", result)
    print_comparison(result)
    write_json(out / "quickstart.json", {"machine": machine(), "seconds": time.perf_counter() - t0}, indent=None)
    report = write_quickstart_report(out)
    print(f"\nquickstart done in {clock(time.perf_counter() - t0)}; report: {report.resolve()}")
