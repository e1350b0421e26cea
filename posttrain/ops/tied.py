"""One gradient buffer for a tied embedding matrix (the input embeddings are the LM head's weight).

Autograd gives a tied weight W (V, H) two dense gradients and adds them:

    ∂L/∂W = (∂L/∂z)ᵀ·h                  the head's (ops.logprobs builds it in one (V, H) buffer)
          + Σ_t e_{x_t} ⊗ ∂L/∂emb_t      the lookup's: torch's embedding_dense_backward zeroes another (V, H)
                                          buffer, adds the T looked-up rows into it, and autograd adds the two

For SmolLM2 (49152 × 576, fp32) the second buffer is 113 MB to allocate, zero (fresh pages, faulted in: ~160 ms
of a GRPO step on a 2-core EPYC) and add; for Qwen2.5-0.5B (151936 × 896) 545 MB. With a `TiedGrad` the T rows
go straight into the head's buffer instead (index_add_): the same sum, no second buffer.

How: `TiedGrad.embed(ids)` is the lookup (F.embedding's forward) as an autograd function. The head's backward
runs first (the lookup's rows feed everything the head reads) and hands its W gradient over to the tie
(`take`) instead of returning it; the lookup's backward adds its rows into that buffer and returns it as the
one gradient of W. Autograd then sees a single gradient for W from these two (any other use of W, e.g. a
second head call, still adds its own as usual). Where the order is not certain (the head ran twice, or the
lookup did), nothing is handed over and both return their stock gradients. Summation order differs from the
stock path only for a token seen more than once in the batch (its rows are added one by one onto the head's
gradient instead of summed first): float32 rounding, ~1e-7 relative.

Applies (`tie_for`) on the CPU (index_add_ on CUDA is nondeterministic, and there the caching allocator makes the
second buffer cheap), to a float32/float64 weight that needs a gradient, when the input embedding is a plain
`torch.nn.Embedding` (no max_norm, no scale_grad_by_freq, not sparse; a subclass such as Gemma 3's scaled
embedding may compute something else) sharing the head's weight, outside torch.distributed (DDP/FSDP hooks
expect the stock gradients) and with autograd on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FLOATS = (torch.float32, torch.float64)


class TiedGrad:
    """The tie of one forward: build one per forward (models.forward.logit_head), pass it to the lookup
    (hidden_states) and the head (LogitHead.logprobs)."""

    def __init__(self, embedding: torch.nn.Embedding):
        self.weight, self.padding_idx = embedding.weight, embedding.padding_idx
        self.lookups = self.heads = 0
        self.grad: torch.Tensor | None = None  # the head's W gradient, from the head's backward to the lookup's
        self.closed = False  # the lookup's backward ran: nothing more is taken

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """F.embedding(ids, W) (ids (..., ) -> (..., H)), its W gradient added into the head's."""
        self.lookups += 1
        return _Lookup.apply(ids, self.weight, self)

    def take(self, grad: torch.Tensor | None) -> bool:
        """The head's backward offers its W gradient (V, H); True if taken: the head then returns None for W and
        the lookup's backward returns this buffer with its rows added."""
        if grad is None or self.heads != 1 or self.lookups != 1 or self.closed:
            return False
        self.grad = grad
        return True


def tie_for(embedding, weight: torch.Tensor) -> TiedGrad | None:
    """A TiedGrad when the input `embedding` module and the head's `weight` qualify (see the module docstring)."""
    return TiedGrad(embedding) if torch.is_grad_enabled() and qualifies(embedding, weight) else None


def qualifies(embedding, weight: torch.Tensor | None) -> bool:
    """Whether a forward with autograd on would tie `embedding` and the head's `weight` (tie_for): also what the
    planner asks, to leave out the lookup's dense (V, H) gradient (posttrain.training.plan)."""
    if weight is None or not (weight.requires_grad and weight.dtype in _FLOATS and weight.device.type == "cpu"):
        return False
    if type(embedding) is not torch.nn.Embedding or embedding.weight is not weight:
        return False
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, tie):
        # ids (...,) int, weight (V, H) -> (..., H)
        ctx.save_for_backward(ids)
        ctx.tie, ctx.vocab = tie, weight.shape[0]
        return F.embedding(ids, weight, tie.padding_idx)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        tie = ctx.tie
        grad, tie.grad, tie.closed = tie.grad, None, True
        pad = -1 if tie.padding_idx is None else tie.padding_idx
        if grad is None:  # nothing handed over: the stock dense gradient
            return None, torch.ops.aten.embedding_dense_backward(g, ids, ctx.vocab, pad, False), None
        ids, rows = ids.reshape(-1), g.reshape(-1, g.shape[-1])
        if tie.padding_idx is not None:  # the padding row gets no gradient from the lookup (as F.embedding)
            keep = ids != pad
            ids, rows = ids[keep], rows[keep]
        return None, grad.index_add_(0, ids, rows.to(grad.dtype)), None
