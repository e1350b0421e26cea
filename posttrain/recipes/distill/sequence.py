"""Sequence-level distillation (Kim & Rush 2016): the teacher generates, the student does SFT on it.

    1. generate  the teacher samples `n` completions per prompt with the built-in engine (rejection
                 sampling's `draw`, recipes/rs.py; the teacher's own tokenizer and chat template)
    2. filter    with a `reward` (a verifier): keep=best (best of n, ties to the first drawn) or
                 keep=above (every sample >= threshold), rejection sampling's `select`; keep=all keeps
                 every finished, non-empty sample. Samples cut at max_new_tokens are dropped unless
                 keep_truncated=true
    3. write     teacher/kept.jsonl (conversations, or prompt + completion), data any SFT trainer reads
    4. sft       the SFT recipe trains the student on it into sft/ (rs's `sft_config`: `epochs` over the
                 kept rows unless max_steps is given); sft/final is the distilled student

Only text passes from teacher to student (each re-tokenised by its own chat template), so teacher and
student may use different tokenizers. With resume=true a finished teacher/kept.jsonl is reused (the
teacher is not loaded again; its metrics are read back from teacher/metrics.json) and the SFT resumes
from its checkpoints.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from posttrain.data import formats
from posttrain.data.templates import render_prompt
from posttrain.errors import UserError
from posttrain.models.loading import load_tokenizer
from posttrain.monitor.metrics import MetricsWriter, PhaseTimer
from posttrain.outputs import write_json
from posttrain.plan import predict
from posttrain.plan.measure import Measured, write_plan
from posttrain.recipes import rs
from posttrain.recipes import sft as sft_recipe
from posttrain.recipes.distill.config import NO_REWARD, DistillConfig, sft_settings
from posttrain.recipes.distill.teacher import teacher_spec, write_distill_measured
from posttrain.rewards.build import build_reward
from posttrain.training.lifecycle import RunLifecycle
from posttrain.training.plan import plan_dtype
from posttrain.training.settings import derive


def rs_settings(cfg: DistillConfig) -> rs.RSConfig:
    """Rejection sampling's config with the teacher as the sampler and the student's SFT settings: every field
    the configs share (training/settings.py), the teacher's name and dtype in the sampler's keys."""
    update = {"max_steps": cfg.max_steps} if "max_steps" in cfg.model_fields_set else {}  # else rs sets it from `epochs`
    train = derive(sft_settings(cfg), rs.RSTrainSettings, exclude=(*rs.SET_BY_RS, "max_steps"), **update)
    return derive(cfg, rs.RSConfig, model=cfg.teacher, dtype=cfg.teacher_dtype, reward=cfg.reward or NO_REWARD,
                  keep="best" if cfg.keep == "all" else cfg.keep, train=train, progress=False)


def keep_finished(groups: list[list[rs.Sample]], keep_truncated: bool) -> tuple[list[list[rs.Sample]], dict]:
    """keep=all: every non-empty sample (and, unless keep_truncated, not cut at the length limit)."""
    kept = [[s for s in g if s.text.strip() and (keep_truncated or s.finish_reason != "length")] for g in groups]
    n_all, n_kept = sum(map(len, groups)), sum(map(len, kept))
    n_empty = sum(not s.text.strip() for g in groups for s in g)
    n_cut = sum(bool(s.text.strip()) and s.finish_reason == "length" and not keep_truncated for g in groups for s in g)
    return kept, {"kept/samples": n_kept, "kept/frac": n_kept / max(n_all, 1),
                  "kept/prompt_frac": sum(bool(k) for k in kept) / max(len(groups), 1),
                  "dropped/empty": n_empty, "dropped/truncated": n_cut}


def nothing_kept(cfg: DistillConfig, metrics: dict) -> UserError:
    """Why no teacher sample was kept, and what keeps some."""
    cut, empty = metrics.get("dropped/truncated", 0), metrics.get("dropped/empty", 0)
    why = []
    if cut:
        why.append(f"{cut} were cut at max_new_tokens={cfg.sampling.max_new_tokens} (raise max_new_tokens, or "
                   "keep_truncated=true)")
    if empty:
        why.append(f"{empty} were empty")
    if cfg.keep != "all":
        why.append(f"keep={cfg.keep} with threshold {cfg.threshold} kept none by reward '{cfg.reward}'")
    total = metrics.get("teacher/samples", 0)
    return UserError(f"no teacher sample was kept, nothing to train the student on: of {total} samples, "
                     + "; ".join(why or ["none qualified"]))


def teacher_data(cfg: DistillConfig, run: rs.RSRun, prompt_tokens: list[int], timer: PhaseTimer,
                 measured: Measured) -> tuple[Path, int, dict]:
    """teacher/kept.jsonl (generated now, or reused on resume) -> (path, rows, metrics; on resume those
    teacher/metrics.json kept, and teacher/reused)."""
    path = run.life.out / "teacher" / "kept.jsonl"
    saved = path.parent / "metrics.json"
    if cfg.resume and path.is_file():
        metrics = json.loads(saved.read_text()) if saved.is_file() else {}
        return path, sum(1 for line in path.read_text().splitlines() if line.strip()), {**metrics, "teacher/reused": 1}
    with timer("generate"):  # 1.
        groups = rs.draw(run, cfg.teacher, seed=rs.round_seed(run.cfg, 1))
    generated = [len(s.token_ids) for g in groups for s in g]
    measured.add_step(sum(generated) + sum(prompt_tokens[i] * len(g) for i, g in enumerate(groups)), sum(generated))
    metrics = {"teacher/samples": len(generated), "teacher/generated_tokens": sum(generated),
               "response_length/mean": statistics.fmean(generated) if generated else math.nan}
    if run.reward_fn is not None:  # 2.
        with timer("score"):
            metrics.update(rs.score(run.reward_fn, run.rows, groups))
        metrics.update(rs.reward_metrics(groups))
    if cfg.keep == "all":
        kept, select_metrics = keep_finished(groups, cfg.keep_truncated)
    else:
        kept, select_metrics = rs.select(groups, run.cfg)
    n_rows = rs.write_kept(path, run.rows, kept, 1)  # 3.
    metrics = {**metrics, **select_metrics}
    write_json(saved, metrics, indent=None)
    return path, n_rows, metrics


def train(cfg: DistillConfig) -> dict:
    rs_cfg = rs_settings(cfg)
    rows, _ = formats.load(cfg.data, allowed=("prompt_only", "prompt_completion"), seed=cfg.seed)
    reward_fn = (build_reward(rs_cfg.reward, rs_cfg.reward_args, rows, rs_cfg.sampling.max_new_tokens)
                 if cfg.reward else None)  # columns checked before any model loads
    teacher_tok = load_tokenizer(cfg.teacher)
    life = RunLifecycle(cfg)
    run = rs.RSRun(rs_cfg, life, teacher_tok, rows, reward_fn, MetricsWriter(life.out / "metrics.jsonl"))
    prompt_tokens = [len(render_prompt(teacher_tok, r.data["prompt"])) for r in rows]
    timer, measured, t0 = PhaseTimer(), Measured(), time.perf_counter()
    write_plan(life.out, plan_run(cfg, len(rows), prompt_tokens))
    data, n_rows, row = teacher_data(cfg, run, prompt_tokens, timer, measured)
    if not n_rows:
        raise nothing_kept(cfg, row)
    with timer("sft"):  # 4.
        sft_summary = sft_recipe.train(rs.sft_config(rs_cfg, cfg.model, data, life.out / "sft", n_rows))
    row.update({"sft/steps": sft_summary["steps"], "sft/first_loss": sft_summary["first_loss"],
                "sft/last_loss": sft_summary["last_loss"], "kept/rows": n_rows, **timer.pop()})
    run.metrics.write(1, row)
    plan = write_distill_measured(life.out, measured, {"generated_tokens": row.get("teacher/generated_tokens"),
                                                       "seconds": row.get("time/generate")})
    summary = {"mode": "sequence", "n": cfg.n, "keep": cfg.keep, "kept_rows": n_rows, "sft_steps": sft_summary["steps"],
               "first_loss": sft_summary["first_loss"], "last_loss": sft_summary["last_loss"],
               "teacher_reward": row.get("reward/mean"), "final_model": str(life.out / "sft" / "final"),
               "sft_report": str(life.out / "sft" / "report.html"),
               "seconds": time.perf_counter() - t0}
    life.finish(summary, f"Distillation (sequence) — {cfg.teacher} -> {cfg.model}",
                {"summary": summary, "teacher samples": {k: v for k, v in row.items() if not k.startswith("time/")},
                 "plan vs measured": plan.get("comparison", {})})
    return summary


def plan_run(cfg: DistillConfig, n_prompts: int, prompt_tokens: list[int]) -> dict:
    """The teacher's generation over every prompt × n (as one step; tokens assume max_new_tokens each) and
    the student's SFT on what it writes (its own plan.json in sft/)."""
    try:
        return predict(cfg.model, "distill", mode="sequence", teacher=teacher_spec(cfg.teacher, cfg.model),
                       batch=n_prompts * cfg.n, seq_len=cfg.sampling.max_new_tokens,
                       prompt_len=round(statistics.fmean(prompt_tokens)), steps=1,
                       dtype=plan_dtype(cfg.dtype), logit_copies=0)
    except UserError as e:  # e.g. a student given as an adapter folder: the planner needs a config
        return {"error": f"no prediction: {e}"}
