"""What the recipes ask the planner (posttrain.plan) about their own run, and what they write back.

    write_plan(out, predict_run(cfg, model, "sft", steps=..., batch=..., seq_len=...))   # before training
    per_step = planned_tokens(sampler, steps, cfg.batch_size, tokens_of_item)            # the exact data plan
    plan = measured_plan(out, measured)                                                  # after: plan.json read back
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from posttrain.models.forward import unwrap
from posttrain.plan import predict
from posttrain.plan.cpu import run_hardware
from posttrain.plan.measure import Measured, write_measured


def plan_dtype(dtype: str) -> str:
    """The planner's name of a training dtype: fp32 for float32, else bf16."""
    return "fp32" if dtype in ("float32", "fp32") else "bf16"


def predict_run(cfg, model, method: str, *, steps: int, hardware: bool = True, **keys) -> dict:
    """The planner's prediction for a run of `cfg` training `model` (an HF model, possibly wrapped: LoRA, FSDP):
    its architecture, `cfg.dtype`, at least one step, the LoRA rank when `cfg` has LoRA settings, the
    recipes' chunked lm_head (no full logit copies) and, with `hardware`, this machine's measured speed
    (plan.cpu.run_hardware). `keys`: the method's own planner keys (batch, seq_len, micro_batch, ...)."""
    common = {"dtype": plan_dtype(cfg.dtype), "steps": max(steps, 1), "logit_copies": 0, **memory_saver_keys(cfg)}
    if hardware:
        common.update(run_hardware(model, cfg.dtype, cfg.mixed_precision))
    return predict(unwrap(model), method, **common, **keys)


def memory_saver_keys(cfg) -> dict:
    """The planner keys of a recipe config's LoRA and gradient checkpointing settings."""
    keys = {"gradient_checkpointing": bool(getattr(cfg, "gradient_checkpointing", False))}
    lora = getattr(cfg, "lora", None)
    if lora is not None and lora.enabled:
        keys.update(lora_r=lora.r, lora_targets=lora.target_modules)
    return keys


def planned_tokens(sampler, steps: int, batch_size: int, item_tokens: list[int]) -> list[int]:
    """Tokens of each of the next `steps` steps: the sampler is deterministic, so a copy of it draws the
    items the trainer will draw (`item_tokens[i]`: the tokens of item i)."""
    probe = copy.deepcopy(sampler)
    return [sum(item_tokens[i] for i in probe.take(batch_size)) for _ in range(steps)]


def measured_plan(out: str | Path, measured: Measured) -> dict:
    """plan.json with the run's measurements filled in (posttrain.plan.measure.write_measured), read back."""
    return json.loads(write_measured(out, measured).read_text())
