"""Sequence log-probs for preference training, and the reference log-probs computed once per sequence.

    logps = sequence_logps(model, batch)                   # (S,) one packed forward (prompt once)
    cache = ReferenceCache()
    cache.fill(model, entries, ...)                        # before the first update: π_ref = π_θ(step 0)
    ref_chosen = cache.get([("train", i, 0) for i in ids]) # (B,)

The reference policy of DPO is the model as it was before training. Computing its log-probs once per
sequence, before the first optimizer step, needs no second model: under full fine-tuning the policy
*is* the reference until it is updated; under LoRA the reference is the base model, i.e. the policy
with its adapter disabled (peft `disable_adapter()`), at any time. `computed` counts how many times
each key was scored (always 1: `fill` skips keys it has), and the cache is saved in the run directory
so a resumed run reuses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import Counter
from pathlib import Path

import torch

from posttrain.data.prefix_batch import Group, PrefixBatch, micro_batches
from posttrain.models.forward import backbone_and_head, hidden_states
from posttrain.systems.fsdp import apply

Key = tuple  # e.g. ("train", example index, continuation index) or ("kl", prompt index, completion index)


def sequence_logps(model, batch: PrefixBatch, mixed_precision: str = "none") -> torch.Tensor:
    """(S,) Σ_t log π(y_t | x, y_<t) over each sequence's loss tokens; chosen and rejected (and every
    other continuation of the row) in one forward, lm_head only where a loss token is predicted."""
    _, head = backbone_and_head(model)
    h = hidden_states(model, batch, mixed_precision, layout=batch.layout, tie=head.tie)  # (1, T, H)
    h = h.reshape(-1, h.shape[-1]).index_select(0, batch.hidden_index)  # (M, H)
    logp, _ = head.logprobs(h, batch.targets)  # (M,) the model's logit transform (soft-cap, scale) included
    return batch.sums(logp)


def reference_mode(model):
    """The context in which `model` computes the reference: the adapter disabled under LoRA (PEFT);
    nothing otherwise (valid only before the first update: the caller's responsibility)."""
    if hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):
        return model.disable_adapter()
    return contextlib.nullcontext()


def fingerprint(groups: list[Group]) -> str:
    """A hash of the token ids: a saved cache is reused only for the same tokenized data."""
    h = hashlib.sha256()
    for prompt, conts in groups:
        h.update(json.dumps([prompt, [c.input_ids for c in conts], [c.loss_mask for c in conts]]).encode())
    return h.hexdigest()[:16]


class ReferenceCache:
    def __init__(self):
        self.values: dict[Key, float] = {}
        self.computed: Counter = Counter()  # key -> times its reference log-prob was computed
        self.seconds = 0.0

    def missing(self, entries: list[tuple[list[Key], Group]]) -> list[tuple[list[Key], Group]]:
        return [(keys, g) for keys, g in entries if any(k not in self.values for k in keys)]

    @torch.no_grad()
    def fill(self, model, entries: list[tuple[list[Key], Group]], pad_id: int, token_budget: int,
             mixed_precision: str = "none", pad_to_multiple_of: int = 64) -> int:
        """Score the continuations of `entries` whose keys are not cached yet; returns how many."""
        import time

        todo = self.missing(entries)
        if not todo:
            return 0
        t0 = time.perf_counter()
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with reference_mode(model):
                for batch, idx in micro_batches([g for _, g in todo], pad_id, token_budget, pad_to_multiple_of, device):
                    logps = apply(model, sequence_logps, batch, mixed_precision).tolist()
                    keys = [k for j in idx for k in todo[j][0]]
                    for k, v in zip(keys, logps, strict=True):
                        self.values[k] = v
                        self.computed[k] += 1
        finally:
            model.train(was_training)
        self.seconds += time.perf_counter() - t0
        return sum(len(k) for k, _ in todo)

    def get(self, keys: list[Key], device=None) -> torch.Tensor:
        return torch.tensor([self.values[k] for k in keys], dtype=torch.float32, device=device)

    def stats(self) -> dict:
        counts = list(self.computed.values())
        return {"reference/sequences": len(self.values), "reference/computations": sum(counts),
                "reference/max_per_sequence": max(counts, default=0), "reference/seconds": self.seconds}

    # ------------------------------------------------------------ persistence
    def save(self, path: Path, fp: str) -> None:
        data = {"fingerprint": fp, "seconds": self.seconds,
                "entries": [[list(k), v, self.computed[k]] for k, v in self.values.items()]}
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)

    def load(self, path: Path, fp: str) -> bool:
        """Read a saved cache of the same data (fingerprint); False when absent or of other data."""
        path = Path(path)
        if not path.is_file():
            return False
        data = json.loads(path.read_text())
        if data.get("fingerprint") != fp:
            return False
        for key, value, count in data["entries"]:
            self.values[tuple(key)] = value
            self.computed[tuple(key)] = count
        self.seconds = data.get("seconds", 0.0)
        return True
