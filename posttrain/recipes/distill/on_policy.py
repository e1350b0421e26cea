"""On-policy distillation (GKD, Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes"): the student samples, the teacher scores every position of
the student's samples, and the student minimises a divergence to the teacher there.

One step (`distill_step`) reads top to bottom; the phase names are the timer names:
    1. collect    the RL run's rollout source (`rollout.collect`): B prompts × G student samples from the
                  engine, the reward scored on them (logged; trained only with rl_weight > 0)
    2. advantage  rl_weight > 0 only: the RL algorithm's outcome advantages
    3. teacher    teacher logits at every student token's position, one packed forward per micro-batch
                  (the group's prompt once, as in RL: rollout/trajectory.py)
    4. update     per token t of the student's samples (loss mask = RL's: generated tokens only)
                      D_t = D(P_T(·|s_t) ‖ Q_θ(·|s_t))  over the full vocabulary (forward KL, reverse KL,
                            JSD(β); posttrain.algos.distill_losses), both at `temperature`
                  loss = (1 − w)·Σ_t D_t / N_tok + w·L_RL  (w = rl_weight; L_RL the algorithm's policy loss
                  on the reward's advantages: GKD §3.2's mix of RL and distillation), AdamW; the engine
                  picks up the new weights
    5. log        the RL recipe's `log_step` (rewards, lengths, alarms, held-out eval) + distill/* metrics

As in GKD, the gradient does not flow through the sampling: the samples are data, the divergence is
exact at each visited state. Reverse KL on the student's own tokens is the dense RL objective with
per-token reward log P_T − log Q_θ (the reward column of `posttrain methods`: "teacher distribution
log p_T"); `distill/teacher_logp` logs the mean log P_T of the sampled tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.algos import distill_losses
from posttrain.config import save_yaml
from posttrain.data.templates import render_prompt
from posttrain.models.forward import backbone_and_head, unwrap
from posttrain.plan import predict
from posttrain.plan.measure import write_plan
from posttrain.recipes import rl
from posttrain.recipes.distill.config import NO_REWARD, DistillConfig
from posttrain.recipes.distill.teacher import (
    check_same_vocab_size,
    chunked_backward,
    head_logits,
    load_checked_tokenizers,
    position_hidden,
    teacher_spec,
    write_distill_measured,
)
from posttrain.recipes.rl import phases as ph
from posttrain.rewards.base import register
from posttrain.rollout.trajectory import make_batches
from posttrain.systems.checkpoint import list_checkpoints
from posttrain.training import resume
from posttrain.training.loop import CheckpointArgs, run_loop
from posttrain.training.optim import optimizer_step
from posttrain.training.plan import plan_dtype
from posttrain.training.settings import derive


@register(NO_REWARD)
def no_reward(prompts, completions, **kwargs):
    """No reward: every sample None (distillation without a verifier)."""
    return [None] * len(completions)


@dataclass(eq=False)
class OnPolicyRun:
    cfg: DistillConfig
    rl: rl.RLRun  # the RL recipe's run: student, engine, optimizer, data, reward, lifecycle, alarms
    teacher: torch.nn.Module
    teacher_tokens: int = 0  # positions scored by the teacher (this session)
    teacher_forward_tokens: int = 0  # tokens through the teacher's forward (prompts once per group)
    teacher_tokens_before: int = 0  # positions scored in the sessions before a resume (logged: the whole run's)


def rl_settings(cfg: DistillConfig) -> rl.RLConfig:
    """The RL recipe's config for the student: every field the two configs share (training/settings.py), but
    β = 0 (the teacher is the only constraint; distillation's `beta` is JSD's), no dynamic sampling."""
    return derive(cfg, rl.RLConfig, reward=cfg.reward or NO_REWARD, beta=0.0, dynamic_sampling=False)


def setup(cfg: DistillConfig) -> OnPolicyRun:
    """Tokenizers checked first; then the RL recipe's setup (data, reward, student, engine, resume); the teacher."""
    from posttrain.models.loading import load_model  # looked up at call time: tests replace posttrain.models.loading.load_model

    load_checked_tokenizers(cfg)  # refuses a tokenizer mismatch before any model loads
    out = Path(cfg.output_dir)
    if cfg.resume and list_checkpoints(out):  # distill's own keys (teacher, divergence...): the resume contract
        for note in resume.check_record(cfg, resume.config_record(out), out, "its distill config"):
            print(note, flush=True)
    run = rl.setup(rl_settings(cfg))
    save_yaml(cfg, run.life.out / "config.yaml")  # the distill config, not the RL one it built
    teacher = load_model(cfg.teacher, dtype=cfg.teacher_dtype, seed=cfg.seed, device=run.device)
    teacher.eval().requires_grad_(False)
    check_same_vocab_size(run.model, teacher, cfg.model, cfg.teacher)
    out = OnPolicyRun(cfg, run, teacher, teacher_tokens_before=run.life.restored.get("teacher_tokens", 0))
    write_plan(run.life.out, plan_run(out))
    return out


# ---------------------------------------------------------------- one step


def distill_step(run: OnPolicyRun, step: int) -> dict:
    """One optimizer step of on-policy distillation; returns the metrics row it logged."""
    cfg, r = run.cfg, run.rl
    t0 = time.perf_counter()
    # 1. collect: the student samples; the reward scores them (the RL run's rollout source)
    trajs, collect_metrics = r.rollout.collect(r, step)
    # 2. advantage: only the RL term needs one
    adv_metrics = {}
    if cfg.rl_weight > 0:
        with r.timer("advantage"):
            adv_metrics = ph.assign_advantages(trajs, r.adv_fn, cfg.mask_truncated)
    for t in trajs:  # every sample carries the divergence; a reward that does not apply only zeroes its RL term
        t.valid = not (cfg.mask_truncated and t.finish_reason == "length")
    batches = make_batches(trajs, r.tok.pad_token_id, cfg.micro_batch_tokens, device=r.device)
    # 3-4. teacher logits at the student's positions; divergence (+ RL loss); AdamW
    update_metrics = update(run, batches)
    # 5. log
    return rl.log_step(r, step, trajs, t0, {**collect_metrics, **adv_metrics, **update_metrics})


def update(run: OnPolicyRun, batches) -> dict:
    cfg, r = run.cfg, run.rl
    norms = {"agg": r.agg, "tokens": max(sum(int(b.loss_mask.sum()) for b in batches), 1),
             "seqs": max(sum(int(b.valid.sum()) for b in batches), 1)}
    sums: dict = {}
    rl_metrics = ph.TokenMeans()  # the RL term's metrics (token-weighted means, /min and /max extremes)
    for b in batches:
        with r.timer("teacher"), torch.no_grad():  # 3. hidden states (M, H_t): logits per chunk in the loss, never (M x V)
            t_hidden = position_hidden(run.teacher, b, cfg.mixed_precision, b.hidden_index, layout=b.layout)
            run.teacher_tokens += int(b.hidden_index.numel())
            run.teacher_forward_tokens += int(b.input_ids.numel())
        with r.timer("update"):  # 4.
            for k, v in micro_batch_backward(run, b, t_hidden, norms, rl_metrics).items():
                sums[k] = sums.get(k, 0.0) + v
    with r.timer("update"):
        lr = r.scheduler.get_last_lr()[0]
        grad_norm = optimizer_step(r.model, r.optimizer, cfg.optim.max_grad_norm)
        r.scheduler.step()
        r.rollout.sync_weights(r)  # the engine shares the weights: its packed copies and cached KV are stale now
    n = norms["tokens"]
    row = {"loss": sums.pop("loss"), "lr": lr, "grad_norm": grad_norm, "distill/loss": sums.pop("kd") / n,
           "distill/teacher_logp": sums.pop("teacher_logp") / n, "distill/student_logp": sums.pop("student_logp") / n,
           "teacher/tokens": run.teacher_tokens_before + run.teacher_tokens}
    return {**row, **rl_metrics.result()}


def micro_batch_backward(run: OnPolicyRun, b, t_hidden: torch.Tensor, norms: dict, rl_metrics: ph.TokenMeans) -> dict:
    """The micro-batch's exact share of the step's loss, backpropagated; -> metric sums over its loss tokens.
    `t_hidden` (M, H_t): the teacher's last hidden states; its logits are formed one chunk of rows at a time."""
    cfg, r = run.cfg, run.rl
    w = cfg.rl_weight
    mask = b.loss_mask[b.mask]  # (M,) bool, loss-token order (= hidden_index order)
    targets = b.targets
    div = distill_losses.get(cfg.resolved_divergence)
    _, head = backbone_and_head(r.model)
    _, t_head = backbone_and_head(run.teacher)

    def loss_of_chunk(z, sl):  # z (c, V) student logits with grad; the chunk's teacher logits (c, V), no graph
        m = mask[sl]
        with torch.no_grad():
            t_z = head_logits(t_head, t_hidden[sl])
        d, _ = div(z[None], m[None], teacher_logits=t_z[None], temperature=cfg.temperature, **cfg.divergence_args)
        d = d[0] * m
        lt = torch.log_softmax(t_z, -1).gather(1, targets[sl, None]).squeeze(1)
        ls = torch.log_softmax(z.detach().float(), -1).gather(1, targets[sl, None]).squeeze(1)
        return (1 - w) * d.sum() / norms["tokens"], {"kd": d.sum().detach(), "teacher_logp": (lt * m).sum(),
                                                     "student_logp": (ls * m).sum()}

    h = position_hidden(r.model, b, cfg.mixed_precision, b.hidden_index, layout=b.layout)  # (M, H)
    whole = (lambda hd: rl_term(run, b, hd, head, norms, rl_metrics)) if w > 0 else None
    loss, sums = chunked_backward(h, head, loss_of_chunk, cfg.logit_chunk, whole=whole)
    return {"loss": float(loss), **sums}


def rl_term(run: OnPolicyRun, b, hd: torch.Tensor, head, norms: dict, rl_metrics: ph.TokenMeans):
    """w·L_RL of the micro-batch: the algorithm's policy loss on the reward's advantages, log-probs of the
    sampling distribution (temperature, kept set) from the same hidden states. -> (loss, {}); the policy
    loss's metrics go to `rl_metrics`."""
    r, temp = run.rl, run.rl.cfg.sampling.temperature
    logp, _ = head.logprobs(hd, b.targets, temp, kept=b.kept)  # the model's soft-cap / scale; never (M x V) at once
    logp = b.spread(logp)  # (S, L)
    b.old_logp = logp.detach()  # strictly on-policy: one pass over the samples
    loss, metrics = ph.batch_loss(logp, b, r.loss_fn, r.cfg, 0.0, r.cfg.kl_estimator, r.tis_cap, norms)
    rl_metrics.add(metrics, float(b.loss_mask.sum()))
    return run.cfg.rl_weight * loss, {}


# ---------------------------------------------------------------- run


def checkpoint_args(run: OnPolicyRun) -> CheckpointArgs:
    r = run.rl
    return CheckpointArgs(r.model, r.optimizer, r.scheduler,
                          {**rl.checkpoint_state(r), "teacher_tokens": run.teacher_tokens_before + run.teacher_tokens}, tok=r.tok)


def train(cfg: DistillConfig) -> dict:
    run = setup(cfg)
    run_loop(run.rl.life, cfg, lambda step: distill_step(run, step), lambda: checkpoint_args(run),
             desc=f"distill/on_policy/{cfg.resolved_divergence}", postfix=lambda row: {"kd": f"{row['distill/loss']:.4f}"})
    return finish(run)


def finish(run: OnPolicyRun) -> dict:
    cfg, r = run.cfg, run.rl
    life = r.life
    life.save_final(r.model, r.tok, lora=cfg.lora.enabled)
    teacher_seconds = sum(row.get("time/teacher", 0.0) for row in life.history())
    plan = write_distill_measured(life.out, r.measured, {"scored_tokens": run.teacher_tokens,
                                                         "forward_tokens": run.teacher_forward_tokens,
                                                         "seconds": teacher_seconds})
    history = life.history()
    rewards = [h["reward/mean"] for h in history if h.get("reward/mean") is not None and not math.isnan(h["reward/mean"])]
    summary = {"mode": "on_policy", "divergence": cfg.resolved_divergence, "rl_weight": cfg.rl_weight,
               "steps": cfg.max_steps, "first_kd": history[0]["distill/loss"] if history else math.nan,
               "last_kd": history[-1]["distill/loss"] if history else math.nan,
               "first_reward": rewards[0] if rewards else math.nan, "last_reward": rewards[-1] if rewards else math.nan,
               "teacher_tokens": run.teacher_tokens, "alarms": r.alarms.summary()}
    life.finish(summary, f"Distillation (on-policy, {cfg.resolved_divergence}) — {cfg.teacher} -> {cfg.model}",
                {"summary": summary, "plan vs measured": plan.get("comparison", {})})
    return summary


def plan_run(run: OnPolicyRun) -> dict:
    """The planner's prediction (student generates, teacher scores, student trains); tokens assume every
    sample runs to max_new_tokens, as the RL recipe's plan does."""
    cfg, r = run.cfg, run.rl
    prompt_len = round(sum(len(render_prompt(r.tok, row.data["prompt"])) for row in r.rows) / len(r.rows))
    student = unwrap(r.model).config
    pred = predict(student, "distill", mode="on_policy", teacher=teacher_spec(cfg.teacher, student),
                   batch=cfg.prompts_per_step, group=cfg.group_size, seq_len=cfg.sampling.max_new_tokens,
                   prompt_len=prompt_len, micro_batch=cfg.prompts_per_step * cfg.group_size, steps=max(cfg.max_steps, 1),
                   dtype=plan_dtype(cfg.dtype), logit_copies=0)
    teacher_phase = next((p for p in pred.get("phases", []) if p["phase"] == "teacher"), None)
    if teacher_phase is not None and teacher_phase.get("flops_per_step") is not None and pred.get("flops_per_step"):
        pred["teacher"] = {"scored_tokens_per_step": pred["generated_tokens_per_step"],
                           "flops_per_step": teacher_phase["flops_per_step"],
                           "share_of_step_flops": teacher_phase["flops_per_step"] / pred["flops_per_step"]}
    return pred

