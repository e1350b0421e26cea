"""`epochs=` of the offline trainers (sft, dpo, rm): max_steps from the data size and the batch size.

    note = resolve_max_steps(cfg, units=len(train), per_step=cfg.batch_size, what="pairs", life=life)

One epoch is ceil(units / per_step) optimizer steps, the steps after which the sampler (training.data_order.EpochSampler)
has drawn every unit once; `epochs=E` runs ceil(E · units / per_step) steps (at least 1). Which key decides:

    max_steps given, epochs not given     max_steps (rm: its default epochs=1 steps aside)
    epochs given, max_steps not given     epochs (sets max_steps; config.yaml records both)
    both given                            they must agree (a run's own config.yaml, reloaded on the same data,
                                          does), else refused with the steps that `epochs` means here
    neither (rm: epochs=null)             refused
"""

from __future__ import annotations

import math

from posttrain.config import save_yaml
from posttrain.errors import UserError


def steps_for(epochs: float, units: int, per_step: int) -> int:
    return max(1, math.ceil(epochs * units / per_step))


def resolve_max_steps(cfg, units: int, per_step: int, what: str, life=None) -> str:
    """Set `cfg.max_steps` from `cfg.epochs` where epochs decides (table above); returns the line saying so ("" when
    max_steps decided alone). `life` (RunLifecycle): config.yaml is rewritten with the steps, on rank 0."""
    given = cfg.model_fields_set
    epochs, max_steps = cfg.epochs, cfg.max_steps
    if epochs is None:
        if max_steps is None:
            raise UserError("give max_steps=N (optimizer steps) or epochs=E (passes over the training data)")
        return ""
    steps = steps_for(epochs, units, per_step)
    where = f"{epochs:g} epoch(s) of {units} {what} at batch_size={per_step}"
    if max_steps is not None and "max_steps" in given:
        if "epochs" not in given:
            return ""  # an explicit max_steps over a default epochs (rm)
        if max_steps != steps:
            raise UserError(f"max_steps={max_steps} and epochs={epochs:g} disagree: {where} is {steps} steps; give one of them")
    cfg.max_steps = steps
    if life is not None and life.main:
        save_yaml(cfg, life.out / "config.yaml")
    return f"{where}: max_steps={steps}"
