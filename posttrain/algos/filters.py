"""Sampling filters on grouped rollouts (docs/algorithms.md). DAPO's overlong length shaping is a reward and
lives in posttrain/rewards/shaping.py.

- `dynamic_sampling` (DAPO, Yu et al. 2025 §3.2, eq. 11 constraint 0 < |{correct}| < G): drop groups
  whose rewards are all equal — their group-relative advantage is 0, so they only dilute the batch.
  The recipe keeps sampling until it has enough kept groups, with a cap on retries.
- `learnability_band`: keep groups (or prompts, from tracked pass rates) with low < p < high,
  default 0.2 < p < 0.8 (a curriculum of learnable prompts, docs/concepts.md; reward variance p(1−p) is largest there).

Both return a `FilterResult` of tensors: indices (K,) long of kept samples (sorted), kept_groups
(group ids kept), num_groups and num_kept (0-dim long) — counts for the health metrics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from posttrain.algos._groups import group_index, group_max, group_mean, group_min


class FilterResult(NamedTuple):
    indices: torch.Tensor  # (K,) long: kept sample indices into the batch
    kept_groups: torch.Tensor  # (G_kept,) the group ids that were kept
    num_groups: torch.Tensor  # () long
    num_kept: torch.Tensor  # () long: kept groups


def _result(group_ids, keep_group, inv):
    uniq = torch.unique(group_ids)  # sorted; matches inv's numbering
    keep_sample = keep_group[inv]  # (N,)
    return FilterResult(
        indices=keep_sample.nonzero().squeeze(-1),
        kept_groups=uniq[keep_group],
        num_groups=torch.tensor(uniq.numel(), dtype=torch.long, device=uniq.device),
        num_kept=keep_group.sum(),
    )


def dynamic_sampling(rewards: torch.Tensor, group_ids: torch.Tensor) -> FilterResult:
    """Keep the groups with max(r) > min(r). rewards (N,), group_ids (N,) long."""
    inv, counts = group_index(group_ids)
    g = counts.numel()
    r = rewards.detach()
    keep_group = group_max(r, inv, g) > group_min(r, inv, g)  # (G,)
    return _result(group_ids, keep_group, inv)


def learnability_band(rewards: torch.Tensor, group_ids: torch.Tensor, *, low: float = 0.2, high: float = 0.8,
                      pass_threshold: float = 0.5) -> FilterResult:
    """Keep groups whose pass rate p = mean(r > pass_threshold) satisfies low < p < high."""
    inv, counts = group_index(group_ids)
    p = group_mean((rewards.detach() > pass_threshold).float(), inv, counts)  # (G,)
    return _result(group_ids, in_band(p, low=low, high=high), inv)


def in_band(pass_rates: torch.Tensor, *, low: float = 0.2, high: float = 0.8) -> torch.Tensor:
    """Per-prompt curriculum test on tracked pass rates (P,) -> bool (P,): low < p < high."""
    if not 0.0 <= low < high <= 1.0:
        raise ValueError("learnability band needs 0 <= low < high <= 1")
    return (pass_rates > low) & (pass_rates < high)
