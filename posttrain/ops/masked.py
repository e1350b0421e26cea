"""Masked reductions. Masks are 0/1 (or bool) tensors of the same shape as the values."""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() if dim is None else (values * m).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None, eps: float = 0.0) -> torch.Tensor:
    """Σ v·m / Σ m (over `dim`, or everything). With eps=0 an all-zero mask gives nan, on purpose."""
    m = mask.to(values.dtype)
    den = m.sum() if dim is None else m.sum(dim)
    return masked_sum(values, m, dim) / (den + eps)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(values, mask)
    m = mask.to(values.dtype)
    n = m.sum()
    var = masked_sum((values - mean) ** 2, m) / n
    return var * n / (n - 1) if unbiased else var
