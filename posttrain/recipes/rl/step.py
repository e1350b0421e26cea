"""One step of online RL: PPO with a value model, and the group-baseline family (GRPO, Dr. GRPO, DAPO,
GSPO, CISPO, RLOO, REINFORCE++). It reads top to bottom; the phase names are the timer names:

    1. collect    B groups of G scored samples from the run's rollout source (rollout.py; behaviour
                  log-probs kept; None = the reward does not apply: no baseline, no loss); dynamic
                  sampling drops groups without signal and refills (DAPO), capped retries
    2. advantage  outcome advantages from the registry over the applicable rewards
    3. reference  log π_ref on the loss tokens when β > 0 (no reference model at β = 0)
       critic     PPO only: V(s_t) from the value model, token rewards (−β·k1, outcome at the end), GAE (ppo.py)
    4. update     policy loss (+ β·KL) over the global batch, TIS when trainer and sampler differ in
                  precision, PPO epochs × minibatches, AdamW; the rollout source picks up the new weights;
                  groups whose advantages are all 0 (no gradient at β = 0) skip the backward (zero_advantage)
    5. log        one metrics.jsonl row (reward, KL, lengths, clip fractions, entropy, consistency, time)

Only generated tokens carry loss. Under torchrun each minibatch's micro-batches are shared among the
ranks (`rank_share`: one process gets every micro-batch with weight 1) and the statistics merged once.
Online DPO has its own step (online_dpo.py); build.py sets the run up, loop.py runs the steps.
"""

from __future__ import annotations

import time

import torch

from posttrain.recipes.rl import phases as ph
from posttrain.recipes.rl.log import log_step
from posttrain.recipes.rl.run import Consistency, RLRun, UpdateStats
from posttrain.recipes.rl.sharded import my_batches, reduce_stats
from posttrain.rollout.trajectory import RLBatch, make_batches
from posttrain.systems import fsdp
from posttrain.systems.dist import rank_share
from posttrain.training.optim import optimizer_step


def rl_step(run: RLRun, step: int) -> dict:
    """One optimizer step of online RL; returns the metrics row it logged."""
    cfg, timer = run.cfg, run.timer
    t0 = time.perf_counter()
    # 1. collect: generate, score, filter (refill rounds for dynamic sampling)
    trajs, collect_metrics = run.rollout.collect(run, step)
    # 2. advantage over the applicable rewards (PPO: only which samples carry loss; GAE comes with the critic)
    with timer("advantage"):
        adv_metrics = ph.assign_advantages(trajs, run.adv_fn, cfg.mask_truncated)
    if not any(t.valid for t in trajs):  # every reward None (or every sample masked): nothing to learn from
        return log_step(run, step, trajs, t0, {**collect_metrics, "skipped": 1})
    batches = make_batches(trajs, run.tok.pad_token_id, cfg.micro_batch_tokens, device=run.device)
    # 3. reference (β > 0 only): the micro-batches this rank trains on; PPO's token rewards need every one
    if run.ref is not None:
        with timer("reference"):
            needed = batches if run.critic is not None else my_batches(batches, cfg.minibatches, run.info)
            ph.reference_logps(run.ref, needed, cfg)
    if run.critic is not None:
        with timer("critic"):
            adv_metrics = {**adv_metrics, **run.critic.advantages(run, batches)}  # keeps PPO's groups/*
    # 4. update (β = 0: the first step's samples become the KL-to-start probe before it)
    if run.drift is not None:
        run.drift.capture(run, trajs)
    with timer("update"):
        update_metrics = update(run, batches, train_policy=run.critic is None or step >= cfg.critic_warmup)
    if run.drift is not None:
        with timer("kl_start"):
            update_metrics.update(run.drift.measure(run, step))
    if cfg.ref_reset_every:  # ProRL: the reference follows the policy every N steps
        update_metrics.update(reset_reference(run, step))
    # 5. log
    return log_step(run, step, trajs, t0, {**collect_metrics, **adv_metrics, **update_metrics, "skipped": 0})


def update(run: RLRun, batches: list[RLBatch], train_policy: bool = True) -> dict:
    """ppo_epochs passes of ppo_minibatches optimizer steps; the first pass's first forward is
    on-policy (old = current, no recomputation). PPO also trains the value model on the same batches;
    during `critic_warmup` only the value model learns."""
    cfg, critic = run.cfg, run.critic
    stats = UpdateStats()
    lr, beta = run.scheduler.get_last_lr()[0], run.beta
    entropy_coef = run.entropy_ctl.coef()  # the entropy bonus's c this step (0: none)
    parts: dict[int, tuple] = {}  # id(micro-batch) -> its (live, inert) sub-batches (policy_pass)
    for epoch in range(cfg.epochs):
        for mb in ph.minibatches(batches, cfg.minibatches):
            # the normalisers count every group, inert ones included: the gradient is the whole batch's
            norms = {"agg": run.agg, "tokens": max(sum(int(b.loss_mask.sum()) for b in mb), 1),
                     "seqs": max(sum(int(b.valid.sum()) for b in mb), 1)}
            backwards = 0
            for b, w in rank_share(mb, run.info):  # one process: every micro-batch, weight 1
                if train_policy:
                    backwards += policy_pass(run, b, parts, epoch, norms, stats, w, entropy_coef)
                if critic is not None:
                    critic.backward(b, norms["tokens"], stats.critic, w)
            if train_policy:
                if not backwards:
                    ph.zero_missing_grads(run.model)
                norm = optimizer_step(run.model, run.optimizer, cfg.optim.max_grad_norm)
                stats.grad_norm = norm if stats.grad_norm is None else stats.grad_norm
            if critic is not None:
                critic.step()
    stats = reduce_stats(stats, run.info)
    if train_policy:
        run.scheduler.step()
        run.rollout.sync_weights(run)
    if critic is not None:
        critic.end_update()
    row = update_metrics(run, stats, lr, beta, batches)
    row["zero_adv/no_backward_samples"] = sum(len(inert.trajectories) for _, inert in parts.values() if inert is not None)
    if train_policy and run.entropy_ctl.active:
        row.update(entropy_metrics(run, entropy_coef, row["entropy"]))
    return row


def entropy_metrics(run: RLRun, coef: float, entropy: float) -> dict:
    """The entropy bonus's row: `entropy/coef` (c applied this step), `entropy/bonus` (c·H, subtracted from the
    loss per token); the controller then follows this step's entropy (`entropy/next_coef`, adaptive control)."""
    run.entropy_ctl.update(entropy)
    out = {"entropy/coef": coef, "entropy/bonus": coef * entropy}
    if run.cfg.entropy_control == "adaptive":
        out["entropy/next_coef"] = run.entropy_ctl.coef()
    return out


def reset_reference(run: RLRun, step: int) -> dict:
    """ProRL (Liu et al. 2025) reference reset after step `step` (0-based) when step + 1 is a multiple of
    `ref_reset_every`: π_ref ← π_θ, and with `ref_reset_optimizer` the policy optimizer's state (AdamW moments,
    step counts) cleared; the learning-rate schedule goes on. -> {"ref_reset": 0 | 1}"""
    cfg = run.cfg
    if run.ref is None or (step + 1) % cfg.ref_reset_every:
        return {"ref_reset": 0}
    run.ref.load_state_dict(run.model.state_dict())
    if cfg.ref_reset_optimizer:
        run.optimizer.state.clear()
    return {"ref_reset": 1}


def policy_pass(run: RLRun, b: RLBatch, parts: dict, epoch: int, norms: dict, stats: UpdateStats, weight: float,
                entropy_coef: float) -> int:
    """The policy's pass over micro-batch b: backward over its live groups; its inert groups (every advantage 0: no
    gradient, `phases.inert_split`) get a no-grad forward for the metrics (zero_advantage=forward) or nothing
    (skip). `parts` keeps each micro-batch's split for the later epochs (each side keeps its old_logp).
    -> the backwards run (0 or 1)"""
    if id(b) not in parts:
        parts[id(b)] = ph.inert_split(run, b, entropy_coef)
    live, inert = parts[id(b)]
    if inert is not None and run.cfg.zero_advantage == "forward":
        policy_backward(run, inert, epoch, norms, stats, weight, entropy_coef, grad=False)
    if live is None:
        return 0
    policy_backward(run, live, epoch, norms, stats, weight, entropy_coef)
    return 1


def policy_backward(run: RLRun, b: RLBatch, epoch: int, norms: dict, stats: UpdateStats, weight: float = 1.0,
                    entropy_coef: float = 0.0, grad: bool = True) -> None:
    """The policy loss of one micro-batch, backward. `weight` 0: a padding copy that keeps a sharded run's
    ranks in step (its loss counts 0, no statistics). `entropy_coef` > 0: the loss − c·H per token, H with
    its gradient (every epoch). grad=False: the forward without autograd and no backward (inert groups: their
    loss and statistics, which a backward would not change)."""
    cfg = run.cfg
    first = epoch == 0
    bonus = entropy_coef > 0
    with torch.set_grad_enabled(grad):
        logp, entropy = fsdp.apply(run.model, ph.policy_logps, b, cfg.sampling.temperature, cfg.mixed_precision,
                                   truncated=True, with_entropy=first or bonus, entropy_grad=bonus)
    if first and b.old_logp is None:  # on-policy: the old policy is the current one
        b.old_logp = logp.detach()
    if first and weight:
        stats.cons.add(Consistency(**ph.consistency(b, logp.detach())))
        stats.entropy += float((entropy.detach() * b.mask).sum())
    loss, m = ph.batch_loss(logp, b, run.loss_fn, cfg, run.loss_beta, cfg.kl_estimator, run.tis_cap, norms,
                            entropy=entropy if bonus else None, entropy_coef=entropy_coef)
    scale = getattr(run.model, "loss_scale", 1.0)  # sharded: FSDP averages gradients over ranks, W x is a sum
    if grad:
        (loss * (weight * scale)).backward()
    if weight:
        stats.loss += float(loss.detach()) / cfg.epochs
        stats.losses.add(m, float(b.loss_mask.sum()))


def update_metrics(run: RLRun, stats: UpdateStats, lr: float, beta: float, batches: list[RLBatch]) -> dict:
    """The update's row: lr, KL and β (the KL controller follows the KL), the loss metrics, entropy,
    trainer-vs-sampler consistency."""
    out = stats.losses.result()
    kl = out.pop("kl/mean", None)  # measured only against a reference: absent at β = 0 (see kl_start)
    if run.ref is not None:
        kl = kl if kl is not None else 0.0
        if run.critic is not None:  # PPO: KL(π_old ‖ π_ref) from the reward's k1 terms
            kl, per_sequence, seqs = run.critic.reward_kl(batches)
        else:  # the loss's KL estimate per token -> nats per sequence, the controller's unit
            tokens = sum(int(b.loss_mask.sum()) for b in batches)
            seqs = max(sum(int(b.valid.sum()) for b in batches), 1)
            per_sequence = kl * tokens / seqs
        run.kl_ctl.update(per_sequence, seqs)
    measured_kl = {"kl": kl} if kl is not None else {}
    return {"lr": lr, **measured_kl, "beta": beta, **out, **stats.critic.result(), **stats.metrics()}
