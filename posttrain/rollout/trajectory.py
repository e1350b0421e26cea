"""Typed records between the phases of an RL step: `Trajectory` (one sampled episode) and `RLBatch`
(what the trainer's forward and loss read).

A trajectory is a prompt plus a response. The response holds every token after the prompt; the
policy generated those inside `loss_spans` (loss mask 1) and the rest came from elsewhere (a tool's
output in a multi-turn episode: loss mask 0, or the model learns to invent tool outputs). Single-turn
RL has one span covering the whole response.

`make_batches` lays a step's trajectories out for the trainer with the group's prompt computed once:
a micro-batch is one row of blocks `[prompt][completion 1]…[completion n]` where each completion
attends to its prompt and itself (ops.attention layout), so a group of G samples costs P + Σ C_i
token-forwards instead of G·P + Σ C_i (for single-digit addition on SmolLM2, P ≈ 40, C ≈ 4: ~6×
fewer). Logits are computed only where a loss token is predicted (`hidden_index`); the loss side is a
per-sample (S, L) layout independent of the packing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.ops.attention import Layout


@dataclass(eq=False)
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]  # everything after the prompt (generated tokens, tool outputs in multi-turn)
    behaviour_logp: torch.Tensor  # (n_loss,) fp32: log-probs of the loss tokens under the sampling distribution
    group: int  # samples of one prompt share it (the baseline's group)
    loss_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of response_ids; [] = all
    kept: torch.Tensor | None = None  # (n_loss,) long: kept-set size of a truncated (top-k/p) distribution, 0 = none
    policy_version: int = 0  # optimizer steps taken by the policy that sampled it
    finish_reason: str = "stop"
    text: str = ""
    reward: float | None = None  # None: the reward does not apply -> left out of baseline, filter and loss
    valid: bool = True  # False: no loss (reward None, or truncated with mask_truncated)
    advantage: float = 0.0

    def __post_init__(self):
        if not self.loss_spans:
            self.loss_spans = [(0, len(self.response_ids))]
        if int(self.behaviour_logp.numel()) != self.num_loss_tokens:
            raise ValueError(f"{self.behaviour_logp.numel()} behaviour log-probs for {self.num_loss_tokens} loss tokens")

    @property
    def num_loss_tokens(self) -> int:
        return sum(e - s for s, e in self.loss_spans)

    def loss_positions(self) -> list[int]:
        """Indices into response_ids of the tokens that carry loss, in order."""
        return [j for s, e in self.loss_spans for j in range(s, e)]


@dataclass(eq=False)
class RLBatch:
    """One micro-batch. Forward side: a single packed row (B = 1); loss side: (S, L) per sample."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T): prompt 0..P-1, each completion continues at P
    layout: Layout  # shared-prefix blocks of the row (ops.attention)
    hidden_index: torch.Tensor  # (M,) long: the position whose hidden state predicts each loss token
    last_index: torch.Tensor  # (S,) long: each sample's last token (its state is "after the response": PPO's bootstrap)
    targets: torch.Tensor  # (M,) long: the loss tokens, in trajectory order
    kept: torch.Tensor | None  # (M,) long kept-set sizes, None when no token came from a truncated distribution
    mask: torch.Tensor  # (S, L) bool: loss token present (M of them, row-major = the order of `targets`)
    valid: torch.Tensor  # (S,) bool: the sample carries loss
    behaviour_logp: torch.Tensor  # (S, L) fp32, 0 where mask is 0
    advantages: torch.Tensor  # (S,)
    trajectories: list[Trajectory]
    old_logp: torch.Tensor | None = None  # (S, L) the policy before this step's update (set at epoch 0)
    ref_logp: torch.Tensor | None = None  # (S, L) reference log-probs (β > 0)
    old_values: torch.Tensor | None = None  # (S, L) PPO: V(s_t) before the update
    bootstrap: torch.Tensor | None = None  # (S,) PPO: V after the last token
    returns: torch.Tensor | None = None  # (S, L) PPO: GAE returns (value targets)
    attention_mask: None = None  # the hidden_states() contract: attention is defined by `layout`
    row_tokens: None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """(S, L) bool: tokens that carry loss (mask and a valid sample)."""
        return self.mask & self.valid[:, None]

    def to(self, device) -> "RLBatch":
        for name in ("input_ids", "position_ids", "hidden_index", "last_index", "targets", "kept", "mask", "valid",
                     "behaviour_logp", "advantages", "old_logp", "ref_logp", "old_values", "bootstrap", "returns"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def spread(self, flat: torch.Tensor) -> torch.Tensor:
        """(M,) values in loss-token order -> (S, L), 0 where mask is 0."""
        return torch.zeros(self.mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(self.mask, flat)


def _groups(trajs: list[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories by group, in first-seen order; a group's samples must share the prompt."""
    by: dict[int, list[Trajectory]] = {}
    for t in trajs:
        by.setdefault(t.group, []).append(t)
        if t.prompt_ids != by[t.group][0].prompt_ids:
            raise ValueError(f"group {t.group} mixes prompts")
    return list(by.values())


def make_batches(trajs: list[Trajectory], pad_id: int, token_budget: int, pad_to_multiple_of: int = 64,
                 device="cpu") -> list[RLBatch]:
    """Micro-batches of whole groups, each at most `token_budget` tokens (a larger group runs alone)."""
    out, current, used = [], [], 0
    for g in _groups(trajs):
        size = len(g[0].prompt_ids) + sum(len(t.response_ids) for t in g)
        if current and used + size > token_budget:
            out.append(_build(current, pad_id, pad_to_multiple_of).to(device))
            current, used = [], 0
        current.append(g)
        used += size
    if current:
        out.append(_build(current, pad_id, pad_to_multiple_of).to(device))
    return out


def split_inert(b: RLBatch, pad_id: int, pad_to_multiple_of: int = 64) -> tuple[RLBatch | None, RLBatch | None]:
    """(live, inert): b's groups apart by whether any sample carries loss with a nonzero advantage, as the loss sees
    it (`valid`, float32 `advantages`). Under a loss linear in A an inert group adds exactly 0 to the gradient.
    Each side is rebuilt as its own packed row (groups in b's order); b itself, and None, when nothing splits."""
    live_sample = (b.valid & (b.advantages != 0)).tolist()
    live, inert, i = [], [], 0
    for g in _groups(b.trajectories):  # b.trajectories lists the samples group by group (`_build`)
        (live if any(live_sample[i:i + len(g)]) else inert).append(g)
        i += len(g)
    if not inert or not live:
        return (b, None) if live else (None, b)
    device = b.input_ids.device
    return _build(live, pad_id, pad_to_multiple_of).to(device), _build(inert, pad_id, pad_to_multiple_of).to(device)


def _build(groups: list[list[Trajectory]], pad_id: int, multiple: int) -> RLBatch:
    ids, pos, blocks, hidden, targets, last = [], [], [], [], [], []
    for g in groups:
        P = len(g[0].prompt_ids)
        last_prompt = len(ids) + P - 1  # its hidden state predicts every completion's first token
        ids += g[0].prompt_ids
        pos += range(P)
        for t in g:
            start = len(ids)
            ids += t.response_ids
            pos += range(P, P + len(t.response_ids))
            hidden += [last_prompt if j == 0 else start + j - 1 for j in t.loss_positions()]
            targets += [t.response_ids[j] for j in t.loss_positions()]
            last.append(len(ids) - 1)  # the last response token (a completion has at least one)
        blocks.append((P, tuple(len(t.response_ids) for t in g)))
    pad = -len(ids) % multiple
    if pad:
        blocks.append((pad, ()))  # padding attends only to itself
        ids += [pad_id] * pad
        pos += range(pad)
    trajs = [t for g in groups for t in g]
    S, L = len(trajs), max(t.num_loss_tokens for t in trajs)
    mask = torch.arange(L)[None, :] < torch.tensor([t.num_loss_tokens for t in trajs])[:, None]  # (S, L)
    any_kept = any(t.kept is not None for t in trajs)
    kept = torch.cat([t.kept if t.kept is not None else torch.zeros(t.num_loss_tokens, dtype=torch.long)
                      for t in trajs]) if any_kept else None
    behaviour = torch.zeros(S, L).masked_scatter(mask, torch.cat([t.behaviour_logp.float() for t in trajs]))
    return RLBatch(
        input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([pos], dtype=torch.long),
        layout=(tuple(blocks),), hidden_index=torch.tensor(hidden, dtype=torch.long),
        last_index=torch.tensor(last, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long), kept=kept, mask=mask,
        valid=torch.tensor([t.valid for t in trajs]), behaviour_logp=behaviour,
        advantages=torch.tensor([t.advantage for t in trajs], dtype=torch.float32), trajectories=trajs,
    )
