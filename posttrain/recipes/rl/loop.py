"""`posttrain rl`: the run around the steps — setup, steps life.start .. max_steps with checkpoints and
alarm stops, the final model (and PPO's value model), summary and report."""

from __future__ import annotations

import json
import math
import os
import sys

from posttrain.algos.presets import describe_preset
from posttrain.config import parse_args, split_flags
from posttrain.monitor.alarms import AlarmStop
from posttrain.plan.measure import write_measured
from posttrain.recipes.rl import ray_cluster
from posttrain.recipes.rl.build import setup, step_function
from posttrain.recipes.rl.config import RLConfig
from posttrain.recipes.rl.run import RLRun
from posttrain.training.loop import CheckpointArgs, run_loop, save


def train(cfg: RLConfig) -> dict:
    return run_steps(setup(cfg))


def run_steps(run: RLRun, on_step=None) -> dict:
    """Steps life.start .. max_steps through the shared loop (checkpoints, alarm stops, fault injection; the
    rollout source closed at the end), then `finish`. `on_step(steps_done, row)` runs after each step (the
    quickstart prints its progress line there)."""
    step_fn = step_function(run.cfg)
    run_loop(run.life, run.cfg, lambda step: step_fn(run, step), lambda: checkpoint_args(run), desc=f"rl/{run.cfg.algo}",
             postfix=reward_postfix, on_step=on_step, on_exit=run.rollout.close)
    return finish(run, final_checkpoint=False)


def reward_postfix(row: dict) -> dict:
    return {"reward": f"{row['reward/mean']:.3f}" if row["reward/mean"] is not None else "nan"}


def checkpoint_args(run: RLRun) -> CheckpointArgs:
    return CheckpointArgs(run.model, run.optimizer, run.scheduler, checkpoint_state(run), extras=run.checkpoint_extras(),
                          tok=run.tok)


def checkpoint_state(run: RLRun) -> dict:
    """What a checkpoint keeps beside the weights: data position, β, alarm bands, the critic's schedule and
    the rollout source's own state (async RL: the rounds the trainer consumed)."""
    state = {"sampler": run.sampler.state(), "beta": run.kl_ctl.value, "alarms": run.alarms.state()}
    if run.drift is not None:
        state["drift"] = run.drift.state()
    if run.critic is not None:
        state.update(run.critic.state())
    if run.entropy_ctl.state():
        state["entropy"] = run.entropy_ctl.state()
    rollout = run.rollout.state()
    if rollout:
        state["rollout"] = rollout
    return state


def finish(run: RLRun, final_checkpoint: bool = True) -> dict:
    """The final model (and PPO's final/value/), measured vs planned, summary.json and the report. A caller
    that stepped the run itself gets the final checkpoint here (run_steps' loop has saved it already)."""
    cfg, life = run.cfg, run.life
    run.rollout.close()
    if final_checkpoint and cfg.max_steps > life.start:  # keeps resume possible (e.g. to extend max_steps)
        save(life, cfg.max_steps, checkpoint_args(run), force=True)
    final = life.save_final(run.model, run.tok, lora=cfg.lora.enabled)
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


def show_preset(cfg: RLConfig) -> str:
    """`posttrain rl algo=X --show-preset`: what the preset sets, its paper and deviations, then what this
    command line resolves to (overrides included). Reads the config only: no model, data or reward loads."""
    resolved = (f"resolved here: advantage={cfg.resolved_advantage} {cfg.advantage_args or ''}".rstrip()
                + f", loss={cfg.resolved_loss} {cfg.loss_args or ''}".rstrip()
                + f", loss_agg={cfg.resolved_agg}, beta={cfg.resolved_beta:g}, dynamic_sampling={cfg.resolved_dynamic_sampling}, "
                f"reward={cfg.resolved_reward}, max_new_tokens={cfg.sampling.max_new_tokens}")
    return f"{describe_preset(cfg.algo)}\n{resolved}"


def main(argv: list[str]) -> None:
    argv, flags = split_flags(argv, ("--show-preset",))
    cfg = parse_args(RLConfig, argv, prog="posttrain rl")  # a bad key or value: ConfigError, reported by the CLI
    if flags:
        print(show_preset(cfg))
        return
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
