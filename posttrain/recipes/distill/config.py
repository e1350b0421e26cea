"""`posttrain distill`'s config (DistillConfig) and the configs it derives for the recipes that do the work:
`sft_settings` (logit mode's data, sequence mode's SFT). on_policy.py derives the RL recipe's config and
sequence.py rejection sampling's the same way: every field two configs share by name is copied
(posttrain/training/settings.py), so a field added to both reaches the derived config.
"""

from __future__ import annotations

import copy
from typing import ClassVar

from pydantic import Field, model_validator

from posttrain.algos import distill_losses
from posttrain.algos.presets import rl_preset
from posttrain.config import CommonConfig, unused_key
from posttrain.eval.hook import EvalSettings
from posttrain.models.lora import LoraSettings
from posttrain.monitor.alarms import AlarmSettings
from posttrain.recipes.rl import RLConfig
from posttrain.recipes.rs import RSConfig
from posttrain.recipes.sft import SFTConfig
from posttrain.rollout.engine import EngineConfig
from posttrain.rollout.settings import SamplingSettings
from posttrain.training.optim import OptimSettings
from posttrain.training.settings import derive

MODES = ("on_policy", "logit", "sequence")
NO_REWARD = "none"  # the reward of a run without one: every sample None (registered by on_policy.py)
# The divergence when `divergence` is not given: classic KD is forward KL; on the student's own samples
# GKD found the mode-seeking reverse KL / JSD best for generation quality (Agarwal et al. 2024, §5).
DEFAULT_DIVERGENCE = {"logit": "forward_kl", "on_policy": "reverse_kl"}


def _like(cls, name: str, mode: str, **update):
    """The field `name` of another recipe's config (same default, constraints and meaning), tagged with the mode."""
    f = copy.copy(cls.model_fields[name])
    f.description = f"{mode}: {f.description}"
    for k, v in update.items():
        setattr(f, k, v)
    return f


class DistillConfig(CommonConfig):
    """posttrain distill: a student learns from a teacher, at the logit level (top-k cache), on teacher
    sequences, or on its own samples (GKD)."""

    mode: str = Field("on_policy", pattern="^(on_policy|logit|sequence)$", description="on_policy (GKD) | logit (top-k teacher cache) | sequence (teacher generates, student SFT)")
    model: str = Field("tiny-random", description="the student: HF folder, built-in name or Hub id")
    teacher: str = Field("", description="the teacher: any causal LM folder, a PEFT adapter folder (base + adapter), built-in name or Hub id")
    teacher_dtype: str = Field("float32", description="teacher weights dtype (it scores / generates in it)")
    data: str = Field("arithmetic", description="logit: sequences (messages | prompt+completion | text); on_policy, sequence: prompts (`prompt` + reward columns)")
    output_dir: str = Field("runs/distill", description="run directory")
    max_steps: int = Field(50, ge=0, description="optimizer steps (sequence: the SFT's steps; unset there: `epochs` over the kept set)")
    dtype: str = Field("float32", description="student weights dtype")
    divergence: str | None = Field(None, description=f"forward_kl | reverse_kl | jsd (posttrain.algos.distill_losses); default {DEFAULT_DIVERGENCE}")
    beta: float = Field(0.5, gt=0, lt=1, description="jsd: β of JSD(β) = β KL(P‖M) + (1−β) KL(Q‖M), M = βP + (1−β)Q")
    temperature: float = Field(1.0, gt=0, description="logit, on_policy: both distributions at this temperature in the divergence")
    optim: OptimSettings = Field(default_factory=OptimSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings, description="train a LoRA adapter on the student")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    progress: bool = Field(True, description="show a progress bar")
    # logit (and the SFT of sequence)
    top_k: int = Field(64, ge=1, description="logit: teacher log-probs stored per loss token (plus the tail mass)")
    cache_dtype: str = Field("float16", pattern="^(float16|float32)$", description="logit: dtype of the cached log-probs (float16: 2 bytes, 258 B/token at k=64, docs/distill.md)")
    cache_dir: str = Field("", description="logit: where teacher caches live (empty: <output_dir>/../teacher-cache, next to the run)")
    teacher_batch_tokens: int = Field(4096, ge=64, description="logit: tokens per teacher forward while filling the cache")
    ce_weight: float = Field(0.0, ge=0, le=1, description="logit: weight of the data's NLL; loss = (1 − w)·divergence + w·NLL")
    batch_size: int = _like(SFTConfig, "batch_size", "logit, sequence")
    micro_batch_size: int = _like(SFTConfig, "micro_batch_size", "logit, sequence")
    max_length: int = _like(SFTConfig, "max_length", "logit, sequence")
    too_long: str = _like(SFTConfig, "too_long", "logit, sequence")
    packing: bool = _like(SFTConfig, "packing", "logit, sequence")
    pad_to_multiple_of: int = _like(SFTConfig, "pad_to_multiple_of", "logit, sequence")
    logit_chunk: int = _like(SFTConfig, "logit_chunk", "logit, on_policy")
    # on_policy
    prompts_per_step: int = _like(RLConfig, "prompts_per_step", "on_policy")
    group_size: int = _like(RLConfig, "group_size", "on_policy")
    micro_batch_tokens: int = _like(RLConfig, "micro_batch_tokens", "on_policy")
    rl_weight: float = Field(0.0, ge=0, le=1, description="on_policy: loss = (1 − w)·divergence + w·(the RL loss of `reward`) (GKD §3.2)")
    algo: str = Field("grpo", description="on_policy with rl_weight > 0: the RL algorithm of the reward term (posttrain rl presets)")
    reward: str = Field("", description="on_policy: the RL reward (logged; trained with rl_weight > 0); sequence: the verifier that filters teacher samples; empty: none")
    reward_args: dict = _like(RLConfig, "reward_args", "on_policy, sequence")
    mask_truncated: bool = _like(RLConfig, "mask_truncated", "on_policy")
    samples_per_log: int = _like(RLConfig, "samples_per_log", "on_policy")
    alarms: AlarmSettings = _like(RLConfig, "alarms", "on_policy")
    eval: EvalSettings = _like(RLConfig, "eval", "on_policy")
    # sampling (on_policy: the student; sequence: the teacher)
    sampling: SamplingSettings = _like(RLConfig, "sampling", "on_policy (student), sequence (teacher)")
    engine: EngineConfig = _like(RLConfig, "engine", "on_policy, sequence")
    # sequence
    n: int = _like(RSConfig, "n", "sequence")
    keep: str = Field("all", pattern="^(all|best|above)$", description="sequence: all (every finished sample) | best (best of n by `reward`) | above (every sample >= threshold)")
    threshold: float | None = _like(RSConfig, "threshold", "sequence")
    keep_truncated: bool = _like(RSConfig, "keep_truncated", "sequence")
    epochs: float = _like(RSConfig, "epochs", "sequence")

    # key -> the modes that read it (every other key: all three); set away from its default under another mode, a
    # key is refused (posttrain.config.unused_key), with why where it is not obvious
    KEY_MODES: ClassVar[dict[str, tuple[str, ...]]] = {
        **dict.fromkeys(("top_k", "cache_dtype", "cache_dir", "teacher_batch_tokens", "ce_weight"), ("logit",)),
        **dict.fromkeys(("prompts_per_step", "group_size", "micro_batch_tokens", "rl_weight", "algo", "mask_truncated",
                         "samples_per_log", "alarms", "eval"), ("on_policy",)),
        **dict.fromkeys(("n", "keep", "threshold", "keep_truncated", "epochs"), ("sequence",)),
        **dict.fromkeys(("reward", "reward_args", "sampling", "engine"), ("on_policy", "sequence")),
        **dict.fromkeys(("temperature", "logit_chunk"), ("logit", "on_policy")),
        **dict.fromkeys(("batch_size", "micro_batch_size", "max_length", "too_long", "packing", "pad_to_multiple_of"),
                        ("logit", "sequence")),
    }
    WHY: ClassVar[dict[str, str]] = {
        "reward": " (logit mode learns the teacher's log-probs of the data: no sample is drawn to score)",
        "reward_args": " (logit mode has no reward)", "sampling": " (logit mode samples nothing)",
        "engine": " (logit mode samples nothing)",
    }

    @model_validator(mode="after")
    def _check(self):
        if not self.teacher:
            raise ValueError("teacher: name the teacher model (a folder, built-in name or Hub id)")
        refused = unused_key(self, {k: (lambda c, m=modes: c.mode in m, "mode=" + " | ".join(modes) + self.WHY.get(k, ""))
                                    for k, modes in self.KEY_MODES.items()})
        if refused:
            raise ValueError(refused)
        if self.mode != "sequence":
            distill_losses.get(self.resolved_divergence)
        elif self.divergence is not None:
            raise ValueError("divergence: mode=sequence trains with the SFT loss on teacher text (no divergence)")
        rl_preset(self.algo)
        if self.rl_weight > 0 and not self.reward:
            raise ValueError("rl_weight > 0 needs a reward (reward=math, ...)")
        if self.mode == "sequence" and self.keep != "all" and not self.reward:
            raise ValueError(f"keep={self.keep} ranks teacher samples by a reward: give reward=...")
        if self.keep == "above" and self.threshold is None:
            raise ValueError("keep=above needs a threshold (e.g. threshold=1 for a pass/fail verifier)")
        if self.mode == "on_policy" and self.sampling.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 for on_policy (the student samples)")
        return self

    @property
    def resolved_divergence(self) -> str:
        return self.divergence or DEFAULT_DIVERGENCE[self.mode]

    @property
    def divergence_args(self) -> dict:
        return {"beta": self.beta} if self.resolved_divergence == "jsd" else {}


def sft_settings(cfg: DistillConfig, **update) -> SFTConfig:
    """The SFT recipe's config for the student (logit mode's data, sequence mode's training): every field the
    two configs share (training/settings.py), no held-out split, probe or samples, then `update`. `epochs` is
    rejection sampling's (sequence mode: over the kept rows), not the SFT recipe's: left out."""
    return derive(cfg, SFTConfig, exclude=("epochs",), eval_fraction=0.0, forgetting_probe=False, sample_every=0, **update)
