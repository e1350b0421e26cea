"""What the recipes ask the planner (posttrain.plan) about their own run, and what they write back.

    write_plan(out, predict_run(cfg, model, "sft", steps=..., batch=..., seq_len=...))   # before training
    per_step = planned_tokens(sampler, steps, cfg.batch_size, tokens_of_item)            # the exact data plan
    plan = measured_plan(out, measured)                                                  # after: plan.json read back
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from posttrain.data.packing import Batch
from posttrain.models.forward import token_logprobs, unwrap
from posttrain.ops import tied
from posttrain.plan import predict
from posttrain.plan.cpu import run_hardware
from posttrain.plan.measure import Measured, write_measured
from posttrain.training.memprobe import activation_fit


def plan_dtype(dtype: str) -> str:
    """The planner's name of a training dtype: fp32 for float32, else bf16."""
    return "fp32" if dtype in ("float32", "fp32") else "bf16"


def predict_run(cfg, model, method: str, *, steps: int, hardware: bool = True, measure_activations: bool = False,
                **keys) -> dict:
    """The planner's prediction for a run of `cfg` training `model` (an HF model, possibly wrapped: LoRA, FSDP):
    its architecture, `cfg.dtype`, at least one step, the LoRA rank when `cfg` has LoRA settings, the
    recipes' chunked lm_head (no full logit copies) and, with `hardware`, this machine's measured speed
    (plan.cpu.run_hardware). `keys`: the method's own planner keys (batch, seq_len, micro_batch, ...).
    `measure_activations`: the activations of a token-level loss measured on `model` (memprobe.activation_fit
    over `token_probe`) instead of the closed form; one process only."""
    hf = unwrap(model)
    head = hf.get_output_embeddings()
    common = {"dtype": plan_dtype(cfg.dtype), "steps": max(steps, 1), "logit_copies": 0, **memory_saver_keys(cfg),
              "embedding_grad_buffer": not tied.qualifies(hf.get_input_embeddings(), getattr(head, "weight", None))}
    fit = activation_fit(model, token_probe(model, cfg.mixed_precision)) if measure_activations else None
    if fit:
        common.update(activation_fixed_bytes=fit["fixed"], activation_bytes_per_token=fit["per_token"])
    if hardware:
        common.update(run_hardware(model, cfg.dtype, cfg.mixed_precision))
    return predict(hf, method, **common, **keys)


def token_probe(model, mixed_precision: str):
    """make_step(n) for memprobe.activation_fit: one packed row of n tokens (fixed ids) through the recipes'
    token-level log-prob path (backbone, chunked head), every position a loss token."""
    vocab = unwrap(model).config.get_text_config().vocab_size

    def make_step(n: int):
        ids = (torch.arange(n + 1) * 7 + 3) % vocab
        batch = Batch(input_ids=ids[None, :n], position_ids=torch.arange(n)[None], targets=ids[None, 1:],
                      attention_mask=None, num_tokens=n, num_padding=0)
        return n, lambda: token_logprobs(model, batch, mixed_precision=mixed_precision)[0].sum()
    return make_step


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
