"""Online RL: PPO with a value model, and the group-baseline family (GRPO, Dr. GRPO, DAPO, GSPO, CISPO,
RLOO, REINFORCE++).

One step (`rl_step`) reads top to bottom; the phase names are the timer names:
    1. collect    G samples per prompt from the engine (behaviour log-probs kept) -> Trajectory;
                  score them (None = the reward does not apply: no baseline, no loss); dynamic
                  sampling drops groups without signal and refills (DAPO), capped retries
    2. advantage  outcome advantages from the registry over the applicable rewards
    3. reference  log π_ref on the loss tokens when β > 0 (no reference model at β = 0)
       critic     PPO only: V(s_t) from the value model, token rewards (−β·k1, outcome at the end), GAE
    4. update     policy loss (+ β·KL) over the global batch, TIS when trainer and sampler differ
                  in precision, PPO epochs, AdamW; the engine picks up the new weights
    5. log        one metrics.jsonl row (reward, KL, lengths, clip fractions, entropy, consistency, time)

Only generated tokens carry loss. The phases live in rl_phases.py; the lifecycle (resume,
checkpoints, final model, report) is shared with SFT (lifecycle.py). Under `torchrun --nproc-per-node W`
the policy is FSDP2-sharded and the ranks share generation and the update (posttrain/recipes/rl/sharded.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from posttrain.algos import AdaptiveKLController, FixedKLController
from posttrain.algos import advantages as adv_registry
from posttrain.algos import policy_losses, preference_losses
from posttrain.algos.presets import rl_preset, uses_critic
from posttrain.config import parse_args
from posttrain.data import formats
from posttrain.data.templates import render_prompt
from posttrain.errors import UserError
from posttrain.models.forward import unwrap
from posttrain.models.loading import load_model, load_tokenizer
from posttrain.eval.hook import EvalHook
from posttrain.monitor.alarms import AlarmMonitor, AlarmStop
from posttrain.monitor.metrics import PhaseTimer
from posttrain.plan import predict
from posttrain.plan.cpu import run_hardware
from posttrain.plan.measure import Measured, write_measured, write_plan
from posttrain.recipes.rl import phases as ph
from posttrain.training.data_order import EpochSampler
from posttrain.training.optim import build_optimizer, optimizer_step
from posttrain.training.run import progress, seed_everything
from posttrain.training.lifecycle import RunLifecycle
from posttrain.rewards.registry import compose
from posttrain.rollout.trajectory import Trajectory, make_batches
from posttrain.systems import fsdp
from posttrain.recipes.rl import sharded as fsdp_rl
from posttrain.systems.faults import maybe_fail
from posttrain.recipes.rl.config import RLConfig


@dataclass(eq=False)
class RLRun:
    """Everything a step needs, built once by `setup`."""

    cfg: RLConfig
    life: RunLifecycle
    tok: object
    rows: list
    reward_fn: object
    model: torch.nn.Module
    ref: torch.nn.Module | None
    engine: object
    optimizer: object
    scheduler: object
    sampler: EpochSampler
    kl_ctl: object
    adv_fn: object
    loss_fn: object
    agg: str
    dynamic: bool
    tis_cap: float | None
    device: torch.device
    metrics: object = None
    critic: object = None  # PPO's value model, its optimizer and schedule
    critic_opt: object = None
    critic_sched: object = None
    measured: Measured = field(default_factory=Measured)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    alarms: AlarmMonitor = field(default_factory=AlarmMonitor)
    eval_hook: EvalHook | None = None
    agent: object = None  # agentic.collect.AgentRun when cfg.env is set
    rollout: object = None  # async RL: the trainer side of the rollout queue (recipes/rl/async_rl.py)
    info: fsdp.DistInfo = field(default_factory=fsdp.DistInfo)  # torchrun's ranks (world size 1 without it)
    inner: torch.nn.Module | None = None  # sharded runs: the HF model inside the FSDP root `model`
    generator: torch.nn.Module | None = None  # sharded runs: the rollout engine's full, plain copy


# ---------------------------------------------------------------- one step


def rl_step(run: RLRun, step: int) -> dict:
    """One optimizer step of online RL; returns the metrics row it logged."""
    cfg, timer = run.cfg, run.timer
    t0 = time.perf_counter()
    # 1. collect: generate, score, filter (refill rounds for dynamic sampling)
    trajs, collect_metrics = collect(run, step)
    if cfg.algo == "online_dpo":  # 2-4. best vs worst of each group, a preference loss
        return online_dpo_step(run, step, trajs, t0, collect_metrics)
    # 2. advantage over the applicable rewards
    with timer("advantage"):
        adv_metrics = ph.assign_advantages(trajs, None if run.critic else run.adv_fn, cfg.mask_truncated)
    if not any(t.valid for t in trajs):  # every reward None (or every sample masked): nothing to learn from
        return log_step(run, step, trajs, t0, {**collect_metrics, "skipped": 1})
    batches = make_batches(trajs, run.tok.pad_token_id, cfg.micro_batch_tokens, device=run.device)
    # 3. reference (β > 0 only); PPO: old log-probs, values, token rewards, GAE
    if run.ref is not None:
        with timer("reference"):
            # sharded: only the micro-batches this rank trains on; PPO's token rewards need every batch's
            share = run.info.world > 1 and run.critic is None
            ph.reference_logps(run.ref, fsdp_rl.my_batches(batches, cfg.minibatches, run.info) if share else batches, cfg)
    if run.critic is not None:
        with timer("critic"):
            adv_metrics = critic_phase(run, batches)
    # 4. update
    with timer("update"):
        update_metrics = update(run, batches, train_policy=step >= cfg.critic_warmup or run.critic is None)
    # 5. log
    return log_step(run, step, trajs, t0, {**collect_metrics, **adv_metrics, **update_metrics, "skipped": 0})


def collect(run: RLRun, step: int) -> tuple[list[Trajectory], dict]:
    """B groups of G scored samples; with dynamic sampling, groups without signal are replaced by new
    prompts (at most max_resample extra rounds; if none has signal the last round's groups are kept)."""
    if run.agent is not None:  # multi-turn episodes (posttrain/recipes/rl/agentic.py)
        from posttrain.recipes.rl.agentic import collect_agentic

        return collect_agentic(run, step)
    if run.rollout is not None:  # async RL: groups from the rollout queue, staleness <= k
        with run.timer("wait"):
            return run.rollout.collect(run, step)
    cfg = run.cfg
    rows_by_group: dict = {}
    reward_metrics: dict = {}

    def produce(rows, first: int, rounds: int) -> list[Trajectory]:
        rows_by_group.update({first + j: r for j, r in enumerate(rows)})
        seed = ph.batch_seed(cfg.seed, step, rounds)
        if run.info.world > 1:  # each rank its share of the rows, then every rank the whole batch
            new, metrics = fsdp_rl.generate_share(run, rows, first, seed, step, rows_by_group)
        else:
            with run.timer("generate"):
                new = ph.generate(run.engine, run.tok, rows, first, cfg, seed, version=step)
            with run.timer("reward"):
                ph.score(run.reward_fn, rows_by_group, new)
            metrics = run.reward_fn.last_metrics
        if rounds == 0:
            reward_metrics.update(metrics)
        return new

    kept, dynamic = ph.refill_groups(run, produce)
    assert all(len({tuple(t.prompt_ids) for t in kept if t.group == g}) == 1 for g in {t.group for t in kept})
    metrics = {k: v for k, v in reward_metrics.items() if isinstance(v, (int, float))}  # rewards/<name>/…
    return kept, {**metrics, **dynamic}


def online_dpo_step(run: RLRun, step: int, trajs: list[Trajectory], t0: float, collect_metrics: dict) -> dict:
    """Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"): pairs
    sampled from the current policy, labelled by the reward, one preference-loss step."""
    cfg = run.cfg
    ph.assign_advantages(trajs, None, cfg.mask_truncated)
    pairs, skipped = ph.preference_pairs([t for t in trajs if t.valid])
    if not pairs:
        return log_step(run, step, trajs, t0, {**collect_metrics, "pairs": 0, "skipped": 1})
    in_pairs = [t for pair in pairs for t in pair]
    batches = make_batches(in_pairs, run.tok.pad_token_id, cfg.micro_batch_tokens, device=run.device)
    ref = None
    if run.ref is not None:
        with run.timer("reference"), torch.no_grad():
            ref = ph.sequence_logps(run.ref, batches, cfg.mixed_precision)
    with run.timer("update"):
        lr = run.scheduler.get_last_lr()[0]
        policy = ph.sequence_logps(run.model, batches, cfg.mixed_precision)
        loss, metrics = ph.pair_loss(preference_losses.get(cfg.pref_loss), pairs, policy, ref, cfg.pref_args)
        loss.backward()
        grad_norm = optimizer_step(run.model, run.optimizer, cfg.optim.max_grad_norm)
        run.scheduler.step()
        run.engine.sync_weights()
        if run.ref is not None and cfg.ref_update_every and (step + 1) % cfg.ref_update_every == 0:
            run.ref.load_state_dict(run.model.state_dict())
    row = {"loss": loss.detach(), "lr": lr, "grad_norm": grad_norm, "pairs": len(pairs), "pairs/groups_skipped": skipped,
           **{f"pref/{k}": v for k, v in metrics.items()}, "skipped": 0}
    return log_step(run, step, trajs, t0, {**collect_metrics, **row})


def critic_phase(run: RLRun, batches) -> dict:
    """PPO: π_old (for the KL in the reward), V(s_t), token rewards and GAE advantages on the batches."""
    cfg = run.cfg
    beta = run.kl_ctl.value if run.ref is not None else 0.0
    if beta > 0:
        ph.old_logps(run.model, batches, cfg)
    ph.critic_values(run.critic, batches, cfg.mixed_precision)
    return ph.ppo_advantages(batches, beta, cfg.gamma, cfg.lam, cfg.whiten_advantages, cfg.bootstrap_truncated)


def update(run: RLRun, batches, train_policy: bool = True) -> dict:
    """ppo_epochs passes of ppo_minibatches optimizer steps; the first pass's first forward is
    on-policy (old = current, no recomputation). PPO also trains the value model on the same batches;
    during `critic_warmup` only the value model learns."""
    cfg = run.cfg
    beta = run.kl_ctl.value if (run.ref is not None and run.critic is None) else 0.0  # PPO: the KL is in the reward
    stats = {"losses": ph.TokenMeans(), "critic": ph.TokenMeans(), "loss": 0.0, "entropy": 0.0,
             "cons": {"dlogp_max": 0.0, "dlogp_sum": 0.0, "kl_sum": 0.0, "tokens": 0}, "grad_norm": None}
    lr, beta_used = run.scheduler.get_last_lr()[0], (run.kl_ctl.value if run.ref is not None else 0.0)
    minibatches = [batches[i::cfg.minibatches] for i in range(min(cfg.minibatches, len(batches)))]
    for epoch in range(cfg.epochs):
        for mb in minibatches:
            norms = {"agg": run.agg, "tokens": max(sum(int(b.loss_mask.sum()) for b in mb), 1),
                     "seqs": max(sum(int(b.valid.sum()) for b in mb), 1)}
            for b, w in fsdp.rank_share(mb, run.info):  # one process: every micro-batch, weight 1
                if train_policy:
                    policy_backward(run, b, epoch, beta, norms, stats, w)
                if run.critic is not None:
                    critic_backward(run, b, norms, stats, w)
            if train_policy:
                norm = optimizer_step(run.model, run.optimizer, cfg.optim.max_grad_norm)
                stats["grad_norm"] = norm if stats["grad_norm"] is None else stats["grad_norm"]
            if run.critic is not None:
                optimizer_step(run.critic, run.critic_opt, cfg.optim.max_grad_norm)
    fsdp_rl.reduce_stats(stats, run.info)
    if train_policy:
        run.scheduler.step()
        sync_engine(run)
    if run.critic_sched is not None:
        run.critic_sched.step()
    return update_metrics(run, stats, lr, beta_used, batches)


def sync_engine(run: RLRun) -> None:
    """The engine shares the weights (one process) or holds a copy (sharded: gathered into it, a collective);
    either way its packed copies and cached KV are stale after an update."""
    if run.generator is not None:
        fsdp_rl.sync_generator(run)
    run.engine.sync_weights()


def critic_backward(run: RLRun, b, norms: dict, stats: dict, weight: float = 1.0) -> None:
    """PPO's clipped value loss on one micro-batch, its share of the minibatch's token mean."""
    loss, m = ph.critic_loss(run.critic, b, run.cfg.mixed_precision, run.cfg.vf_clip, norms["tokens"])
    scale = getattr(run.critic, "loss_scale", 1.0)  # sharded: FSDP averages gradients over ranks, W x is a sum
    (loss * (weight * scale) if run.info.world > 1 else loss).backward()
    if weight:
        tokens = float(b.loss_mask.sum())
        stats["critic"].add({"vf/loss": loss.detach() * norms["tokens"] / max(tokens, 1), **m}, tokens)


def policy_backward(run: RLRun, b, epoch: int, beta: float, norms: dict, stats: dict, weight: float = 1.0) -> None:
    """`weight` 0: a padding copy that keeps a sharded run's ranks in step (its loss counts 0, no statistics)."""
    cfg = run.cfg
    first = epoch == 0
    logp, entropy = fsdp.apply(run.model, ph.policy_logps, b, cfg.sampling.temperature, cfg.mixed_precision,
                               truncated=True, with_entropy=first)
    if first and b.old_logp is None:  # on-policy: the old policy is the current one
        b.old_logp = logp.detach()
    if first and weight:
        c = ph.consistency(b, logp.detach())
        cons = stats["cons"]
        stats["cons"] = {k: max(cons[k], c[k]) if k == "dlogp_max" else cons[k] + c[k] for k in cons}
        stats["entropy"] += float((entropy * b.mask).sum())
    loss, m = ph.batch_loss(logp, b, run.loss_fn, cfg, beta, cfg.kl_estimator, run.tis_cap, norms)
    scale = getattr(run.model, "loss_scale", 1.0)  # sharded: FSDP averages gradients over ranks, W x is a sum
    (loss * (weight * scale) if run.info.world > 1 else loss).backward()
    if weight:
        stats["loss"] += float(loss.detach()) / cfg.epochs
        stats["losses"].add(m, float(b.loss_mask.sum()))


def update_metrics(run: RLRun, stats: dict, lr: float, beta: float, batches) -> dict:
    out = stats["losses"].result()
    kl = out.pop("kl/mean", 0.0)
    if run.ref is not None and run.critic is None:
        tokens = sum(int(b.loss_mask.sum()) for b in batches)
        seqs = max(sum(int(b.valid.sum()) for b in batches), 1)
        run.kl_ctl.update(kl * tokens / seqs, seqs)  # nats per sequence, the controller's unit
    if run.critic is not None and run.ref is not None:  # PPO: KL(π_old ‖ π_ref) from the reward's k1 terms
        k1 = torch.cat([(b.old_logp - b.ref_logp)[b.loss_mask] for b in batches])
        kl = float(k1.mean())
        seqs = max(sum(int(b.valid.sum()) for b in batches), 1)
        run.kl_ctl.update(float(k1.sum()) / seqs, seqs)
    cons, n = stats["cons"], max(stats["cons"]["tokens"], 1)
    row = {"lr": lr, "kl": kl, "beta": beta, **out, **stats["critic"].result()}
    if stats["grad_norm"] is not None:
        row.update({"loss": stats["loss"], "grad_norm": stats["grad_norm"], "entropy": stats["entropy"] / n,
                    "consistency/dlogp_max": cons["dlogp_max"], "consistency/dlogp_mean": cons["dlogp_sum"] / n,
                    "consistency/kl_behaviour_trainer": cons["kl_sum"] / n})
    return row


def log_step(run: RLRun, step: int, trajs: list[Trajectory], t0: float, metrics: dict) -> dict:
    cfg = run.cfg
    if run.eval_hook is not None:  # held-out pass@1 with its interval, when due
        with run.timer("eval"):
            metrics = {**metrics, **run.eval_hook.maybe(run.engine, step + 1, last=step + 1 == cfg.max_steps)}
    scored = [t.reward for t in trajs if t.reward is not None]
    lengths = torch.tensor([len(t.response_ids) for t in trajs], dtype=torch.float32)
    all_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    run.measured.add_step(all_tokens, int(lengths.sum()))
    row = merge_metrics(metrics, {
        "reward/mean": sum(scored) / len(scored) if scored else math.nan,
        "reward/std": float(torch.tensor(scored).std()) if len(scored) > 1 else math.nan,
        "reward/none_frac": 1 - len(scored) / len(trajs),
        "response_length/mean": lengths.mean(), "response_length/max": lengths.max(),
        "response_length/clipped_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
        "samples": len(trajs), "tokens": all_tokens, "generated_tokens": int(lengths.sum()),
        "tokens_per_s": all_tokens / (time.perf_counter() - t0),
    }, run.timer.pop())
    fired = run.alarms.check(step + 1, row, [{"prompt": run.tok.decode(t.prompt_ids), "completion": t.text,
                                              "reward": t.reward} for t in trajs])
    row.update(run.alarms.metrics(fired))
    logged = run.metrics.write(step + 1, row)
    if run.life.main:  # a sharded run's other ranks hold the same samples
        with (run.life.out / "samples.jsonl").open("a") as f:
            for t in trajs[: cfg.samples_per_log]:
                f.write(json.dumps({"step": step + 1, "prompt": run.tok.decode(t.prompt_ids), "completion": t.text,
                                    "reward": t.reward, "finish_reason": t.finish_reason}) + "\n")
    run.alarms.act(fired)  # on_alarm=stop | checkpoint_and_stop raises AlarmStop
    return logged


def merge_metrics(*parts: dict) -> dict:
    """One row from the phases' metrics; a name two phases both produce is a bug, not an overwrite."""
    out: dict = {}
    for part in parts:
        clash = set(out) & set(part)
        if clash:
            raise ValueError(f"metric names produced twice in one step: {sorted(clash)}")
        out.update(part)
    return out


# ---------------------------------------------------------------- run


def setup(cfg: RLConfig) -> RLRun:
    """Everything before the first step: data and reward checked before any model loads."""
    from posttrain.models.device import resolve_device
    from posttrain.rollout.engine import Engine

    preset = rl_preset(cfg.algo)
    info = init_ranks(cfg, preset)
    life = RunLifecycle(cfg, info)
    seed_everything(cfg.seed)
    device = fsdp.rank_device(resolve_device(cfg.device), info)
    tok = load_tokenizer(cfg.model)
    rows, _ = formats.load(cfg.data, allowed=("prompt_only", "prompt_completion"))
    agent = None
    if cfg.env:  # the environment's reward replaces `reward`
        from posttrain.recipes.rl.agentic import setup_agent

        agent = setup_agent(cfg, tok, rows)
    reward_fn = build_reward(cfg, rows) if agent is None else None
    eval_hook = EvalHook(cfg.eval, tok, recipe_reward=reward_fn, default_sampling=cfg.sampling)  # data checked now
    measured = Measured()
    model = load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed).to(device)
    model.train()
    beta = cfg.resolved_beta
    ref = load_reference(model) if cfg.needs_reference else None  # β = 0 must not load a reference model
    engine_cfg = cfg.engine.model_copy(update={
        k: v for k, v in {"max_num_seqs": min(256, cfg.prompts_per_step * cfg.group_size), "seed": cfg.seed}.items()
        if k not in cfg.engine.model_fields_set})
    inner = generator = None
    if info.world > 1:  # the engine samples from a full copy; the trainer's weights are sharded
        inner, generator = model, load_reference(model)
        model = fsdp.shard_model(model)
    if cfg.systems.pipelined:  # the rollout worker samples on its own copy; this one serves evaluation only
        from posttrain.recipes.rl.async_rl import TrainerEngine

        engine = TrainerEngine(model, tok, engine_cfg)
    else:
        engine = Engine(generator if generator is not None else model, tok, engine_cfg)
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    kl_ctl = AdaptiveKLController(beta, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target and beta > 0 else FixedKLController(beta)
    run = RLRun(cfg, life, tok, rows, reward_fn, model, ref, engine, optimizer, scheduler,
                EpochSampler(len(rows), cfg.seed), kl_ctl, adv_registry.get(cfg.advantage or preset.advantage),
                policy_losses.get(cfg.loss or preset.loss), cfg.loss_agg or preset.agg,
                preset.dynamic_sampling if cfg.dynamic_sampling is None else cfg.dynamic_sampling,
                default_tis_cap(cfg), device, measured=measured, alarms=AlarmMonitor(cfg.alarms, echo=None if info.main else lambda text: None), eval_hook=eval_hook,
                agent=agent, info=info, inner=inner, generator=generator)
    if uses_critic(preset):
        build_critic(run)
    state = life.restore(model, optimizer, scheduler, extras=critic_extras(run))
    if state:
        run.sampler.load(state["sampler"])
        kl_ctl.value = state.get("beta", kl_ctl.value)
        run.alarms.load(state.get("alarms", {}))
        if run.critic_sched is not None:
            run.critic_sched.load_state_dict(state["critic_scheduler"])
        sync_engine(run)
    if cfg.systems.pipelined:
        from posttrain.recipes.rl.async_rl import attach

        attach(run, state)
    if life.main:
        write_plan(life.out, plan_run(cfg, inner if inner is not None else model, beta, tok, rows, agent))
    run.metrics = life.metrics()
    life.fresh_file("samples.jsonl")
    if agent is not None:
        life.fresh_file("episodes.jsonl")
    return run


def build_critic(run: RLRun) -> None:
    """PPO's value model (from the policy or a reward model folder), its AdamW and schedule."""
    from posttrain.models.value import value_model_from_policy, value_model_from_reward_model

    cfg = run.cfg
    if cfg.value_model:
        run.critic = value_model_from_reward_model(cfg.value_model, run.device)
    else:  # sharded: from the rollout copy (the initial weights, unsharded)
        run.critic = value_model_from_policy(run.generator if run.generator is not None else run.model)
    if run.info.world > 1:
        run.critic = fsdp.shard_model(run.critic, lm=run.critic.lm)
    lr = cfg.critic_lr or 10 * cfg.optim.lr
    run.critic_opt, run.critic_sched = build_optimizer(run.critic, cfg.optim.model_copy(update={"lr": lr}), cfg.max_steps)


def save_value_model(run: RLRun, path) -> None:
    """final/value/ (sequence-classification layout); a sharded value model is gathered first (every rank)."""
    if isinstance(run.critic, fsdp.Sharded):
        state = fsdp.full_state(run.critic.model)
        if run.life.main:
            run.critic.model.save_pretrained(path, state=state)
    else:
        run.critic.save_pretrained(path)


def critic_extras(run: RLRun) -> dict | None:
    return {"value": (run.critic, run.critic_opt)} if run.critic is not None else None


def init_ranks(cfg: RLConfig, preset) -> fsdp.DistInfo:
    """torchrun's ranks (world size 1 without it); refuses what a sharded run cannot do yet."""
    info = fsdp.init_from_env()
    if info.world > 1:
        unsupported = ((cfg.algo == "online_dpo", "algo=online_dpo"),
                       (bool(cfg.env), "env= (multi-turn episodes)"), (cfg.systems.pipelined, "async_rl / cluster=ray"))
        for on, what in unsupported:
            if on:
                raise UserError(f"{what}: not supported under torchrun yet (world size {info.world}); "
                                "PPO and the GRPO family are")
    return info


def train(cfg: RLConfig) -> dict:
    return run_steps(setup(cfg))


def run_steps(run: RLRun, on_step=None) -> dict:
    """Steps life.start .. max_steps (checkpoints, alarm stops, the rollout producer closed), then `finish`.
    `on_step(steps_done, row)` runs after each step (the quickstart prints its progress line there)."""
    cfg = run.cfg
    bar = progress(cfg.max_steps, run.life.start, f"rl/{cfg.algo}", cfg.progress and run.life.main)
    try:
        for step in range(run.life.start, cfg.max_steps):
            try:
                logged = rl_step(run, step)
            except AlarmStop as stop:
                if stop.checkpoint:  # the step's update is done: keep it
                    run.life.checkpoint(step + 1, run.model, run.optimizer, run.scheduler, checkpoint_state(run), force=True,
                                        extras=critic_extras(run))
                raise
            bar.update(1)
            bar.set_postfix(reward=f"{logged['reward/mean']:.3f}" if logged["reward/mean"] is not None else "nan")
            run.life.checkpoint(step + 1, run.model, run.optimizer, run.scheduler, checkpoint_state(run),
                                extras=critic_extras(run))
            maybe_fail(run.info.rank, step + 1, run.life.out)
            if on_step is not None:
                on_step(step + 1, logged)
    finally:
        if run.rollout is not None:
            run.rollout.close()  # stop the rollout producer (thread or Ray actors)
    bar.close()
    return finish(run)


def checkpoint_state(run: RLRun) -> dict:
    state = {"sampler": run.sampler.state(), "beta": run.kl_ctl.value, "alarms": run.alarms.state()}
    if run.critic_sched is not None:
        state["critic_scheduler"] = run.critic_sched.state_dict()
    if run.rollout is not None:  # async RL: the rounds the trainer consumed (a resumed producer skips them)
        state["rollout"] = run.rollout.state()
    return state


def finish(run: RLRun) -> dict:
    cfg, life = run.cfg, run.life
    if run.rollout is not None:
        run.rollout.close()
    if cfg.max_steps > life.start:  # the final checkpoint keeps resume possible (e.g. to extend max_steps)
        life.checkpoint(cfg.max_steps, run.model, run.optimizer, run.scheduler, checkpoint_state(run), force=True,
                        extras=critic_extras(run))
    final = life.save_final(run.model, run.tok)
    if run.critic is not None:
        save_value_model(run, final / "value")
    if not life.main:
        return {}
    plan = json.loads(write_measured(life.out, run.measured).read_text())
    history = life.history()
    preset = rl_preset(cfg.algo)
    rewards = [r["reward/mean"] for r in history if r.get("reward/mean") is not None]
    summary = {
        "algo": cfg.algo, "advantage": cfg.advantage or preset.advantage, "loss": cfg.loss or preset.loss,
        "loss_agg": run.agg, "beta": cfg.resolved_beta, "steps": cfg.max_steps,
        "first_reward": rewards[0] if rewards else math.nan, "last_reward": rewards[-1] if rewards else math.nan,
        "skipped_steps": sum(r.get("skipped", 0) for r in history),
        "alarms": run.alarms.summary(),
        "tokens predicted (plan)": plan["predicted"]["tokens_per_step"] * (cfg.max_steps - life.start),
        "tokens counted": plan["measured"]["tokens"],
        **(run.rollout.summary() if run.rollout is not None else {}),
    }
    life.finish(summary, f"RL ({cfg.algo}) — {cfg.model}", {"summary": summary, "plan vs measured": plan.get("comparison", {})})
    return summary


def build_reward(cfg: RLConfig, rows):
    """The composed reward; DAPO's overlong shaping defaults to the run's generation limit."""
    from posttrain.rewards.registry import parse_spec
    from posttrain.rewards.shaping import overlong_defaults

    options = {k: dict(v) for k, v in cfg.reward_args.items()}
    if any(name == "overlong" for name, _ in parse_spec(cfg.reward)) and "overlong" not in options:
        options["overlong"] = overlong_defaults(cfg.sampling.max_new_tokens)
    reward_fn = compose(cfg.reward, options=options)
    missing = {c for cols in reward_fn.columns.values() for c in cols if isinstance(c, str) and c not in rows[0].data}
    if missing:
        raise rows[0].error(sorted(missing)[0], f"reward '{cfg.reward}' needs this column")
    return reward_fn


def default_tis_cap(cfg: RLConfig) -> float | None:
    """TIS (Yao et al. 2025) is on whenever the trainer computes in another precision than the sampler."""
    if cfg.tis_cap is not None:
        return cfg.tis_cap or None
    return 2.0 if cfg.mixed_precision != "none" else None


def load_reference(model):
    """The frozen reference policy: a copy of the initial weights (π_ref = π_θ at step 0)."""
    import copy

    return copy.deepcopy(model).eval().requires_grad_(False)


def plan_run(cfg: RLConfig, model, beta: float, tok, rows, agent=None) -> dict:
    """Planner prediction for the run; tokens assume every sample runs to max_new_tokens (and, with an
    env, every episode to max_turns: agentic.collect.plan_inputs)."""
    method = "ppo" if uses_critic(rl_preset(cfg.algo)) else "grpo"
    extra = {"value_model": True} if method == "ppo" else {}
    if agent is not None:
        from posttrain.recipes.rl.agentic import plan_inputs

        method, extra = "agent", {**extra, **plan_inputs(cfg, agent)}
    else:
        extra["seq_len"] = cfg.sampling.max_new_tokens
        extra["prompt_len"] = round(sum(len(render_prompt(tok, r.data["prompt"])) for r in rows) / len(rows))
    return predict(unwrap(model).config, method, **extra, batch=cfg.prompts_per_step, group=cfg.group_size,
                   beta=beta, reward="verifier",
                   micro_batch=cfg.prompts_per_step * cfg.group_size, dtype="fp32" if cfg.dtype in ("float32", "fp32") else "bf16",
                   steps=max(cfg.max_steps, 1), logit_copies=0, **run_hardware(model, cfg.dtype, cfg.mixed_precision))


def main(argv: list[str]) -> None:
    cfg = parse_args(RLConfig, argv, prog="posttrain rl")  # a bad key or value: ConfigError, reported by the CLI
    if cfg.systems.cluster == "ray":  # the trainer runs as a Ray actor
        from posttrain.recipes.rl.ray_cluster import train as train_on_ray

        summary = train_on_ray(cfg)
    else:
        try:
            summary = train(cfg)
        except AlarmStop as stop:
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:
                raise
            # under torchrun a failed exit restarts every rank (--max-restarts) and resume=true would go on
            print(f"[rank {os.environ.get('RANK')}] {stop}", file=sys.stderr)
            return
    if not summary:  # ranks > 0 of a torchrun run
        return
    print(f"reward {summary['first_reward']:.3f} -> {summary['last_reward']:.3f}; run directory: {cfg.output_dir}")
