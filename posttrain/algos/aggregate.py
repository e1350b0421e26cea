"""Loss aggregation: the one place that turns a per-token loss (B, T) into the scalar to backprop.

    token_mean               Σ_i Σ_t ℓ_it m_it / N_tok                      (DAPO §3.3; also PPO)
    seq_mean_token_mean      (1/S) Σ_i [ Σ_t ℓ_it m_it / Σ_t m_it ]          (original GRPO, eq. 3)
    seq_mean_token_sum_norm  (1/S) Σ_i [ Σ_t ℓ_it m_it / L_max ]             (Dr. GRPO: constant L_max)

N_tok = number of loss tokens, S = number of sequences (rows with at least one loss token).

Global normalisers. With gradient accumulation or data parallelism the step's batch is split in
micro-batches. Pass the *global* counts (`norm_tokens` = loss tokens in the whole global batch,
`num_sequences` = sequences in the whole global batch, the same constant `max_len` everywhere) and
each micro-batch's aggregate is its exact share: Σ_micro aggregate(micro) == aggregate(global
batch), for every mode, so the accumulated gradient equals one big batch's. (Averaging per-micro-
batch token means instead weights tokens of short micro-batches more.) Under DDP, whose all-reduce
*averages* gradients over `world_size` ranks, multiply the local aggregate by world_size (or use a
sum all-reduce). Without them the local counts are used (correct for a single micro-batch).
A sequence whose row has no loss token contributes 0 and is not counted in S; a (micro-)batch with
no loss token at all aggregates to 0 (local normalisers are clamped at 1), not NaN.
"""

from __future__ import annotations

import torch

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def loss_token_count(mask: torch.Tensor) -> torch.Tensor:
    """N_tok: number of loss tokens (sum these over micro-batches for `norm_tokens`)."""
    return mask.to(torch.float32).sum()


def sequence_count(mask: torch.Tensor) -> torch.Tensor:
    """S: rows with at least one loss token (sum over micro-batches for `num_sequences`)."""
    return (mask.to(torch.float32).sum(-1) > 0).to(torch.float32).sum()


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", norm_tokens=None,
              max_len: int | None = None, num_sequences=None) -> torch.Tensor:
    """loss (B, T), mask (B, T) -> scalar. See the module docstring for the formulas and for the
    global normalisers `norm_tokens` (token_mean) and `num_sequences` (both seq modes).
    `max_len` (seq_mean_token_sum_norm) defaults to T = loss.shape[-1], which differs between
    micro-batches padded to different lengths: pass the generation limit for exactness."""
    if loss.shape != mask.shape or loss.dim() != 2:
        raise ValueError(f"aggregate expects loss and mask of one (B, T) shape; got {tuple(loss.shape)}, {tuple(mask.shape)}")
    m = mask.to(loss.dtype)
    keep = mask.bool()
    per_tok = torch.where(keep, loss, torch.zeros_like(loss))  # (B, T), masked garbage cannot leak
    if mode == "token_mean":
        den = m.sum().clamp(min=1) if norm_tokens is None else norm_tokens
        return per_tok.sum() / den
    seq_sum = per_tok.sum(-1)  # (B,)  Σ_t ℓ_it m_it
    s = (m.sum(-1) > 0).to(loss.dtype).sum().clamp(min=1) if num_sequences is None else num_sequences
    if mode == "seq_mean_token_mean":
        seq = seq_sum / m.sum(-1).clamp(min=1)  # (B,)  per-sequence token mean (0 for empty rows)
        return seq.sum() / s
    if mode == "seq_mean_token_sum_norm":
        L = loss.shape[-1] if max_len is None else max_len
        return (seq_sum / L).sum() / s
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(MODES)}")
