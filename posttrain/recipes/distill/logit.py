"""Logit-level distillation (`mode=logit`): the teacher's next-token distribution on fixed sequences (the
data's assistant turns), stored once as a top-k cache with a tail bucket (cache.py), memory-mapped and
reused across epochs and runs; the student minimises a divergence to it per loss token (classic KD,
Hinton et al. 2015), optionally mixed with the data's NLL (`ce_weight`).

One step (`logit_step`) reads top to bottom; the phase names are the timer names:
    1. data     `batch_size` rows (packed or single samples), their cache rows
    2. forward  the student's hidden states at loss positions; lm_head in chunks
    3. loss     (1 − ce_weight)·D(P̄_teacher ‖ Q̄_student) + ce_weight·NLL, summed over the step's loss
                tokens / their count (accumulation == one large batch)
    4. update   clip, AdamW, schedule
    5. log      metrics.jsonl (with the cache counters: teacher tokens scored, rows read)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from posttrain.algos import distill_losses
from posttrain.data.packing import IGNORE, collate
from posttrain.errors import UserError
from posttrain.models.device import resolve_device
from posttrain.models.forward import backbone_and_head, unwrap
from posttrain.models.lora import memory_savers
from posttrain.monitor.metrics import PhaseTimer
from posttrain.plan import predict
from posttrain.plan.measure import Measured, write_plan
from posttrain.plan.predict import resolve_model
from posttrain.recipes import sft
from posttrain.recipes.distill import cache as cache_mod
from posttrain.recipes.distill.config import DistillConfig, sft_settings
from posttrain.recipes.distill.teacher import (
    chunked_backward,
    data_fingerprint,
    load_checked_tokenizers,
    position_hidden,
    teacher_fingerprint,
    teacher_spec,
    write_distill_measured,
)
from posttrain.training.data_order import EpochSampler
from posttrain.training.lifecycle import RunLifecycle
from posttrain.training.loop import CheckpointArgs, run_loop
from posttrain.training.optim import build_optimizer, optimizer_step
from posttrain.training.plan import plan_dtype, planned_tokens
from posttrain.training.run import seed_everything


@dataclass(eq=False)
class LogitRun:
    cfg: DistillConfig
    life: RunLifecycle
    tok: object
    samples: list
    units: list
    index: dict  # id(sample) -> its row in the cache's data order
    cache: cache_mod.TeacherCache
    cache_info: dict
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    sampler: EpochSampler
    device: torch.device
    teacher_tokens: int = 0  # loss tokens the teacher scored for this run, every session (cache_info: this session)
    metrics: object = None
    measured: Measured = field(default_factory=Measured)
    timer: PhaseTimer = field(default_factory=PhaseTimer)


def cache_path(cfg: DistillConfig, samples) -> Path:
    """<cache_dir>/<key>: the key hashes the teacher, the tokenized data and every setting the values depend on."""
    key = cache_mod.cache_key(teacher=teacher_fingerprint(cfg.teacher, cfg.seed), data=data_fingerprint(samples),
                                  k=cfg.top_k, temperature=cfg.temperature, value_dtype=cfg.cache_dtype,
                                  teacher_dtype=cfg.teacher_dtype, mixed_precision=cfg.mixed_precision)
    root = Path(cfg.cache_dir) if cfg.cache_dir else Path(cfg.output_dir).resolve().parent / "teacher-cache"
    return root / key


def ensure_cache(cfg: DistillConfig, samples, pad_id: int, device) -> tuple[cache_mod.TeacherCache, dict]:
    """Open the cache of this teacher and data, or load the teacher once and build it."""
    from posttrain.models.loading import load_model  # looked up at call time: tests replace posttrain.models.loading.load_model

    path = cache_path(cfg, samples)
    cache = cache_mod.open_cache(path)
    if cache is not None:
        return cache, {"built": False, "teacher_tokens": 0, "teacher_seconds": 0.0, "path": str(path)}
    teacher = load_model(cfg.teacher, dtype=cfg.teacher_dtype, seed=cfg.seed, device=device).eval().requires_grad_(False)
    vocab = teacher.get_output_embeddings().weight.shape[0]
    if cfg.top_k > vocab:  # torch.topk would fail inside the cache writer
        raise UserError(f"top_k={cfg.top_k} is above the teacher's vocabulary of {vocab} tokens: give top_k <= {vocab} "
                        "(64 keeps nearly all of the probability mass)")
    cache, n, seconds = cache_mod.build(
        path, teacher, samples, k=cfg.top_k, temperature=cfg.temperature, value_dtype=cfg.cache_dtype, vocab=vocab,
        pad_id=pad_id, mixed_precision=cfg.mixed_precision, token_budget=cfg.teacher_batch_tokens, device=device)
    del teacher
    return cache, {"built": True, "teacher_tokens": n, "teacher_seconds": seconds, "path": str(path),
                   "teacher_forward_tokens": sum(len(s) for s in samples)}


def setup(cfg: DistillConfig) -> LogitRun:
    """Tokenizers checked, data tokenized, cache opened or built: all before the student loads."""
    from posttrain.models.loading import load_model  # looked up at call time: tests replace posttrain.models.loading.load_model

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
    model = memory_savers(load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed, device=device), cfg.lora, cfg.gradient_checkpointing)
    if model.get_output_embeddings().weight.shape[0] != cache.meta["vocab"]:
        raise UserError(f"teacher '{cfg.teacher}' has {cache.meta['vocab']} output logits and student '{cfg.model}' has "
                        f"{model.get_output_embeddings().weight.shape[0]}: logit distillation needs the same vocabulary")
    model.train()
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    run = LogitRun(cfg, life, tok, samples, units, {id(s): i for i, s in enumerate(samples)}, cache, info, model,
                   optimizer, scheduler, EpochSampler(len(units), cfg.seed), device, measured=measured)
    state = life.restore(model, optimizer, scheduler)
    if state:
        run.sampler.load(state["sampler"], cfg.data)
        cache.read_tokens = state.get("read_tokens", 0)  # the logged counters count the whole run, not a session
    run.teacher_tokens = state.get("teacher_tokens", 0) + info["teacher_tokens"]
    write_plan(life.out, plan_run(run))
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
        n_loss = max(sum(cache_mod.loss_token_counts([s for u in units for s in u])), 1)
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
           "cache/read_tokens": run.cache.read_tokens, "cache/teacher_tokens": run.teacher_tokens,
           "epoch": run.sampler.epoch, "tokens_per_s": sums["tokens"] / (time.perf_counter() - t0), **timer.pop()}
    return run.metrics.write(step + 1, row)  # 5.


def checkpoint_args(run: LogitRun) -> CheckpointArgs:
    return CheckpointArgs(run.model, run.optimizer, run.scheduler, {"sampler": run.sampler.state(),
                                                                    "read_tokens": run.cache.read_tokens,
                                                                    "teacher_tokens": run.teacher_tokens}, tok=run.tok)


def train(cfg: DistillConfig) -> dict:
    run = setup(cfg)
    run_loop(run.life, cfg, lambda step: logit_step(run, step), lambda: checkpoint_args(run), desc="distill/logit",
             postfix=lambda row: {"kd": f"{row['distill/kd']:.4f}"})
    run.life.save_final(run.model, run.tok, lora=cfg.lora.enabled)
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


def plan_run(run: LogitRun) -> dict:
    """The planner's prediction with the cache this run uses, and the exact tokens of its data plan."""
    cfg, cache = run.cfg, run.cache
    steps = max(cfg.max_steps - run.life.start, 1)
    per_step = planned_tokens(run.sampler, steps, cfg.batch_size, [sum(len(s) for s in u) for u in run.units])
    student = unwrap(run.model).config
    teacher = teacher_spec(cfg.teacher, student)
    pred = predict(student, "distill", mode="logit", teacher=teacher, batch=cfg.batch_size, seq_len=cfg.max_length,
                   micro_batch=cfg.micro_batch_size, top_k=cfg.top_k, steps=steps, logit_copies=0,
                   dtype=plan_dtype(cfg.dtype), data_tokens=cache.meta["tokens"])
    n_teacher = resolve_model(teacher, "teacher").params
    pred["data_plan"] = {"steps": steps, "tokens": sum(per_step)}
    forward_tokens = sum(len(s) for s in run.samples)
    pred["teacher"] = {"cache_tokens": cache.meta["tokens"],
                       "cache_bytes": cache.meta["tokens"] * cache_mod.bytes_per_token(cache.meta["vocab"], cfg.top_k, cfg.cache_dtype),
                       "tokens_to_score": cache.meta["tokens"] if run.cache_info["built"] else 0,
                       "forward_tokens": forward_tokens if run.cache_info["built"] else 0,
                       "forward_flops": 2 * n_teacher * forward_tokens if run.cache_info["built"] and n_teacher else 0}
    return pred
