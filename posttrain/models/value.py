"""The value model of PPO: a causal LM's backbone with a scalar head, V(s_t) read from the hidden
state at position t (the state before the token that position predicts).

Initialised from the policy (a copy of its weights and a small random head: a zero head passes no
gradient to the backbone, which then learns only the mean return for many steps) or from a reward model folder saved by `AutoModelForSequenceClassification`
(InstructGPT initialises the value function from the RM). Saved with `save_pretrained` next to the
policy as `final/value/` in the sequence-classification layout, so it loads back either way.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from posttrain.models.forward import hidden_states, unwrap
from posttrain.ops.attention import install


class ValueModel(nn.Module):
    def __init__(self, lm: nn.Module, head: nn.Linear):
        super().__init__()
        self.lm = lm  # a CausalLM whose lm_head is never used (kept so hidden_states() and save_pretrained work)
        self.score = head  # (H -> 1)

    @property
    def config(self):
        return unwrap(self.lm).config

    def values(self, batch, mixed_precision: str, index: torch.Tensor) -> torch.Tensor:
        """V at the flat positions `index` (M,) of the batch's single packed row -> (M,) fp32."""
        h = hidden_states(self.lm, batch, mixed_precision, layout=getattr(batch, "layout", None))  # (1, T, H)
        h = h.reshape(-1, h.shape[-1]).index_select(0, index)
        with torch.autocast(h.device.type, enabled=False):
            return self.score(h.to(self.score.weight.dtype)).squeeze(-1).float()

    def save_pretrained(self, path: Path, state: dict | None = None) -> None:
        """Sequence-classification layout: `AutoModelForSequenceClassification.from_pretrained(path)` loads it.
        `state`: parameter name -> full tensor (a sharded value model's weights, gathered)."""
        from transformers import AutoModelForSequenceClassification

        cfg = copy.deepcopy(self.config)
        cfg.num_labels = 1
        clf = AutoModelForSequenceClassification.from_config(cfg)
        prefix = clf.base_model_prefix
        if state is None:
            getattr(clf, prefix).load_state_dict(getattr(unwrap(self.lm), prefix).state_dict())
            clf.score.weight.data.copy_(self.score.weight.data)
        else:
            head = f"lm.{prefix}."
            backbone = {k[len(head):]: v for k, v in state.items() if k.startswith(head)}
            missing = set(dict(getattr(clf, prefix).named_parameters())) - set(backbone)
            if missing:
                raise KeyError(f"value model state lacks {sorted(missing)[:3]}")
            getattr(clf, prefix).load_state_dict(backbone, strict=False)  # buffers (rotary) come from the config
            clf.score.weight.data.copy_(state["score.weight"])
        clf.save_pretrained(path)


def value_model_from_policy(policy: nn.Module) -> ValueModel:
    lm = copy.deepcopy(unwrap(policy)).train().requires_grad_(True)
    hidden = lm.config.hidden_size
    head = nn.Linear(hidden, 1, bias=False, device=next(lm.parameters()).device, dtype=torch.float32)
    nn.init.normal_(head.weight, std=hidden ** -0.5)  # small, not zero: the backbone gets a gradient from step 1
    return ValueModel(lm, head)  # the unused lm_head gets no gradient (tied to the embeddings in many models)


def check_value_model(path: str) -> None:
    """`value_model=` names a reward-model folder (a *ForSequenceClassification with one output, the final/ of
    `posttrain rm`): checked from its config.json when the config is read, so a typo or a policy folder fails at
    once (transformers would try the Hub with a typo, and give a policy a random two-label head). ValueError."""
    from posttrain.models.reward_head import is_reward_model

    folder = Path(path)
    what = "a reward model folder (the final/ of `posttrain rm`); leave value_model empty for a copy of the policy with a zero value head"
    if not folder.is_dir():
        raise ValueError(f"value_model={path}: no such folder: give {what}")
    if not (folder / "config.json").is_file():
        raise ValueError(f"value_model={path}: no config.json in the folder: give {what}")
    if not is_reward_model(folder):
        raise ValueError(f"value_model={path}: not a reward model (its config.json is not a *ForSequenceClassification "
                         f"with one output; a policy folder?): give {what}")


def value_model_from_reward_model(path: str, device, dtype=torch.float32) -> ValueModel:
    """From a folder saved by `AutoModelForSequenceClassification` (num_labels = 1): backbone + score head."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    clf = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    if clf.config.num_labels != 1:
        raise ValueError(f"{path}: a reward model has one output (num_labels=1), this one has {clf.config.num_labels}")
    lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    prefix = lm.base_model_prefix
    getattr(lm, prefix).load_state_dict(getattr(clf, prefix).state_dict())
    lm.set_attn_implementation(install())
    head = nn.Linear(clf.score.in_features, 1, bias=False, dtype=torch.float32)
    head.weight.data.copy_(clf.score.weight.data.float())
    return ValueModel(lm.to(device).train(), head.to(device))
