"""A trained reward model as a reward: `reward=rm:runs/rm/final` (weights and compositions as for any
reward: `rm:runs/rm/final:1.0,format:0.2`; options `reward_args={"rm:runs/rm/final": {device: cuda}}`).

    score = RewardModelScorer("runs/rm/final")
    score(prompts, completions) -> [r_1, ...]     # TRL's reward signature

The folder is checked when the reward is named (before any model loads); the model loads on the first
call, on `device` ('auto': the GPU when one is visible, as the recipes' default device). Samples are
rendered as the RM was trained, by `posttrain rm` or by TRL's RewardTrainer: prompt + completion (a
plain-string completion after a conversational prompt is one assistant turn) through the chat template
whole, and the score read at the last token that is not the config's pad token, exactly where
`AutoModelForSequenceClassification` reads it on `apply_chat_template(...)` (data/preference.py scored_ids).
They are scored in packed batches: consecutive samples of the same prompt (a GRPO group) share one prompt
forward, at most `batch_tokens` tokens per forward, no gradients.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.data.preference import render_scored
from posttrain.data.prefix_batch import micro_batches
from posttrain.errors import UserError
from posttrain.models.device import resolve_device
from posttrain.models.loading import load_tokenizer
from posttrain.models.reward_head import is_reward_model, load_reward_model, sequence_rewards
from posttrain.rewards.base import RewardSpec

PREFIX = "rm:"


class RewardModelScorer:
    def __init__(self, path: str, device: str = "auto", batch_tokens: int = 8192, mixed_precision: str = "none",
                 dtype: str = "float32"):
        if not Path(path).is_dir():
            raise UserError(f"reward model folder not found: {path} (train one with `posttrain rm`)")
        if not is_reward_model(path):
            raise UserError(f"{path} is not a reward model folder (its config.json is no *ForSequenceClassification "
                            "with one label; `posttrain rm` saves one in output_dir/final)")
        self.path, self.device, self.batch_tokens = str(path), device, int(batch_tokens)
        self.mixed_precision, self.dtype = mixed_precision, dtype
        self.__name__ = PREFIX + self.path
        self.model = self.tok = None
        self.last_metrics: dict = {}

    def load(self) -> None:
        self.tok = load_tokenizer(self.path)
        self.model = load_reward_model(self.path, dtype=self.dtype, device=resolve_device(self.device)).eval()
        self.model.requires_grad_(False)

    def groups(self, prompts: list, completions: list) -> tuple[list, list[list[int]]]:
        """Prompt groups (consecutive equal prompts) for prefix_batch, and the sample indices of each."""
        runs: list[list[int]] = []
        for i, p in enumerate(prompts):
            if runs and prompts[runs[-1][0]] == p:
                runs[-1].append(i)
            else:
                runs.append([i])
        groups = []
        for idx in runs:
            prompt_ids, conts = render_scored(self.tok, prompts[idx[0]], [completions[i] for i in idx])
            groups.append((prompt_ids, conts))
        return groups, runs

    @torch.no_grad()
    def __call__(self, prompts, completions, **columns) -> list[float]:
        if prompts is None or any(p is None for p in prompts):
            raise UserError(f"reward '{self.__name__}' scores prompt + completion: the data needs a `prompt` column")
        if self.model is None:
            self.load()
        groups, runs = self.groups(list(prompts), list(completions))
        device = next(self.model.parameters()).device
        pad = self.model.config.pad_token_id  # transformers finds the scored token with the config's pad id
        pad = self.tok.pad_token_id if pad is None else pad
        out: list[float] = [0.0] * len(completions)
        for batch, idx in micro_batches(groups, pad, self.batch_tokens, 64, device):
            rewards = sequence_rewards(self.model, batch, self.mixed_precision).tolist()
            samples = [i for j in idx for i in runs[j]]
            for i, r in zip(samples, rewards, strict=True):
                out[i] = r
        return out


def is_reward_model_ref(name: str) -> bool:
    return name.startswith(PREFIX)


def split_weight(part: str) -> tuple[str, str]:
    """'rm:runs/rm/final:0.5' -> ('rm:runs/rm/final', '0.5'); no weight -> (part, '')."""
    path, sep, tail = part[len(PREFIX):].rpartition(":")
    if sep:
        try:
            float(tail)
            return PREFIX + path, tail
        except ValueError:
            pass
    return part, ""


_SPECS: dict = {}


def reward_model_spec(name: str):
    """The RewardSpec of 'rm:PATH' (one per path; the folder is checked now, the model loads when first called)."""
    path = name[len(PREFIX):]
    if not path:
        raise UserError("reward 'rm:' needs the reward model's folder: rm:runs/rm/final")
    if name not in _SPECS:
        _SPECS[name] = RewardSpec(name, RewardModelScorer(path), (), f"reward model {path}",
                                  factory=lambda **options: RewardModelScorer(path, **options))
    return _SPECS[name]
