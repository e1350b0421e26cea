"""Prompt once, continuations after: the trainer's layout for preference data (DPO, KTO, reward models).

A micro-batch is one packed row of blocks `[prompt][continuation 1]…[continuation n]`; each
continuation attends to its prompt and itself, never to a sibling (ops.attention shared-prefix
layout). A pair's chosen and rejected run in the same forward and its prompt is computed once:
P + C_w + C_l token-forwards instead of TRL's 2·(P + max C) padded ones.

Per sequence (a prompt + one continuation, numbered in block order):
    log-probs  the loss tokens' log-probs summed over the sequence (`sums`)
    reward     the hidden state at the sequence's last non-pad token (`last_index`), the token
               transformers' *ForSequenceClassification reads its score from
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.data.templates import Tokenized
from posttrain.ops.attention import Layout

Group = tuple[list[int], list[Tokenized]]  # (prompt ids, continuations)


@dataclass(eq=False)
class PrefixBatch:
    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T): prompt 0..P-1, each continuation continues at P
    layout: Layout  # shared-prefix blocks of the row
    hidden_index: torch.Tensor  # (M,) position whose hidden state predicts each loss token
    targets: torch.Tensor  # (M,) the loss tokens, sequence by sequence
    seq_index: torch.Tensor  # (M,) the sequence each loss token belongs to
    last_index: torch.Tensor  # (S,) position of each sequence's last non-pad token
    loss_tokens: torch.Tensor  # (S,) loss tokens per sequence (|y| of length-normalised losses)
    num_tokens: int  # real tokens (the prompt counted once)
    attention_mask: None = None  # the hidden_states() contract: attention is defined by `layout`
    row_tokens: None = None

    @property
    def num_sequences(self) -> int:
        return int(self.loss_tokens.numel())

    def to(self, device) -> "PrefixBatch":
        for name in ("input_ids", "position_ids", "hidden_index", "targets", "seq_index", "last_index", "loss_tokens"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def sums(self, flat: torch.Tensor) -> torch.Tensor:
        """(M,) per-token values -> (S,) per-sequence sums."""
        out = torch.zeros(self.num_sequences, dtype=flat.dtype, device=flat.device)
        return out.index_add(0, self.seq_index, flat)


def _last_non_pad(ids: list[int], start: int, prompt_last: int, prompt_ids: list[int], pad_id: int) -> int:
    for j in range(len(ids) - 1, -1, -1):
        if ids[j] != pad_id:
            return start + j
    for j in range(len(prompt_ids) - 1, -1, -1):
        if prompt_ids[j] != pad_id:
            return prompt_last - (len(prompt_ids) - 1 - j)
    return prompt_last


def build(groups: list[Group], pad_id: int, pad_to_multiple_of: int = 64) -> PrefixBatch:
    ids, pos, blocks, hidden, targets, seq, last, lengths = [], [], [], [], [], [], [], []
    for prompt_ids, conts in groups:
        P = len(prompt_ids)
        if P == 0:
            raise ValueError("a prompt of 0 tokens cannot predict its continuation's first token")
        prompt_last = len(ids) + P - 1
        ids += prompt_ids
        pos += range(P)
        for c in conts:
            start, s = len(ids), len(lengths)
            ids += c.input_ids
            pos += range(P, P + len(c))
            loss = [j for j, m in enumerate(c.loss_mask) if m]
            hidden += [prompt_last if j == 0 else start + j - 1 for j in loss]
            targets += [c.input_ids[j] for j in loss]
            seq += [s] * len(loss)
            last.append(_last_non_pad(c.input_ids, start, prompt_last, prompt_ids, pad_id))
            lengths.append(len(loss))
        blocks.append((P, tuple(len(c) for c in conts)))
    real = len(ids)
    pad = -real % pad_to_multiple_of
    if pad:
        blocks.append((pad, ()))  # padding attends only to itself
        ids += [pad_id] * pad
        pos += range(pad)
    long = lambda x: torch.tensor(x, dtype=torch.long)
    return PrefixBatch(long([ids]), long([pos]), (tuple(blocks),), long(hidden), long(targets), long(seq),
                       long(last), long(lengths), real)


def micro_batches(groups: list[Group], pad_id: int, token_budget: int, pad_to_multiple_of: int = 64,
                  device="cpu") -> list[tuple[PrefixBatch, list[int]]]:
    """Consecutive groups packed into rows of at most `token_budget` tokens (a larger group runs alone);
    each batch comes with the indices of its groups."""
    out, current, used = [], [], 0
    for i, (prompt_ids, conts) in enumerate(groups):
        size = len(prompt_ids) + sum(len(c) for c in conts)
        if current and used + size > token_budget:
            out.append((build([groups[j] for j in current], pad_id, pad_to_multiple_of).to(device), current))
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        out.append((build([groups[j] for j in current], pad_id, pad_to_multiple_of).to(device), current))
    return out
