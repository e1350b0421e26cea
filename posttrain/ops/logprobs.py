"""Log-probabilities of chosen tokens without materialising (tokens x vocab) logits at once.

    logp[i] = h_i·w_{y_i} / T − logsumexp_v(h_i·w_v / T)

The forward runs over chunks of rows and keeps only the log-normaliser per row (N floats); the
backward recomputes each chunk's logits (when all rows fit in one chunk, the forward's softmax is
kept instead: one (N x V) buffer, no second lm_head matmul) and applies
    ∂logp_i/∂z_iv = (1[v = y_i] − softmax(z_i)_v) / T
so peak memory is one chunk of logits, not N × V (for SmolLM2, 4096 tokens × 49152 × 4 B = 805 MB).
Entropy of the full distribution is returned as a detached metric on request.
"""

from __future__ import annotations

import torch

KEEP_MAX = 2**25  # elements (128 MB in fp32) of softmax the forward may hand to the backward


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, want_entropy):
        # hidden (N, H), weight (V, H), bias (V,) | None, targets (N,)
        n = hidden.shape[0]
        acc = _acc(hidden.dtype)
        logp = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n, dtype=acc) if want_entropy else None
        # one chunk of at most KEEP_MAX elements: keep its softmax for backward instead of recomputing the logits
        keep = n <= chunk and n * weight.shape[0] <= KEEP_MAX
        probs = None
        for s in range(0, n, chunk):
            z = _logits(hidden[s : s + chunk], weight, bias, temperature)  # (c, V) fp32
            norm = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk] = norm
            logp[s : s + chunk] = z.gather(1, targets[s : s + chunk, None]).squeeze(1) - norm
            if want_entropy or keep:
                p = torch.exp(z - norm[:, None])
                if want_entropy:
                    entropy[s : s + chunk] = norm - (p * z).sum(-1)  # H = lse − Σ p z
                if keep:
                    probs = p
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.probs = probs  # (n, V) softmax when n <= chunk, else None (backward recomputes per chunk)
        ctx.temperature, ctx.chunk = temperature, chunk
        if want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = _acc(hidden.dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            g = grad_logp[s : s + chunk].to(acc)
            if ctx.probs is not None:  # the forward's softmax (a single chunk), used once and freed
                dz, ctx.probs = ctx.probs.mul_(-g[:, None]), None
            else:
                z = _logits(h, weight, bias, t)
                dz = torch.exp(z - lse[s : s + chunk, None]).mul_(-g[:, None])
            # dL/dz = g * (onehot − softmax) / T
            dz.scatter_add_(1, targets[s : s + chunk, None], g[:, None])
            dz.div_(t)
            if need_h:
                grad_h[s : s + chunk] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(dz.t(), h.to(acc))
            if need_b:
                grad_b += dz.sum(0)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when the inputs are fp64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    z = h @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.to(_acc(h.dtype))
    return z / temperature if temperature != 1.0 else z


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp (N,), entropy (N,) | None) of `targets` under softmax(hidden @ weight.T / temperature)."""
    with torch.autocast(hidden.device.type, enabled=False):  # the head runs in its own dtype, never autocast
        return _ChunkedLogProbs.apply(hidden.to(weight.dtype), weight, bias, targets, float(temperature), int(chunk),
                                      bool(with_entropy))


def reference_logprobs(hidden, weight, targets, bias=None, temperature: float = 1.0):
    """The plain (full logits) computation; used by tests as the definition."""
    z = _logits(hidden, weight, bias, temperature)
    return torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)
