"""Rejection sampling (best-of-N) -> SFT, iterated: `posttrain rs`.

One round reads top to bottom; the phase names are the timer names:
    1. sample   N completions per prompt from the current model (the built-in engine)
    2. score    the reward on every completion (None = does not apply: never kept)
    3. select   per prompt the best completion (ties: the first drawn), or every one >= threshold
    4. write    the kept set as SFT data, round-R/kept.jsonl (conversation format)
    5. sft      posttrain.recipes.sft.train on it, starting from the current model -> round-R/sft/final
Round r samples from the model round r−1 trained (round 1 from `model`); after the last round the
final model is sampled once more on the same prompts: the reward after.

KL to the sampler (docs/rs.md): the best of N draws is within log N − (N−1)/N nats of the sampling
policy (Stiennon et al. 2020; an upper bound for any reward, ties included: Beirami et al. 2024).
Keeping every completion above a threshold is the policy conditioned on passing instead: KL = −log
P(pass), estimated per prompt as −log(k/N) from the k of N that passed. SFT on the kept set moves the
model toward that distribution; the bound is per round, so R rounds can drift up to R times as far.
As in RAFT (Dong et al. 2023) and Llama 2's rejection sampling, completions are re-tokenised from
their text by the chat template for SFT; an empty completion cannot be an SFT target and is never kept.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from posttrain.config import (
    Config,
    ReportTo,
    backend_field,
    chat_template_args_field,
    chat_template_field,
    parse_args,
    report_to_field,
    unused_key,
)
from posttrain.data import formats
from posttrain.data.templates import check_template, render_prompt
from posttrain.errors import UserError
from posttrain.models.device import resolve_device
from posttrain.models.loading import load_tokenizer
from posttrain.monitor.metrics import MetricsWriter, PhaseTimer
from posttrain.outputs import to_json, write_json
from posttrain.plan.cost import bon_kl
from posttrain.recipes import sft as sft_recipe
from posttrain.recipes.sft import SFTConfig
from posttrain.rollout.backends import build_backend
from posttrain.rollout.engine import EngineConfig
from posttrain.rollout.settings import SamplingSettings
from posttrain.rollout.types import Request
from posttrain.training import resume
from posttrain.training.lifecycle import RunLifecycle
from posttrain.training.run import progress

# keys of the SFT section that rs sets itself, each round
SET_BY_RS = ("model", "data", "output_dir", "resume", "seed", "device", "backend", "chat_template", "chat_template_args",
             "epochs")  # epochs: rs's own (top level) sets train.max_steps from each round's kept rows


class RSTrainSettings(SFTConfig):
    """The SFT recipe's config with rs's defaults (a subclass, so they hold whichever keys are given)."""

    packing: bool = Field(False, description="pack samples into rows (off in rs: `epochs` counts samples, a step is batch_size samples)")
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="share of kept rows held out for eval loss (rs: 0, the reward is the evaluation)")
    sample_every: int = Field(0, ge=0, description="greedy generations to samples.jsonl every N steps (rs: 0, off)")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (rs: 0, only at the end of the round's SFT)")
    progress: bool = Field(False, description="progress bar of each round's SFT")


class RSConfig(Config):
    """posttrain rs: rejection sampling (best-of-N) -> SFT, iterated `rounds` times."""

    model: str = Field("tiny-random", description="HF folder, built-in name or Hub id: the model round 1 samples from")
    data: str = Field("arithmetic", description="prompt-only dataset (`prompt` + the columns the reward needs, e.g. `answer`)")
    output_dir: str = Field("runs/rs", description="run directory (round-R/kept.jsonl, round-R/sft/, metrics.jsonl, report.html)")
    seed: int = Field(0, description="seed for sampling, initialisation and data order")
    resume: bool | Literal["force"] = Field(False, description="continue after the last finished round (a round's SFT resumes from its "
                                           "checkpoints); changed keys are refused unless resume=force (as in every recipe)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto | cpu | cuda | cuda:N")
    dtype: str = Field("float32", description="weights dtype while sampling")
    backend: str = backend_field()
    chat_template: str = chat_template_field()
    chat_template_args: dict = chat_template_args_field()
    reward: str = Field("math", description="reward or weighted composition: 'math', 'math:1.0,format:0.2', 'my.py:fn'")
    reward_args: dict = Field(default_factory=dict, description="options per reward, e.g. {math: {mode: last_number}}")
    n: int = Field(8, ge=1, description="samples per prompt (N of best-of-N)")
    keep: str = Field("best", pattern="^(best|above)$", description="best: the best of N per prompt (ties: the first drawn) | above: every sample >= threshold")
    threshold: float | None = Field(None, description="minimum reward of a kept sample (required with keep=above; with best: the best must reach it)")
    keep_truncated: bool = Field(False, description="keep samples cut at max_new_tokens (SFT would teach stopping there)")
    rounds: int = Field(1, ge=1, description="sample -> select -> SFT rounds; round r samples from round r-1's model")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(kv_cache_mb=512),
                                 description="built-in engine (max_num_seqs defaults to min(256, prompts × n))")
    sft: bool = Field(True, description="run SFT on the kept set (false: only write round-1/kept.jsonl)")
    epochs: float = Field(1.0, gt=0, description="SFT epochs over each round's kept set (sets train.max_steps unless given)")
    train: RSTrainSettings = Field(default_factory=RSTrainSettings,
                                 description=f"the SFT recipe's settings ({', '.join(SET_BY_RS)} are set by rs)")
    samples_per_round: int = Field(4, ge=0, description="kept samples written to samples.jsonl per round")
    progress: bool = Field(True, description="show a progress bar")
    report_to: ReportTo = report_to_field()

    @model_validator(mode="after")
    def _check(self):
        if self.keep == "above" and self.threshold is None:
            raise ValueError("keep=above needs a threshold (e.g. threshold=1 for a pass/fail verifier)")
        if not self.sft and self.rounds > 1:
            raise ValueError("rounds > 1 needs sft=true (without training every round samples the same model)")
        if not self.sft:  # the SFT's keys would be ignored: refused, as every key a run does not read
            sft_only = (lambda c: False, "the SFT of the kept set (sft=true)")
            unused = unused_key(self.train, dict.fromkeys(RSTrainSettings.model_fields, sft_only))
            if unused:
                raise ValueError(f"train.{unused}")
            unused = unused_key(self, {"epochs": sft_only})
            if unused:
                raise ValueError(unused)
        if self.n > 1 and self.sampling.temperature <= 0:
            raise ValueError("n > 1 needs sampling.temperature > 0 (greedy draws are all the same)")
        # at its default, a key rs sets is what the run's own config.yaml holds (--config <run>/config.yaml reads back)
        clash = [k for k in SET_BY_RS if k in self.train.model_fields_set
                 and getattr(self.train, k) != RSTrainSettings.model_fields[k].get_default(call_default_factory=True)]
        if clash:
            raise ValueError(f"train.{clash[0]} is set by rs each round: use the top-level key '{clash[0]}'")
        return self


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    finish_reason: str
    reward: float | None = None


@dataclass(eq=False)
class RSRun:
    cfg: RSConfig
    life: RunLifecycle
    tok: object
    rows: list
    reward_fn: object
    metrics: MetricsWriter
    timer: PhaseTimer = field(default_factory=PhaseTimer)


# ---------------------------------------------------------------- phases


def sample(engine, tok, rows: list[formats.Row], cfg: RSConfig, seed: int) -> list[list[Sample]]:
    """N completions of each row's prompt; prompt i draws with seed + i."""
    requests = [Request(render_prompt(tok, r.data["prompt"]), cfg.sampling.params(n=cfg.n, seed=seed + i), request_id=i)
                for i, r in enumerate(rows)]
    groups = []
    for row, res in zip(rows, engine.generate(requests)):
        if res.error:
            raise row.error("prompt", f"generation refused: {res.error}")
        groups.append([Sample(c.text if c.text is not None else tok.decode(c.token_ids, skip_special_tokens=True),
                              list(c.token_ids), c.finish_reason) for c in res.samples])
    return groups


def score(reward_fn, rows: list[formats.Row], groups: list[list[Sample]]) -> dict:
    """Fill `reward` (TRL convention: dataset columns per sample, plus `completion_ids`); returns the
    per-reward metrics of a composition of several rewards."""
    flat = [(row, s) for row, g in zip(rows, groups) for s in g]
    extra = {k for row in rows for k in row.data if k not in ("prompt", "messages")}
    columns = {k: [row.data.get(k) for row, _ in flat] for k in extra}
    columns["completion_ids"] = [s.token_ids for _, s in flat]
    values = reward_fn([row.data["prompt"] for row, _ in flat], [s.text for _, s in flat], **columns)
    for (_, s), v in zip(flat, values):
        s.reward = v
    parts = getattr(reward_fn, "parts", ())
    if len(parts) < 2:  # one reward: its metrics are reward/mean and reward/std
        return {}
    return {k: v for k, v in getattr(reward_fn, "last_metrics", {}).items() if k.endswith(("/mean", "/errors", "/none"))}


def select(groups: list[list[Sample]], cfg: RSConfig) -> tuple[list[list[Sample]], dict]:
    """The kept samples of each group and the selection's metrics. A candidate has a reward, non-empty
    text and (unless keep_truncated) was not cut at the length limit."""
    kept, n_empty, n_cut, kl_terms = [], 0, 0, []
    for g in groups:
        scored = [s for s in g if s.reward is not None]
        empty = [not s.text.strip() for s in scored]
        cut = [not e and s.finish_reason == "length" and not cfg.keep_truncated for s, e in zip(scored, empty)]
        n_empty, n_cut = n_empty + sum(empty), n_cut + sum(cut)
        cands = [s for s, e, c in zip(scored, empty, cut) if not (e or c)]
        if cfg.keep == "best":
            best = max(cands, key=lambda s: s.reward, default=None)  # max keeps the first of equal rewards
            chosen = [best] if best is not None and (cfg.threshold is None or best.reward >= cfg.threshold) else []
        else:
            chosen = [s for s in cands if s.reward >= cfg.threshold]
            if chosen:
                kl_terms.append(-math.log(len(chosen) / len(scored)))
        kept.append(chosen)
    n_kept, n_scored = sum(map(len, kept)), sum(s.reward is not None for g in groups for s in g)
    metrics = {"kept/samples": n_kept, "kept/frac": n_kept / max(n_scored, 1),
               "kept/prompt_frac": sum(bool(k) for k in kept) / max(len(groups), 1),
               "kept/reward_mean": statistics.fmean(s.reward for k in kept for s in k) if n_kept else math.nan,
               "dropped/empty": n_empty, "dropped/truncated": n_cut}
    if cfg.keep == "best":
        metrics["kl/bon_bound"] = bon_kl(cfg.n)
    else:
        metrics["kl/filter_estimate"] = statistics.fmean(kl_terms) if kl_terms else math.nan
    return kept, metrics


def reward_metrics(groups: list[list[Sample]]) -> dict:
    """Reward of the sampling policy (mean over applicable samples), of best-of-N, and the lengths."""
    values = [s.reward for g in groups for s in g if s.reward is not None]
    best = [max(r) for g in groups if (r := [s.reward for s in g if s.reward is not None])]
    every = [s for g in groups for s in g]
    return {"reward/mean": statistics.fmean(values) if values else math.nan,
            "reward/std": statistics.pstdev(values) if len(values) > 1 else math.nan,
            "reward/none_frac": 1 - len(values) / max(len(every), 1),
            "reward/best_mean": statistics.fmean(best) if best else math.nan,
            "response_length/mean": statistics.fmean(len(s.token_ids) for s in every) if every else math.nan}


def sft_row(prompt, text: str, reward: float, round_: int) -> dict:
    """One SFT row: a conversation when the prompt is one, else prompt + completion text."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "completion": text, "reward": reward, "round": round_}
    return {"messages": [*prompt, {"role": "assistant", "content": text}], "reward": reward, "round": round_}


def write_kept(path: Path, rows: list[formats.Row], kept: list[list[Sample]], round_: int) -> int:
    """round-R/kept.jsonl in one format: conversations, or prompt + completion when any prompt is plain
    text (then conversation prompts get their completion as an assistant message)."""
    plain = any(isinstance(r.data["prompt"], str) for r in rows)
    lines = []
    for row, ks in zip(rows, kept):
        for s in ks:
            out = sft_row(row.data["prompt"], s.text, s.reward, round_)
            if plain and "messages" in out:
                out = {"prompt": row.data["prompt"], "completion": [out["messages"][-1]], "reward": s.reward, "round": round_}
            lines.append(to_json(out))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return len(lines)


def sft_config(cfg: RSConfig, model: str, data: Path, out: Path, n_rows: int) -> SFTConfig:
    """The SFT section with the round's model, data and directory; max_steps from `epochs` unless given."""
    update = {"model": model, "data": str(data), "output_dir": str(out), "resume": cfg.resume, "seed": cfg.seed,
              "device": cfg.device, "backend": cfg.backend, "chat_template": cfg.chat_template,
              "chat_template_args": cfg.chat_template_args, "epochs": None}
    if "max_steps" not in cfg.train.model_fields_set:
        update["max_steps"] = max(1, math.ceil(cfg.epochs * n_rows / cfg.train.batch_size))
    return cfg.train.model_copy(update=update)


# ---------------------------------------------------------------- one round


def draw(run: RSRun, model_path: str, seed: int) -> list[list[Sample]]:
    """Load `model_path`, sample N per prompt, free the model (SFT loads its own copy)."""
    from posttrain.models.loading import load_model  # looked up at call time: tests replace posttrain.models.loading.load_model

    cfg = run.cfg
    model = load_model(model_path, dtype=cfg.dtype, seed=cfg.seed).to(resolve_device(cfg.device)).eval()
    defaults = {"max_num_seqs": min(256, len(run.rows) * cfg.n), "seed": cfg.seed}
    engine = build_backend(cfg.backend, model, run.tok, cfg.engine.model_copy(update={
        k: v for k, v in defaults.items() if k not in cfg.engine.model_fields_set}), model_name=model_path, dtype=cfg.dtype)
    try:
        return sample(engine, run.tok, run.rows, cfg, seed)
    finally:
        del engine, model
        gc.collect()


def run_round(run: RSRun, r: int, model_path: str) -> tuple[dict, str]:
    """Round r (1-based): sample from `model_path`, score, select, write, SFT. -> (metrics row, next model)."""
    cfg, timer, out = run.cfg, run.timer, run.life.out / f"round-{r}"
    # 1. sample
    with timer("sample"):
        groups = draw(run, model_path, seed=round_seed(cfg, r))
    # 2. score
    with timer("score"):
        per_reward = score(run.reward_fn, run.rows, groups)
    # 3. select
    kept, select_metrics = select(groups, cfg)
    # 4. write
    n_rows = write_kept(out / "kept.jsonl", run.rows, kept, r)
    log_samples(run, r, kept)
    row = {**reward_metrics(groups), **per_reward, **select_metrics}
    # 5. sft
    next_model = model_path
    if cfg.sft and n_rows:
        with timer("sft"):
            summary = sft_recipe.train(sft_config(cfg, model_path, out / "kept.jsonl", out / "sft", n_rows))
        next_model = str(out / "sft" / "final")
        row.update({"sft/steps": summary["steps"], "sft/first_loss": summary["first_loss"],
                    "sft/last_loss": summary["last_loss"]})
        if "probe_loss_delta" in summary:
            row["sft/probe_loss_delta"] = summary["probe_loss_delta"]
    elif cfg.sft:
        print(f"round {r}: no sample was kept (threshold {cfg.threshold}); the model is unchanged")
    row.update(timer.pop())
    write_json(out / "round.json", {"row": row, "model": next_model}, indent=None, default=str)
    return row, next_model


def round_seed(cfg: RSConfig, r: int) -> int:
    return cfg.seed * 7919 + r * 1_000_003


def log_samples(run: RSRun, r: int, kept: list[list[Sample]]) -> None:
    with (run.life.out / "samples.jsonl").open("a") as f:
        shown = [(row, s) for row, ks in zip(run.rows, kept) for s in ks][: run.cfg.samples_per_round]
        for row, s in shown:
            f.write(to_json({"step": r, "prompt": str(row.data["prompt"]), "completion": s.text, "reward": s.reward}) + "\n")


# ---------------------------------------------------------------- run


def setup(cfg: RSConfig) -> RSRun:
    """Data, reward and the run directory, checked before any model loads."""
    from posttrain.rewards.build import build_reward  # math-verify (slow)

    out = Path(cfg.output_dir)
    if not cfg.resume and any(out.glob("round-*/round.json")):
        raise UserError(f"{out} already holds an rs run: pass resume=true, or choose another output_dir")
    rows, _ = formats.load(cfg.data, allowed=("prompt_only", "prompt_completion"), seed=cfg.seed)
    reward_fn = build_reward(cfg.reward, cfg.reward_args, rows, cfg.sampling.max_new_tokens)  # columns checked against the data
    tok = load_tokenizer(cfg.model, cfg.chat_template, cfg.chat_template_args)
    check_template(tok, rows)
    if cfg.resume and any(out.glob("round-*/round.json")):  # the resume contract (training/resume.py)
        for note in resume.check_record(cfg, resume.config_record(out), out, "its finished rounds"):
            print(note, flush=True)
    life = RunLifecycle(cfg, checkpoints=False)  # the rounds' SFT runs keep the checkpoints
    done = len(finished_rounds(life.out, cfg.rounds)) if cfg.resume else None
    run = RSRun(cfg, life, tok, rows, reward_fn, life.metrics_from(done))
    if not done:
        (life.out / "samples.jsonl").write_text("")
    return run


def finished_rounds(out: Path, rounds: int) -> list[dict]:
    done = []
    for r in range(1, rounds + 1):
        path = out / f"round-{r}" / "round.json"
        if not path.is_file():
            break
        done.append(json.loads(path.read_text()))
    return done


def train(cfg: RSConfig) -> dict:
    """All rounds, then the final model's reward on the same prompts; returns the summary."""
    run = setup(cfg)
    done = finished_rounds(run.life.out, cfg.rounds) if cfg.resume else []
    rows = [d["row"] for d in done]
    model_path = done[-1]["model"] if done else cfg.model
    bar = progress(cfg.rounds, len(done), "rs", cfg.progress)
    for r in range(len(done) + 1, cfg.rounds + 1):
        row, model_path = run_round(run, r, model_path)
        rows.append(run.metrics.write(r, row))
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward/mean']:.3f}", kept=f"{row['kept/frac']:.2f}")
    bar.close()
    final = None
    if cfg.sft and model_path != cfg.model:  # the reward after: the final model on the same prompts
        with run.timer("sample"):
            groups = draw(run, model_path, seed=round_seed(cfg, cfg.rounds + 1))
        with run.timer("score"):
            score(run.reward_fn, run.rows, groups)
        final = run.metrics.write(cfg.rounds + 1, {**reward_metrics(groups), "final": 1, **run.timer.pop()})
    return finish(run, rows, final, model_path)


def finish(run: RSRun, rows: list[dict], final: dict | None, model_path: str) -> dict:
    cfg = run.cfg
    per_round = {f"round {i}": {"reward (sampler)": r.get("reward/mean"), "reward (best of N)": r.get("reward/best_mean"),
                                "kept fraction": r.get("kept/frac"), "prompts with a kept sample": r.get("kept/prompt_frac"),
                                **({"BoN KL bound (nats)": r["kl/bon_bound"]} if "kl/bon_bound" in r else
                                   {"filter KL estimate (nats)": r.get("kl/filter_estimate")}),
                                "SFT steps": r.get("sft/steps")} for i, r in enumerate(rows, 1)}
    summary = {"rounds": cfg.rounds, "n": cfg.n, "keep": cfg.keep, "threshold": cfg.threshold,
               "reward_before": rows[0]["reward/mean"] if rows else math.nan,
               "reward_best_of_n": rows[0]["reward/best_mean"] if rows else math.nan,
               "reward_after": final["reward/mean"] if final else None,
               "kept_frac": [r.get("kept/frac") for r in rows],
               "bon_kl_bound_per_round": bon_kl(cfg.n) if cfg.keep == "best" else None,
               "final_model": model_path}
    sft_reports = {f"round {i}": str(run.life.out / f"round-{i}" / "sft" / "report.html") for i in range(1, len(rows) + 1)
                   if (run.life.out / f"round-{i}" / "sft" / "report.html").is_file()}
    run.life.finish(summary, f"Rejection sampling (best of {cfg.n}, {cfg.rounds} round(s)) — {cfg.model}",
                    {"summary": summary, "rounds": per_round, "SFT reports": sft_reports})
    return summary


def main(argv: list[str]) -> None:
    cfg = parse_args(RSConfig, argv, prog="posttrain rs")  # a bad key or value: ConfigError, reported by the CLI
    t0 = time.perf_counter()
    s = train(cfg)
    fmt = lambda x: "n/a" if x is None or x != x else f"{x:.3f}"  # None / NaN: no reward applied
    after = f" -> {fmt(s['reward_after'])} after {cfg.rounds} round(s)" if s["reward_after"] is not None else ""
    print(f"reward {fmt(s['reward_before'])} (best of {cfg.n}: {fmt(s['reward_best_of_n'])}){after}; "
          f"{time.perf_counter() - t0:.0f} s; run directory: {cfg.output_dir}")
