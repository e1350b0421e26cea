"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"): each step
samples G completions per prompt from the current policy, labels the best and the worst of each group
by the reward, and takes one preference-loss step (`pref_loss`: dpo, ipo, … from
posttrain.algos.preference_losses). Its own step, chosen by `algo=online_dpo`; it shares collect and
log with the policy-gradient step (step.py).

    1. collect     the run's rollout source (scored groups)
    2. pairs       per group (best, worst) under the reward; ties give no pair
    3. reference   Σ log π_ref per sequence (when the loss needs a reference)
    4. update      the preference loss over the pairs, AdamW; the reference follows the policy every
                   `ref_update_every` steps (0: frozen)
    5. log
"""

from __future__ import annotations

import inspect
import time

import torch

from posttrain.algos import preference_losses
from posttrain.models.lora import reference_view
from posttrain.recipes.rl import phases as ph
from posttrain.recipes.rl.log import log_step
from posttrain.recipes.rl.run import RLRun
from posttrain.rollout.trajectory import RLBatch, Trajectory, make_batches
from posttrain.training.optim import optimizer_step


def online_dpo_step(run: RLRun, step: int) -> dict:
    """One optimizer step of online DPO; returns the metrics row it logged."""
    cfg, timer = run.cfg, run.timer
    t0 = time.perf_counter()
    # 1. collect
    trajs, collect_metrics = run.rollout.collect(run, step)
    # 2. pairs: best vs worst of each group
    ph.assign_advantages(trajs, None, cfg.mask_truncated)
    pairs, skipped = preference_pairs([t for t in trajs if t.valid])
    if not pairs:
        return log_step(run, step, trajs, t0, {**collect_metrics, "pairs": 0, "skipped": 1})
    batches = make_batches([t for pair in pairs for t in pair], run.tok.pad_token_id, cfg.micro_batch_tokens,
                           device=run.device)
    # 3. reference
    ref = None
    if run.ref is not None:
        with timer("reference"), torch.no_grad(), reference_view(run.ref) as ref_model:
            ref = sequence_logps(ref_model, batches, cfg.mixed_precision)
    # 4. update
    with timer("update"):
        lr = run.scheduler.get_last_lr()[0]
        policy = sequence_logps(run.model, batches, cfg.mixed_precision)
        loss, metrics = pair_loss(preference_losses.get(cfg.pref_loss), pairs, policy, ref, cfg.pref_args)
        loss.backward()
        grad_norm = optimizer_step(run.model, run.optimizer, cfg.optim.max_grad_norm)
        run.scheduler.step()
        run.rollout.sync_weights(run)
        if run.ref is not None and cfg.ref_update_every and (step + 1) % cfg.ref_update_every == 0:
            run.ref.load_state_dict(run.model.state_dict())
    # 5. log
    row = {"loss": loss.detach(), "lr": lr, "grad_norm": grad_norm, "pairs": len(pairs), "pairs/groups_skipped": skipped,
           **{f"pref/{k}": v for k, v in metrics.items()}, "skipped": 0}
    return log_step(run, step, trajs, t0, {**collect_metrics, **row})


def preference_pairs(trajs: list[Trajectory]) -> tuple[list[tuple[Trajectory, Trajectory]], int]:
    """Per group, (best, worst) under the reward (first of equals); groups whose applicable rewards are
    all equal (ties) give no pair. Returns (pairs, groups skipped)."""
    by: dict[int, list[Trajectory]] = {}
    for t in trajs:
        if t.reward is not None:
            by.setdefault(t.group, []).append(t)
    pairs = []
    for group in by.values():
        best = max(group, key=lambda t: t.reward)
        worst = min(group, key=lambda t: t.reward)
        if best.reward > worst.reward:
            pairs.append((best, worst))
    return pairs, len({t.group for t in trajs}) - len(pairs)


def sequence_logps(model, batches: list[RLBatch], mixed_precision: str) -> dict[int, torch.Tensor]:
    """Σ_t log π(a_t|s_t) (temperature 1, untruncated: DPO's implicit reward is about π itself) per
    trajectory, keyed by id(trajectory) -> 0-dim tensors (with grad when the model trains)."""
    out = {}
    for b in batches:
        logp, _ = ph.policy_logps(model, b, 1.0, mixed_precision, truncated=False)
        for t, s in zip(b.trajectories, (logp * b.mask).sum(-1)):
            out[id(t)] = s
    return out


def pair_loss(pref_fn, pairs, policy: dict, ref: dict | None, pref_args: dict):
    """Mean preference loss over the pairs (chosen = best, rejected = worst) and its metrics."""
    pc = torch.stack([policy[id(c)] for c, _ in pairs])
    pr = torch.stack([policy[id(r)] for _, r in pairs])
    rc = torch.stack([ref[id(c)] for c, _ in pairs]) if ref is not None else None
    rr = torch.stack([ref[id(r)] for _, r in pairs]) if ref is not None else None
    extra = dict(pref_args)
    params = inspect.signature(pref_fn).parameters
    if "chosen_lengths" in params:  # length-normalised losses (simpo, orpo, dpo_norm, rpo)
        extra["chosen_lengths"] = torch.tensor([float(c.num_loss_tokens) for c, _ in pairs], device=pc.device)
        extra["rejected_lengths"] = torch.tensor([float(r.num_loss_tokens) for _, r in pairs], device=pc.device)
    loss, metrics = pref_fn(pc, pr, rc, rr, **extra)
    return loss.mean(), metrics
