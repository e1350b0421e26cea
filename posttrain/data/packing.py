"""Rows for the trainer: packing (no attention across samples) or padding, and collation.

Packed rows concatenate samples; position ids restart at 0 for every sample, which transformers
turns into a block-diagonal causal mask (no attention crosses a sample boundary). Targets are built
here, already shifted: targets[t] is the token the model must predict at position t, or -100.
The first token of every sample is never a target (it would be predicted from the previous sample).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from posttrain.data.templates import Tokenized

IGNORE = -100


def pack_groups(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: groups of sample indices whose lengths sum to <= capacity.

    Deterministic (ties broken by index); each group keeps its samples in index order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"sample {i} has {lengths[i]} tokens > capacity {capacity}")
        best = -1
        for b, room in enumerate(free):  # best fit: the fullest bin that still has room
            if room >= lengths[i] and (best < 0 or room < free[best]):
                best = b
        if best < 0:
            bins.append([i])
            free.append(capacity - lengths[i])
        else:
            bins[best].append(i)
            free[best] -= lengths[i]
    return [sorted(b) for b in bins]


@dataclass
class Batch:
    """One micro-batch. Shapes: (B, T)."""

    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T) restart at 0 per sample
    targets: torch.Tensor  # (B, T) next token to predict at each position, IGNORE where no loss
    attention_mask: torch.Tensor | None  # (B, T) 1 = real token; None when packed (positions define blocks)
    num_tokens: int  # real (non-pad) tokens
    num_padding: int  # pad tokens in the tensors
    row_tokens: list[int] | None = None  # real tokens at the start of each row (the rest is padding)

    @property
    def num_loss_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())

    def to(self, device: str | torch.device) -> Batch:
        """The same batch with every tensor on `device` (collate builds on the CPU); self if already there."""
        if self.input_ids.device == torch.device(device):
            return self
        mask = None if self.attention_mask is None else self.attention_mask.to(device, non_blocking=True)
        return replace(self, input_ids=self.input_ids.to(device, non_blocking=True), attention_mask=mask,
                       position_ids=self.position_ids.to(device, non_blocking=True),
                       targets=self.targets.to(device, non_blocking=True))


def _targets(sample: Tokenized) -> list[int]:
    ids, mask = sample.input_ids, sample.loss_mask
    return [ids[t + 1] if mask[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]


def collate(rows: list[list[Tokenized]], pad_id: int, packed: bool, pad_to_multiple_of: int = 1) -> Batch:
    """`rows[b]` is the list of samples laid end to end in row b (one sample per row when padding).

    The width is the longest row rounded up to `pad_to_multiple_of`: a handful of distinct shapes
    lets oneDNN reuse its JIT-compiled bf16 (AMX) matmul kernels instead of building new ones for
    every micro-batch. The tensors are built on the CPU: move them with `Batch.to(device)`."""
    width = max(sum(len(s) for s in row) for row in rows)
    width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    ids, pos, tgt, att, lengths = [], [], [], [], []
    real = 0
    for row in rows:
        r_ids, r_pos, r_tgt = [], [], []
        for s in row:
            r_ids += s.input_ids
            r_pos += list(range(len(s)))
            r_tgt += _targets(s)
        n = len(r_ids)
        real += n
        lengths.append(n)
        pad = width - n
        att.append([1] * n + [0] * pad)
        ids.append(r_ids + [pad_id] * pad)
        r_pos += list(range(pad))  # padding forms its own block: attends only to itself
        pos.append(r_pos)
        tgt.append(r_tgt + [IGNORE] * pad)
    total = width * len(rows)
    return Batch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        targets=torch.tensor(tgt, dtype=torch.long),
        attention_mask=None if packed else torch.tensor(att, dtype=torch.long),
        num_tokens=real,
        num_padding=total - real,
        row_tokens=lengths,
    )
