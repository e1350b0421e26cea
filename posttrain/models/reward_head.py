"""A reward model: a causal LM's backbone with a scalar head, as transformers' *ForSequenceClassification.

    model = load_reward_model("smollm2-135m-instruct", pad_token_id=tok.pad_token_id)   # new head
    model = load_reward_model("runs/rm/final")                                            # trained RM
    r = sequence_rewards(model, batch)                       # (S,) one scalar per sequence

The model is `AutoModelForSequenceClassification` with `num_labels=1` and the tokenizer's pad id in its
config (LlamaForSequenceClassification, Qwen2ForSequenceClassification, ...), so a saved run's
`final/` loads with `AutoModelForSequenceClassification.from_pretrained` and scores like this module:
the reward is the head applied to the final hidden state of the sequence's *last non-pad token*
(transformers' rule). The sequences are the chat template's whole rendering (data/preference.py
scored_ids, as TRL's RewardTrainer tokenizes), so in ChatML that token is the newline after the closing
`<|im_end|>`, the token `AutoModelForSequenceClassification` scores on `apply_chat_template(...)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from posttrain.errors import UserError
from posttrain.models.forward import hidden_states, unwrap
from posttrain.models.loading import load_model, resolve, to_dtype
from posttrain.ops.attention import install


def is_reward_model(path: str | Path) -> bool:
    """True for a folder whose config.json is a *ForSequenceClassification with one label."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    data = json.loads(cfg.read_text())
    archs = data.get("architectures") or []
    labels = data.get("num_labels", len(data.get("id2label") or {}) or None)
    return any(a.endswith("ForSequenceClassification") for a in archs) and labels in (1, None)


def _new_head(name: str, dtype: torch.dtype, seed: int, pad_token_id: int | None):
    """Backbone of the causal LM `name`, scalar head initialised with `seed`."""
    from transformers import AutoModelForSequenceClassification

    path = resolve(name)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if path is None:  # tiny random model: build it, then move its backbone under a fresh head
            lm = load_model(name, dtype=dtype, seed=seed, varlen_attention=False)
            cfg = lm.config
            cfg.num_labels, cfg.pad_token_id, cfg.architectures = 1, pad_token_id, None
            model = AutoModelForSequenceClassification.from_config(cfg, dtype=dtype)
            setattr(model, model.base_model_prefix, getattr(lm, lm.base_model_prefix))
            return model
        if not isinstance(path, str) and (Path(path) / "adapter_config.json").is_file():
            raise UserError(f"{path}: a LoRA adapter folder; merge it first (reward models train in full)")
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, pad_token_id=pad_token_id,
                                                                   dtype=dtype)
    finally:
        torch.random.set_rng_state(state)


def load_reward_model(name: str, dtype: str | torch.dtype = "float32", seed: int = 0, device=None,
                      pad_token_id: int | None = None, varlen_attention: bool = True):
    """A trained reward-model folder as it is, or any causal LM (folder, built-in, Hub id) with a new
    scalar head. `pad_token_id` is written into the config (transformers needs it to find the last token)."""
    from transformers import AutoModelForSequenceClassification

    dt = to_dtype(dtype)
    if Path(name).is_dir() and is_reward_model(name):
        model = AutoModelForSequenceClassification.from_pretrained(name, dtype=dt)
    else:
        model = _new_head(name, dt, seed, pad_token_id)
    if model.config.num_labels != 1:
        raise UserError(f"{name}: a reward model has one output, this one has num_labels={model.config.num_labels}")
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    if device is not None:
        model = model.to(device)
    if varlen_attention and getattr(model.config, "_attn_implementation", None) in (None, "sdpa", "eager"):
        model.set_attn_implementation(install())
    return model


def score_head(model) -> torch.nn.Linear:
    return unwrap(model).score


def sequence_rewards(model, batch, mixed_precision: str = "none") -> torch.Tensor:
    """(S,) fp32 rewards of a PrefixBatch: score(h at each sequence's last non-pad token)."""
    h = hidden_states(model, batch, mixed_precision, layout=batch.layout)  # (1, T, H)
    h = h.reshape(-1, h.shape[-1]).index_select(0, batch.last_index)  # (S, H)
    head = score_head(model)
    with torch.autocast(h.device.type, enabled=False):
        return head(h.to(head.weight.dtype)).squeeze(-1).float()
