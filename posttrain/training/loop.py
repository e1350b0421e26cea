"""The step loop every training recipe shares: `run_loop`.

    def my_step(step: int) -> dict: ...               # one optimizer step (0-based); -> the metrics row it logged
    def state() -> CheckpointArgs: ...                # what a checkpoint saves, read when one is saved
    run_loop(life, cfg, my_step, state, desc="sft", postfix=lambda row: {"loss": f"{row['loss']:.4f}"})

A recipe keeps its own step; the loop owns what is the same everywhere: the progress bar, the steps
`life.start .. cfg.max_steps`, the periodic checkpoint after each step (`life.checkpoint`: every
`save_every`), the fault injection of the restart tests (`POSTTRAIN_FAIL_AT`, posttrain/systems/faults.py),
the forced checkpoint of an `AlarmStop(checkpoint=True)`, and the final forced checkpoint that keeps
resume possible (e.g. to extend max_steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.monitor.alarms import AlarmStop
from posttrain.systems.faults import maybe_fail
from posttrain.training.run import progress


@dataclass
class CheckpointArgs:
    """What a checkpoint holds besides the step: the trained model, its optimizer and schedule, the recipe's
    state (data position, alarms, ...), `extras`: name -> (module, optimizer), e.g. PPO's value model, and the
    tokenizer `tok` that makes checkpoints/step-N/ a loadable model folder."""

    model: Any
    optimizer: Any
    scheduler: Any
    state: dict
    extras: dict | None = None
    tok: Any = None


def save(life, done: int, args: CheckpointArgs, force: bool = False) -> None:
    """`life.checkpoint` with `args` (every `save_every` steps; always when `force`)."""
    life.checkpoint(done, args.model, args.optimizer, args.scheduler, args.state, force=force, extras=args.extras,
                    tok=args.tok)


def run_loop(life, cfg, step_fn: Callable[[int], dict], state_fn: Callable[[], CheckpointArgs], *, desc: str,
             postfix: Callable[[dict], dict] | None = None, on_step: Callable[[int, dict], None] | None = None,
             on_exit: Callable[[], None] | None = None) -> None:
    """Run steps `life.start .. cfg.max_steps` of a recipe (`life`: its RunLifecycle, after `restore`).

    After each step, in this order: the progress bar advances (its postfix from `postfix(row)`), a checkpoint
    is saved when `save_every` says so (`state_fn()` read then), `POSTTRAIN_FAIL_AT=RANK:STEP` may end the
    process (after that step's checkpoint), and `on_step(steps_done, row)` runs. A step that raises
    `AlarmStop` with `checkpoint=True` has finished its update: a forced checkpoint of that step is saved
    before the exception propagates. `on_exit()` runs when the loop ends, normally or by an exception
    (RL closes its rollout producer there). After the last step, when the run took any step, a forced
    checkpoint at `max_steps`. The bar shows on rank 0 when `cfg.progress` (default on).
    """
    bar = progress(cfg.max_steps, life.start, desc, getattr(cfg, "progress", True) and life.main)
    try:
        for step in range(life.start, cfg.max_steps):
            try:
                row = step_fn(step)
            except AlarmStop as stop:
                if stop.checkpoint:  # the step's update is done: keep it
                    save(life, step + 1, state_fn(), force=True)
                raise
            done = step + 1
            bar.update(1)
            if postfix is not None:
                bar.set_postfix(postfix(row))
            save(life, done, state_fn())
            maybe_fail(life.info.rank, done, life.out)
            if on_step is not None:
                on_step(done, row)
    finally:
        bar.close()
        if on_exit is not None:
            on_exit()
    if cfg.max_steps > life.start:  # the final checkpoint keeps resume possible (e.g. to extend max_steps)
        save(life, cfg.max_steps, state_fn(), force=True)
