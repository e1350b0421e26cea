"""Vectorised per-group statistics for grouped rollouts (G samples per prompt share a group id).

Group ids may be any integers (not necessarily 0..G-1 or contiguous); `group_index` maps them to
dense indices. Everything is scatter/index_add based: no Python loop over groups or samples.
"""

from __future__ import annotations

import torch


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """group_ids (N,) long -> (inv (N,) in 0..G-1, counts (G,) long)."""
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D (N,), got shape {tuple(group_ids.shape)}")
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inv, counts


def group_sum(x: torch.Tensor, inv: torch.Tensor, num_groups: int) -> torch.Tensor:
    """x (N,) -> Σ_{i in g} x_i  (G,)."""
    return x.new_zeros(num_groups).index_add_(0, inv, x)


def group_mean(x: torch.Tensor, inv: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (N,) -> group means (G,)."""
    return group_sum(x, inv, counts.numel()) / counts.to(x.dtype)


def group_std(x: torch.Tensor, inv: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Unbiased std per group (G,) (torch.std semantics, as TRL/verl GRPO); a group of one has std 0."""
    mean = group_mean(x, inv, counts)
    sq = group_sum((x - mean[inv]) ** 2, inv, counts.numel())
    return (sq / (counts.to(x.dtype) - 1).clamp(min=1)).sqrt()


def group_max(x: torch.Tensor, inv: torch.Tensor, num_groups: int) -> torch.Tensor:
    return x.new_zeros(num_groups).scatter_reduce(0, inv, x, reduce="amax", include_self=False)


def group_min(x: torch.Tensor, inv: torch.Tensor, num_groups: int) -> torch.Tensor:
    return x.new_zeros(num_groups).scatter_reduce(0, inv, x, reduce="amin", include_self=False)
