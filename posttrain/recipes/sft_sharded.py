"""SFT under `torchrun --nproc-per-node W -m posttrain sft …`, FSDP2-sharded (posttrain/systems/fsdp.py):
each rank backpropagates its share of the step's micro-batches (posttrain/systems/dist.py: rank_share,
weight-0 padding) with the loss-token count summed over ranks once, so W ranks take the step one process
takes on the same global batch, up to summation order (recipes/sft.py::accumulate_gradients).
"""

from __future__ import annotations

import torch

from posttrain.models.forward import token_logprobs
from posttrain.systems.dist import DistInfo, global_sum, rank_share
from posttrain.training.optim import optimizer_step


def sft_backward(step_model, local: list[tuple[object, float]], n_global: int, chunk: int = 1024,
                 mixed_precision: str = "none") -> torch.Tensor:
    """Backward of this rank's share of  −Σ log p / N_global  (recipes/sft.py::accumulate_gradients with
    the step's loss-token count summed over ranks). Returns the share of the loss (detached)."""
    total = 0.0
    for b, w in local:
        logp, _ = step_model(token_logprobs, b, chunk=chunk, mixed_precision=mixed_precision)
        loss = -logp.sum() / n_global * w
        (loss * step_model.loss_scale).backward()
        total += float(loss.detach())
    return torch.tensor(total)


@torch.no_grad()
def mean_nll(step_model, batches: list, info: DistInfo, chunk: int = 1024, mixed_precision: str = "none") -> float:
    """Mean negative log-likelihood per loss token over the global list of batches (every rank runs the
    same number of forwards; the sums are reduced once)."""
    total = count = 0.0
    for b, w in rank_share(batches, info):
        logp, _ = step_model(token_logprobs, b, chunk=chunk, mixed_precision=mixed_precision)
        total, count = total - w * float(logp.sum()), count + w * logp.numel()
    total, count = global_sum([total, count], info)
    return total / max(count, 1.0)


def sft_step(step_model, optimizer, batches: list, info: DistInfo, max_grad_norm: float = 1.0, chunk: int = 1024,
             mixed_precision: str = "none") -> dict:
    """One SFT optimizer step over the global list of micro-batches; every rank returns the same metrics."""
    local = rank_share(batches, info)
    n_local = sum(b.num_loss_tokens for b, w in local if w)
    (n_global,) = global_sum([n_local], info)  # the one reduction of the normaliser
    loss = sft_backward(step_model, local, int(n_global), chunk, mixed_precision)
    grad_norm = optimizer_step(step_model, optimizer, max_grad_norm)
    (loss_sum,) = global_sum([float(loss)], info)  # for the log only
    return {"loss": loss_sum, "grad_norm": float(grad_norm), "loss_tokens": int(n_global)}
