"""`posttrain rl`: the run around the steps — setup, steps life.start .. max_steps with checkpoints and
alarm stops, the final model (and PPO's value model), summary and report."""

from __future__ import annotations

import json
import math
import os
import sys

from posttrain.config import parse_args
from posttrain.monitor.alarms import AlarmStop
from posttrain.plan.measure import write_measured
from posttrain.recipes.rl import ray_cluster
from posttrain.recipes.rl.build import setup, step_function
from posttrain.recipes.rl.config import RLConfig
from posttrain.recipes.rl.run import RLRun
from posttrain.systems.faults import maybe_fail
from posttrain.training.run import progress


def train(cfg: RLConfig) -> dict:
    return run_steps(setup(cfg))


def run_steps(run: RLRun, on_step=None) -> dict:
    """Steps life.start .. max_steps (checkpoints, alarm stops, the rollout source closed), then `finish`.
    `on_step(steps_done, row)` runs after each step (the quickstart prints its progress line there)."""
    cfg = run.cfg
    step_fn = step_function(cfg)
    bar = progress(cfg.max_steps, run.life.start, f"rl/{cfg.algo}", cfg.progress and run.life.main)
    try:
        for step in range(run.life.start, cfg.max_steps):
            try:
                logged = step_fn(run, step)
            except AlarmStop as stop:
                if stop.checkpoint:  # the step's update is done: keep it
                    checkpoint(run, step + 1, force=True)
                raise
            bar.update(1)
            bar.set_postfix(reward=f"{logged['reward/mean']:.3f}" if logged["reward/mean"] is not None else "nan")
            checkpoint(run, step + 1)
            maybe_fail(run.info.rank, step + 1, run.life.out)
            if on_step is not None:
                on_step(step + 1, logged)
    finally:
        run.rollout.close()  # stops a producer thread or Ray actors
    bar.close()
    return finish(run)


def checkpoint(run: RLRun, done: int, force: bool = False) -> None:
    run.life.checkpoint(done, run.model, run.optimizer, run.scheduler, checkpoint_state(run), force=force,
                        extras=run.critic.extras() if run.critic is not None else None)


def checkpoint_state(run: RLRun) -> dict:
    """What a checkpoint keeps beside the weights: data position, β, alarm bands, the critic's schedule and
    the rollout source's own state (async RL: the rounds the trainer consumed)."""
    state = {"sampler": run.sampler.state(), "beta": run.kl_ctl.value, "alarms": run.alarms.state()}
    if run.critic is not None:
        state.update(run.critic.state())
    rollout = run.rollout.state()
    if rollout:
        state["rollout"] = rollout
    return state


def finish(run: RLRun) -> dict:
    cfg, life = run.cfg, run.life
    run.rollout.close()
    if cfg.max_steps > life.start:  # the final checkpoint keeps resume possible (e.g. to extend max_steps)
        checkpoint(run, cfg.max_steps, force=True)
    final = life.save_final(run.model, run.tok)
    if run.critic is not None:
        run.critic.save(final / "value", life.main)
    if not life.main:
        return {}
    plan = json.loads(write_measured(life.out, run.measured).read_text())
    history = life.history()
    rewards = [r["reward/mean"] for r in history if r.get("reward/mean") is not None]
    summary = {
        "algo": cfg.algo, "advantage": cfg.resolved_advantage, "loss": cfg.resolved_loss,
        "loss_agg": run.agg, "beta": cfg.resolved_beta, "steps": cfg.max_steps,
        "first_reward": rewards[0] if rewards else math.nan, "last_reward": rewards[-1] if rewards else math.nan,
        "skipped_steps": sum(r.get("skipped", 0) for r in history),
        "alarms": run.alarms.summary(),
        "tokens predicted (plan)": plan["predicted"]["tokens_per_step"] * (cfg.max_steps - life.start),
        "tokens counted": plan["measured"]["tokens"],
        **run.rollout.summary(),
    }
    life.finish(summary, f"RL ({cfg.algo}) — {cfg.model}", {"summary": summary, "plan vs measured": plan.get("comparison", {})})
    return summary


def main(argv: list[str]) -> None:
    cfg = parse_args(RLConfig, argv, prog="posttrain rl")  # a bad key or value: ConfigError, reported by the CLI
    if cfg.systems.cluster == "ray":  # the trainer runs as a Ray actor
        summary = ray_cluster.train(cfg, train)
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
