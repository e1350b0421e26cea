"""Distillation: `posttrain distill mode=logit | sequence | on_policy teacher=FOLDER model=STUDENT`.

    logit      the teacher's next-token distribution on fixed sequences (the data's assistant turns),
               stored once as a top-k cache with a tail bucket (recipes/distill_cache.py), memory-mapped
               and reused across epochs and runs; the student minimises a divergence to it per loss
               token (classic KD, Hinton et al. 2015), optionally mixed with the data's NLL (`ce_weight`).
    sequence   the teacher generates N completions per prompt (optionally filtered by a verifier), the
               student does SFT on them (Kim & Rush 2016); the rejection-sampling and SFT recipes do the
               work (recipes/distill_sequence.py). Works across tokenizers.
    on_policy  GKD (Agarwal et al. 2024): the student samples, the teacher scores every sampled position,
               loss = forward KL, reverse KL or JSD(β) per token over the student's tokens, optionally
               mixed with the RL loss of a reward (`rl_weight`); the RL recipe's loop does the sampling
               (recipes/distill_onpolicy.py).

Logit and on-policy modes need the same tokenizer: a mismatch is refused before any model loads,
naming the first token id that differs. One logit-mode step reads top to bottom:
    1. data     `batch_size` rows (packed or single samples), their cache rows
    2. forward  the student's hidden states at loss positions; lm_head in chunks
    3. loss     (1 − ce_weight)·D(P̄_teacher ‖ Q̄_student) + ce_weight·NLL, summed over the step's loss
                tokens / their count (accumulation == one large batch)
    4. update   clip, AdamW, schedule
    5. log      metrics.jsonl (with the cache counters: teacher tokens scored, rows read)
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from pydantic import Field, model_validator

from posttrain.algos import distill_losses
from posttrain.algos.presets import rl_preset
from posttrain.config import CommonConfig, parse_args
from posttrain.data.packing import IGNORE, collate
from posttrain.errors import UserError
from posttrain.eval.hook import EvalSettings
from posttrain.monitor.alarms import AlarmSettings
from posttrain.monitor.metrics import PhaseTimer
from posttrain.plan.measure import Measured, write_measured, write_plan
from posttrain.recipes import distill_cache
from posttrain.training.data_order import EpochSampler
from posttrain.training.optim import OptimSettings, build_optimizer, optimizer_step
from posttrain.training.run import progress, seed_everything
from posttrain.training.lifecycle import RunLifecycle
from posttrain.recipes.rl import RLConfig
from posttrain.recipes.rs import RSConfig
from posttrain.recipes.sft import SFTConfig
from posttrain.rollout.engine import EngineConfig
from posttrain.rollout.settings import SamplingSettings

MODES = ("on_policy", "logit", "sequence")
# The divergence when `divergence` is not given: classic KD is forward KL; on the student's own samples
# GKD found the mode-seeking reverse KL / JSD best for generation quality (Agarwal et al. 2024, §5).
DEFAULT_DIVERGENCE = {"logit": "forward_kl", "on_policy": "reverse_kl"}


def _like(cls, name: str, mode: str, **update):
    """The field `name` of another recipe's config (same default, constraints and meaning), tagged with the mode."""
    f = copy.copy(cls.model_fields[name])
    f.description = f"{mode}: {f.description}"
    for k, v in update.items():
        setattr(f, k, v)
    return f


class DistillConfig(CommonConfig):
    """posttrain distill: a student learns from a teacher, at the logit level (top-k cache), on teacher
    sequences, or on its own samples (GKD)."""

    mode: str = Field("on_policy", pattern="^(on_policy|logit|sequence)$", description="on_policy (GKD) | logit (top-k teacher cache) | sequence (teacher generates, student SFT)")
    model: str = Field("tiny-random", description="the student: HF folder, built-in name or Hub id")
    teacher: str = Field("", description="the teacher: any causal LM folder, a PEFT adapter folder (base + adapter), built-in name or Hub id")
    teacher_dtype: str = Field("float32", description="teacher weights dtype (it scores / generates in it)")
    data: str = Field("arithmetic", description="logit: sequences (messages | prompt+completion | text); on_policy, sequence: prompts (`prompt` + reward columns)")
    output_dir: str = Field("runs/distill", description="run directory")
    max_steps: int = Field(50, ge=0, description="optimizer steps (sequence: the SFT's steps; unset there: `epochs` over the kept set)")
    dtype: str = Field("float32", description="student weights dtype")
    divergence: str | None = Field(None, description=f"forward_kl | reverse_kl | jsd (posttrain.algos.distill_losses); default {DEFAULT_DIVERGENCE}")
    beta: float = Field(0.5, gt=0, lt=1, description="jsd: β of JSD(β) = β KL(P‖M) + (1−β) KL(Q‖M), M = βP + (1−β)Q")
    temperature: float = Field(1.0, gt=0, description="logit, on_policy: both distributions at this temperature in the divergence")
    optim: OptimSettings = Field(default_factory=OptimSettings)
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    progress: bool = Field(True, description="show a progress bar")
    # logit (and the SFT of sequence)
    top_k: int = Field(64, ge=1, description="logit: teacher log-probs stored per loss token (plus the tail mass)")
    cache_dtype: str = Field("float16", pattern="^(float16|float32)$", description="logit: dtype of the cached log-probs (float16: 2 bytes, SPEC's 256 B/token at k=64)")
    cache_dir: str = Field("", description="logit: where teacher caches live (empty: <output_dir>/../teacher-cache, next to the run)")
    teacher_batch_tokens: int = Field(4096, ge=64, description="logit: tokens per teacher forward while filling the cache")
    ce_weight: float = Field(0.0, ge=0, le=1, description="logit: weight of the data's NLL; loss = (1 − w)·divergence + w·NLL")
    batch_size: int = _like(SFTConfig, "batch_size", "logit, sequence")
    micro_batch_size: int = _like(SFTConfig, "micro_batch_size", "logit, sequence")
    max_length: int = _like(SFTConfig, "max_length", "logit, sequence")
    too_long: str = _like(SFTConfig, "too_long", "logit, sequence")
    packing: bool = _like(SFTConfig, "packing", "logit, sequence")
    pad_to_multiple_of: int = _like(SFTConfig, "pad_to_multiple_of", "logit, sequence")
    logit_chunk: int = _like(SFTConfig, "logit_chunk", "logit, on_policy")
    # on_policy
    prompts_per_step: int = _like(RLConfig, "prompts_per_step", "on_policy")
    group_size: int = _like(RLConfig, "group_size", "on_policy")
    micro_batch_tokens: int = _like(RLConfig, "micro_batch_tokens", "on_policy")
    rl_weight: float = Field(0.0, ge=0, le=1, description="on_policy: loss = (1 − w)·divergence + w·(the RL loss of `reward`) (GKD §3.2)")
    algo: str = Field("grpo", description="on_policy with rl_weight > 0: the RL algorithm of the reward term (posttrain rl presets)")
    reward: str = Field("", description="on_policy: the RL reward (logged; trained with rl_weight > 0); sequence: the verifier that filters teacher samples; empty: none")
    reward_args: dict = _like(RLConfig, "reward_args", "on_policy, sequence")
    mask_truncated: bool = _like(RLConfig, "mask_truncated", "on_policy")
    samples_per_log: int = _like(RLConfig, "samples_per_log", "on_policy")
    alarms: AlarmSettings = _like(RLConfig, "alarms", "on_policy")
    eval: EvalSettings = _like(RLConfig, "eval", "on_policy")
    # sampling (on_policy: the student; sequence: the teacher)
    sampling: SamplingSettings = _like(RLConfig, "sampling", "on_policy (student), sequence (teacher)")
    engine: EngineConfig = _like(RLConfig, "engine", "on_policy, sequence")
    # sequence
    n: int = _like(RSConfig, "n", "sequence")
    keep: str = Field("all", pattern="^(all|best|above)$", description="sequence: all (every finished sample) | best (best of n by `reward`) | above (every sample >= threshold)")
    threshold: float | None = _like(RSConfig, "threshold", "sequence")
    keep_truncated: bool = _like(RSConfig, "keep_truncated", "sequence")
    epochs: float = _like(RSConfig, "epochs", "sequence")

    MODE_KEYS: ClassVar[dict[str, tuple[str, ...]]] = {
        "logit": ("top_k", "cache_dtype", "cache_dir", "teacher_batch_tokens", "ce_weight"),
        "on_policy": ("prompts_per_step", "group_size", "micro_batch_tokens", "rl_weight", "algo", "mask_truncated",
                      "samples_per_log", "alarms", "eval"),
        "sequence": ("n", "keep", "threshold", "keep_truncated", "epochs"),
    }

    @model_validator(mode="after")
    def _check(self):
        if not self.teacher:
            raise ValueError("teacher: name the teacher model (a folder, built-in name or Hub id)")
        for mode, keys in self.MODE_KEYS.items():
            given = [k for k in keys if k in self.model_fields_set]
            if mode != self.mode and given:
                raise ValueError(f"{given[0]} applies to mode={mode} (mode is {self.mode})")
        if self.mode != "sequence":
            distill_losses.get(self.resolved_divergence)
        elif self.divergence is not None:
            raise ValueError("divergence: mode=sequence trains with the SFT loss on teacher text (no divergence)")
        rl_preset(self.algo)
        if self.rl_weight > 0 and not self.reward:
            raise ValueError("rl_weight > 0 needs a reward (reward=math, ...)")
        if self.mode == "sequence" and self.keep != "all" and not self.reward:
            raise ValueError(f"keep={self.keep} ranks teacher samples by a reward: give reward=...")
        if self.keep == "above" and self.threshold is None:
            raise ValueError("keep=above needs a threshold (e.g. threshold=1 for a pass/fail verifier)")
        if self.mode == "on_policy" and self.sampling.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 for on_policy (the student samples)")
        return self

    @property
    def resolved_divergence(self) -> str:
        return self.divergence or DEFAULT_DIVERGENCE[self.mode]

    @property
    def divergence_args(self) -> dict:
        return {"beta": self.beta} if self.resolved_divergence == "jsd" else {}


def sft_settings(cfg: DistillConfig, **update) -> SFTConfig:
    """The SFT recipe's config for the student (logit mode's data, sequence mode's training)."""
    keys = ("model", "data", "output_dir", "max_steps", "seed", "resume", "mixed_precision", "device", "dtype",
            "batch_size", "micro_batch_size", "max_length", "too_long", "packing", "pad_to_multiple_of", "logit_chunk",
            "optim", "save_every", "keep_checkpoints", "progress")
    values = {k: getattr(cfg, k) for k in keys}
    return SFTConfig(**{**values, "eval_fraction": 0.0, "forgetting_probe": False, "sample_every": 0, **update})


def load_checked_tokenizers(cfg: DistillConfig):
    """(student tokenizer, teacher tokenizer); logit and on-policy modes refuse different vocabularies."""
    from posttrain.models.loading import load_tokenizer
    from posttrain.recipes.distill_teacher import check_same_tokenizer

    tok, teacher_tok = load_tokenizer(cfg.model), load_tokenizer(cfg.teacher)
    if cfg.mode != "sequence":
        check_same_tokenizer(tok, teacher_tok, cfg.model, cfg.teacher, cfg.mode)
    return tok, teacher_tok


# ---------------------------------------------------------------- logit mode


@dataclass(eq=False)
class LogitRun:
    cfg: DistillConfig
    life: RunLifecycle
    tok: object
    samples: list
    units: list
    index: dict  # id(sample) -> its row in the cache's data order
    cache: distill_cache.TeacherCache
    cache_info: dict
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    sampler: EpochSampler
    device: torch.device
    metrics: object = None
    measured: Measured = field(default_factory=Measured)
    timer: PhaseTimer = field(default_factory=PhaseTimer)


def cache_path(cfg: DistillConfig, samples) -> Path:
    """<cache_dir>/<key>: the key hashes the teacher, the tokenized data and every setting the values depend on."""
    from posttrain.recipes.distill_teacher import data_fingerprint, teacher_fingerprint

    key = distill_cache.cache_key(teacher=teacher_fingerprint(cfg.teacher, cfg.seed), data=data_fingerprint(samples),
                                  k=cfg.top_k, temperature=cfg.temperature, value_dtype=cfg.cache_dtype,
                                  teacher_dtype=cfg.teacher_dtype, mixed_precision=cfg.mixed_precision)
    root = Path(cfg.cache_dir) if cfg.cache_dir else Path(cfg.output_dir).resolve().parent / "teacher-cache"
    return root / key


def ensure_cache(cfg: DistillConfig, samples, pad_id: int, device) -> tuple[distill_cache.TeacherCache, dict]:
    """Open the cache of this teacher and data, or load the teacher once and build it."""
    from posttrain.models.loading import load_model

    path = cache_path(cfg, samples)
    cache = distill_cache.open_cache(path)
    if cache is not None:
        return cache, {"built": False, "teacher_tokens": 0, "teacher_seconds": 0.0, "path": str(path)}
    teacher = load_model(cfg.teacher, dtype=cfg.teacher_dtype, seed=cfg.seed, device=device).eval().requires_grad_(False)
    vocab = teacher.get_output_embeddings().weight.shape[0]
    cache, n, seconds = distill_cache.build(
        path, teacher, samples, k=cfg.top_k, temperature=cfg.temperature, value_dtype=cfg.cache_dtype, vocab=vocab,
        pad_id=pad_id, mixed_precision=cfg.mixed_precision, token_budget=cfg.teacher_batch_tokens, device=device)
    del teacher
    return cache, {"built": True, "teacher_tokens": n, "teacher_seconds": seconds, "path": str(path),
                   "teacher_forward_tokens": sum(len(s) for s in samples)}


def logit_setup(cfg: DistillConfig) -> LogitRun:
    """Tokenizers checked, data tokenized, cache opened or built: all before the student loads."""
    from posttrain.models.device import resolve_device
    from posttrain.models.loading import load_model
    from posttrain.recipes import sft

    device = resolve_device(cfg.device)
    tok, _ = load_checked_tokenizers(cfg)
    life = RunLifecycle(cfg)
    seed_everything(cfg.seed)
    sft_cfg = sft_settings(cfg)
    samples, _, _ = sft.load_data(tok, sft_cfg)
    units = sft.make_units(samples, sft_cfg)
    measured = Measured()
    cache, info = ensure_cache(cfg, samples, tok.pad_token_id, device)
    print(f"teacher cache {info['path']} ({'built' if info['built'] else 'reused'}): {cache.meta['tokens']:,} tokens x "
          f"{cache.meta['bytes_per_token']} B = top-{cache.meta['k']} x ({cache.ids.dtype.itemsize} B id + "
          f"{cache.logps.dtype.itemsize} B log-prob) + {cache.logps.dtype.itemsize} B tail")
    model = load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed, device=device)
    if model.get_output_embeddings().weight.shape[0] != cache.meta["vocab"]:
        raise UserError(f"teacher '{cfg.teacher}' has {cache.meta['vocab']} output logits and student '{cfg.model}' has "
                        f"{model.get_output_embeddings().weight.shape[0]}: logit distillation needs the same vocabulary")
    model.train()
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    run = LogitRun(cfg, life, tok, samples, units, {id(s): i for i, s in enumerate(samples)}, cache, info, model,
                   optimizer, scheduler, EpochSampler(len(units), cfg.seed), device, measured=measured)
    state = life.restore(model, optimizer, scheduler)
    if state:
        run.sampler.load(state["sampler"])
    write_plan(life.out, plan_logit(run))
    run.metrics = life.metrics()
    return run


def logit_token_losses(cfg: DistillConfig, logits: torch.Tensor, targets: torch.Tensor, ids, top, tail):
    """Per loss token (M,): (divergence D(P̄ ‖ Q̄) on top-k ∪ {tail}, NLL of the data's target)."""
    div = distill_losses.get(cfg.resolved_divergence)
    d, _ = div(logits[None], torch.ones(1, logits.shape[0], device=logits.device), teacher_topk_logps=top[None],
               teacher_topk_ids=ids[None], teacher_tail_logp=tail[None], temperature=cfg.temperature, **cfg.divergence_args)
    nll = -torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]).squeeze(1)
    return d[0], nll


def logit_micro_batch(run: LogitRun, units: list, n_loss: int) -> dict:
    """Forward/backward of one micro-batch: its exact share of the step's token-mean loss. -> metric sums."""
    from posttrain.models.forward import backbone_and_head
    from posttrain.recipes.distill_teacher import chunked_backward, position_hidden

    cfg = run.cfg
    batch = collate(units, run.tok.pad_token_id, cfg.packing, cfg.pad_to_multiple_of).to(run.device)
    rows = run.cache.rows_of([run.index[id(s)] for u in units for s in u])
    ids, top, tail = run.cache.read(rows, run.device)
    sel = (batch.targets != IGNORE).reshape(-1).nonzero().squeeze(1)  # loss positions, collate (= cache) order
    if len(sel) != len(rows):
        raise RuntimeError(f"{len(sel)} loss tokens in the batch, {len(rows)} cache rows")
    targets = batch.targets.reshape(-1)[sel]
    h = position_hidden(run.model, batch, cfg.mixed_precision, sel)  # (M, H)
    w = cfg.ce_weight

    def loss_of_chunk(z, sl):
        d, nll = logit_token_losses(cfg, z, targets[sl], ids[sl], top[sl], tail[sl])
        return ((1 - w) * d.sum() + w * nll.sum()) / n_loss, {"kd": d.sum().detach(), "nll": nll.sum().detach()}

    _, head = backbone_and_head(run.model)
    loss, sums = chunked_backward(h, head, loss_of_chunk, cfg.logit_chunk)
    return {"loss": float(loss), **sums, "tokens": batch.num_tokens, "padding": batch.num_padding}


def logit_step(run: LogitRun, step: int) -> dict:
    cfg, timer = run.cfg, run.timer
    t0 = time.perf_counter()
    with timer("data"):  # 1. rows of the step and their loss-token count (the normaliser)
        units = [run.units[i] for i in run.sampler.take(cfg.batch_size)]
        n_loss = max(sum(distill_cache.loss_token_counts([s for u in units for s in u])), 1)
    sums: dict = {}
    with timer("forward_backward"):  # 2-3. student forward, divergence to the cached teacher
        for i in range(0, len(units), cfg.micro_batch_size):
            for k, v in logit_micro_batch(run, units[i : i + cfg.micro_batch_size], n_loss).items():
                sums[k] = sums.get(k, 0) + v
    with timer("update"):  # 4.
        lr = run.scheduler.get_last_lr()[0]
        grad_norm = optimizer_step(run.model, run.optimizer, cfg.optim.max_grad_norm, run.scheduler)
    run.measured.add_step(sums["tokens"])
    row = {"loss": sums["loss"], "distill/kd": sums["kd"] / n_loss, "distill/nll": sums["nll"] / n_loss, "lr": lr,
           "grad_norm": grad_norm, "tokens": sums["tokens"], "loss_tokens": n_loss, "padding_tokens": sums["padding"],
           "cache/read_tokens": run.cache.read_tokens, "cache/teacher_tokens": run.cache_info["teacher_tokens"],
           "epoch": run.sampler.epoch, "tokens_per_s": sums["tokens"] / (time.perf_counter() - t0), **timer.pop()}
    return run.metrics.write(step + 1, row)  # 5.


def train_logit(cfg: DistillConfig) -> dict:
    run = logit_setup(cfg)
    bar = progress(cfg.max_steps, run.life.start, "distill/logit", cfg.progress)
    for step in range(run.life.start, cfg.max_steps):
        logged = logit_step(run, step)
        bar.update(1)
        bar.set_postfix(kd=f"{logged['distill/kd']:.4f}")
        run.life.checkpoint(step + 1, run.model, run.optimizer, run.scheduler, {"sampler": run.sampler.state()})
    bar.close()
    if cfg.max_steps > run.life.start:
        run.life.checkpoint(cfg.max_steps, run.model, run.optimizer, run.scheduler, {"sampler": run.sampler.state()},
                            force=True)
    run.life.save_final(run.model, run.tok)
    history = run.life.history()
    summary = {"mode": "logit", "divergence": cfg.resolved_divergence, "steps": cfg.max_steps,
               "first_kd": history[0]["distill/kd"] if history else math.nan,
               "last_kd": history[-1]["distill/kd"] if history else math.nan,
               "cache": {**run.cache_info, "tokens": run.cache.meta["tokens"], "read_tokens": run.cache.read_tokens,
                         "bytes_per_token": run.cache.meta["bytes_per_token"], "bytes": run.cache.bytes_on_disk}}
    plan = write_distill_measured(run.life.out, run.measured, {
        "cache_bytes": run.cache.bytes_on_disk, "cache_tokens": run.cache.meta["tokens"],
        "teacher_tokens_scored": run.cache_info["teacher_tokens"], "teacher_seconds": run.cache_info["teacher_seconds"]})
    run.life.finish(summary, f"Distillation (logit, {cfg.resolved_divergence}) — {cfg.teacher} -> {cfg.model}",
                    {"summary": summary, "plan vs measured": plan.get("comparison", {})})
    return summary


def plan_logit(run: LogitRun) -> dict:
    """The planner's prediction with the cache this run uses, and the exact tokens of its data plan."""
    from posttrain.models.forward import unwrap
    from posttrain.plan import predict
    from posttrain.plan.predict import resolve_model

    cfg, cache = run.cfg, run.cache
    steps = max(cfg.max_steps - run.life.start, 1)
    probe = copy.deepcopy(run.sampler)
    per_step = [sum(len(s) for i in probe.take(cfg.batch_size) for s in run.units[i]) for _ in range(steps)]
    student = unwrap(run.model).config
    teacher = teacher_spec(cfg.teacher, student)
    pred = predict(student, "distill", mode="logit", teacher=teacher, batch=cfg.batch_size, seq_len=cfg.max_length,
                   micro_batch=cfg.micro_batch_size, top_k=cfg.top_k, steps=steps, logit_copies=0,
                   dtype="fp32" if cfg.dtype in ("float32", "fp32") else "bf16", data_tokens=cache.meta["tokens"])
    n_teacher = resolve_model(teacher, "teacher").params
    pred["data_plan"] = {"steps": steps, "tokens": sum(per_step)}
    forward_tokens = sum(len(s) for s in run.samples)
    pred["teacher"] = {"cache_tokens": cache.meta["tokens"],
                       "cache_bytes": cache.meta["tokens"] * distill_cache.bytes_per_token(cache.meta["vocab"], cfg.top_k, cfg.cache_dtype),
                       "tokens_to_score": cache.meta["tokens"] if run.cache_info["built"] else 0,
                       "forward_tokens": forward_tokens if run.cache_info["built"] else 0,
                       "forward_flops": 2 * n_teacher * forward_tokens if run.cache_info["built"] else 0}
    return pred


def teacher_spec(teacher: str, student_config):
    """What the planner reads for the teacher: its name or folder, or (a PEFT adapter folder, whose size is its
    base's) the student's config."""
    from posttrain.plan.predict import resolve_model

    try:
        resolve_model(teacher, "teacher")
        return teacher
    except UserError:
        return student_config


def write_distill_measured(out: Path, measured: Measured, extra: dict) -> dict:
    """plan.json's `measured` plus the teacher's measured side, and predicted/measured ratios for it."""
    path = write_measured(out, measured)
    plan = json.loads(path.read_text())
    plan["measured"]["teacher"] = extra
    pred = plan["predicted"].get("teacher", {})
    comparison = plan.setdefault("comparison", {})
    if pred.get("cache_bytes") and "cache_bytes" in extra:
        comparison["cache_bytes_over_predicted"] = extra["cache_bytes"] / pred["cache_bytes"]
    if pred.get("tokens_to_score") and "teacher_tokens_scored" in extra:
        comparison["teacher_tokens_over_predicted"] = extra["teacher_tokens_scored"] / pred["tokens_to_score"]
    if pred.get("scored_tokens_per_step") and "scored_tokens" in extra and measured.steps:
        comparison["teacher_tokens_over_predicted"] = extra["scored_tokens"] / (pred["scored_tokens_per_step"] * measured.steps)
    if plan["predicted"].get("data_plan"):
        comparison["tokens_over_data_plan"] = measured.tokens / max(plan["predicted"]["data_plan"]["tokens"], 1)
    path.write_text(json.dumps(plan, indent=2))
    return plan


# ---------------------------------------------------------------- entry points


def train(cfg: DistillConfig) -> dict:
    if cfg.mode == "logit":
        return train_logit(cfg)
    if cfg.mode == "sequence":
        from posttrain.recipes import distill_sequence

        return distill_sequence.train(cfg)
    from posttrain.recipes import distill_onpolicy

    return distill_onpolicy.train(cfg)


def main(argv: list[str]) -> None:
    cfg = parse_args(DistillConfig, argv, prog="posttrain distill")  # a bad key or value: ConfigError, reported by the CLI
    t0 = time.perf_counter()
    s = train(cfg)
    shown = {k: v for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    print(f"distill ({cfg.mode}): " + "  ".join(f"{k}={v:.4g}" for k, v in shown.items())
          + f"; {time.perf_counter() - t0:.0f} s; run directory: {cfg.output_dir}")
