"""Log-probabilities of chosen tokens without materialising (tokens x vocab) logits.

The head maps a last hidden state h to logits as the model's own forward does (`LogitHead`):

    u = h·Wᵀ + b,   z = c·tanh(s·u / c) / T      (s: the model's logit scale, c: its final soft-cap; T: temperature)
    logp[i] = z_{i,y_i} − logsumexp_v z_{i,v}

The forward runs over tiles of (rows x vocabulary columns) and keeps only each row's log-normaliser
(an online logsumexp over the column tiles, N floats); the backward recomputes each tile's logits
and applies
    ∂logp_i/∂u_iv = (1[v = y_i] − softmax(z_i)_v) · s·(1 − tanh²(s·u_iv / c)) / T
so the memory of the head is one tile of logits, never N × V (Gemma 3: 4096 tokens × 262,144 × 4 B =
4.3 GB). A tile holds at most `tile_elements` numbers: 8x the hidden-state rows it is computed from,
between 1 MB and 128 MB in fp32, whatever the vocabulary. When the whole (N, V) softmax is no
larger than the head's weight and its gradient (N <= 2 x hidden size), which exist anyway, and than
128 MB, the forward keeps it for the backward instead (no second head matmul). Entropy of the full distribution is returned
on request (online too: H = lse − Σ p z), differentiable in this path (an entropy bonus: ∂H/∂z_v = −p_v (log p_v + H),
added in the same tile loop); the kept-set path below returns it detached.

Sampling with top-k / top-p draws from a kept set that only the whole row's logits define:
`chunked_kept_logprobs` runs `ops.sampling.trainer_logprobs` on chunks of whole rows, at most a
tile of logits each, recomputed in backward, so that path is bounded too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.ops import cpu_kernels
from posttrain.ops.linear import grad_weight, linear, matmul
from posttrain.ops.sampling import trainer_logprobs
from posttrain.ops.tied import TiedGrad

KEEP_MAX = 2**25  # elements (128 MB in fp32): the most logits one tile, a kept softmax or a kept-set chunk holds
TILE_MIN = 2**18  # elements (1 MB in fp32): the smallest tile, so a tiny hidden size does not mean 1-column tiles
TILE_PER_HIDDEN = 8  # a tile holds at most 8x the numbers of the hidden-state rows it is computed from


def tile_elements(rows: int, hidden: int) -> int:
    """The most logits one tile holds for `rows` hidden-state rows of width `hidden`."""
    return min(KEEP_MAX, max(TILE_MIN, TILE_PER_HIDDEN * rows * hidden))


def whole_rows(n: int, hidden: int, vocab: int, chunk: int = 1024) -> int:
    """Rows per chunk when a computation needs whole rows of logits (a kept set, a divergence over the
    vocabulary): at most `chunk`, and at most one tile of logits."""
    return max(1, min(chunk, tile_elements(min(n, chunk), hidden) // vocab))


@dataclass(frozen=True)
class HeadMap:
    """The scalar part of the head: u (logits of the linear layer) -> z = c·tanh(s·u/c) / T."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    def apply(self, u: torch.Tensor, slope: bool = False):
        """z (same shape as u, in place where possible) and, with `slope`, dz/du (a tensor, or a float)."""
        a = u * self.scale if self.scale != 1.0 else u
        if self.softcap is None:
            z = a / self.temperature if self.temperature != 1.0 else a
            return z, (self.scale / self.temperature if slope else None)
        t = torch.tanh(a / self.softcap)
        z = t * (self.softcap / self.temperature)
        return z, (t.square().neg_().add_(1).mul_(self.scale / self.temperature) if slope else None)


def _tile(h, weight, bias, v0: int, v1: int, hm: HeadMap, slope: bool = False):
    """Logits z (r, v1 − v0) in the accumulation dtype of the column tile [v0, v1), and dz/du on request."""
    u = linear(h, weight[v0:v1])
    if bias is not None:
        u = u + bias[v0:v1]
    return hm.apply(u.to(_acc(h.dtype)), slope)


def _target_in_tile(targets, v0: int, v1: int):
    """(rows whose target lies in [v0, v1), their column within the tile)."""
    rows = ((targets >= v0) & (targets < v1)).nonzero().squeeze(1)
    return rows, targets[rows] - v0


def _row_forward(h, weight, bias, targets, hm: HeadMap, cols: int, want_entropy: bool):
    """One chunk of rows: (logp (r,), lse (r,), entropy (r,) | None) by an online logsumexp over column tiles:
    m = running max, s = Σ e^(z−m), t = Σ e^(z−m)·z; at the end lse = m + log s, Σ p z = t / s."""
    r, V = h.shape[0], weight.shape[0]
    acc = _acc(h.dtype)
    m = torch.full((r,), float("-inf"), dtype=acc, device=h.device)
    s, zt = torch.zeros_like(m), torch.zeros_like(m)
    t = torch.zeros_like(m) if want_entropy else None
    for v0 in range(0, V, cols):
        v1 = min(V, v0 + cols)
        z, _ = _tile(h, weight, bias, v0, v1, hm)
        m_new = torch.maximum(m, z.amax(1))
        alpha = torch.exp(m - m_new)
        e = torch.exp(z - m_new[:, None])
        s = s * alpha + e.sum(1)
        if want_entropy:
            t = t * alpha + (e * z).sum(1)
        rows, col = _target_in_tile(targets, v0, v1)
        zt[rows] = z[rows, col]
        m = m_new
    lse = m + torch.log(s)
    return zt - lse, lse, (lse - t / s if want_entropy else None)


def _softmax_in_place(z, targets, want_entropy: bool, rows: int = 64):
    """z (N, V) logits -> (logp (N,), lse (N,), entropy (N,) | None), z overwritten by softmax(z).

    Chunks of `rows` rows, in place: lse = m + log Σ exp(z − m) (m = max_v z), then z − lse (log p) and
    p = exp(z − lse), exactly as a recomputing backward forms p from the saved lse (a second backward gives
    the same gradient). One chunk-sized temporary (torch.logsumexp would make two); one (N, V) temporary per
    operation (~100 MB each at N = 490, V = 49152) would be a fresh mapping, page-faulted anew at every call.
    H = −Σ p·log p. On x86 CPUs with AVX2 a fused kernel does the same in three passes per row (max, then
    two exp passes: cpu_kernels.softmax_rows_; no temporaries, sums in double)."""
    fused = cpu_kernels.softmax_rows_(z, targets, want_entropy)
    if fused is not None:
        return fused
    n = z.shape[0]
    logp, lse = z.new_empty(n), z.new_empty(n)
    entropy = z.new_empty(n) if want_entropy else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        zc = z[r0:r1]
        m = zc.amax(1, keepdim=True)
        lse[r0:r1] = m.squeeze(1) + (zc - m).exp_().sum(1).log_()
        zc.sub_(lse[r0:r1, None])  # log p
        logp[r0:r1] = zc.gather(1, targets[r0:r1, None]).squeeze(1)
        if want_entropy:
            p = zc.exp()
            entropy[r0:r1] = (p * zc).sum(-1).neg_()
            zc.copy_(p)
        else:
            zc.exp_()
    return logp, lse, entropy


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, hm, chunk, want_entropy, tie):
        # hidden (N, H), weight (V, H), bias (V,) | None, targets (N,); tie: ops.tied.TiedGrad | None
        n, H = hidden.shape
        V = weight.shape[0]
        rows = max(1, min(n, chunk))
        cols = max(1, tile_elements(rows, H) // rows)
        keep = n <= rows and n <= 2 * H and n * V <= KEEP_MAX  # softmax no larger than W and its gradient: keep it
        if keep:
            z, slope = _tile(hidden, weight, bias, 0, V, hm, slope=True)
            logp, lse, entropy = _softmax_in_place(z, targets, want_entropy)
            ctx.kept = (z, slope)  # z now holds the softmax; used once by the backward, then freed
        else:
            parts = [_row_forward(hidden[s : s + rows], weight, bias, targets[s : s + rows], hm, cols, want_entropy)
                     for s in range(0, n, rows)]
            logp, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            entropy = torch.cat([p[2] for p in parts]) if want_entropy else None
            ctx.kept = None
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.hm, ctx.rows, ctx.cols = hm, rows, (V if keep else cols)  # a recomputing backward tiles as the forward did
        ctx.entropy = entropy.detach() if want_entropy else None  # H (N,): the entropy's own gradient needs it
        ctx.tie = _count_head(tie)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        ent, ctx.entropy = ctx.entropy, None
        if ent is None or grad_entropy is None or not bool(grad_entropy.ne(0).any()):
            grad_entropy = None  # the entropy was a metric only (an entropy bonus gives it a gradient)
        acc = _acc(hidden.dtype)
        grad_h, grad_w, grad_b = _grad_buffers(ctx, hidden, weight, bias)
        kept, ctx.kept = ctx.kept, None
        V, rows = weight.shape[0], ctx.rows
        cols = ctx.cols
        for s in range(0, hidden.shape[0], rows):
            h, g = hidden[s : s + rows], grad_logp[s : s + rows].to(acc)
            h_acc = h.to(acc) if grad_w is not None else None
            gh = torch.zeros(h.shape, dtype=acc, device=h.device) if grad_h is not None else None
            for v0 in range(0, V, cols):
                v1 = min(V, v0 + cols)
                if kept is not None:  # the forward's softmax and slope (one tile), used once
                    (p, slope), kept = kept, None
                else:
                    z, slope = _tile(h, weight, bias, v0, v1, ctx.hm, slope=True)
                    p = cpu_kernels.exp_rows_(z, lse[s : s + rows])  # as the kept softmax formed it
                # entropy bonus: ∂H/∂z_v = −p_v (log p_v + H), before p is overwritten
                e_term = None if grad_entropy is None else _entropy_grad(p, ent[s : s + rows], grad_entropy[s : s + rows].to(acc))
                dz = _tile_grad(p, g, targets[s : s + rows], v0, v1, slope, e_term)  # dL/du of the tile (r, c)
                _backprop_tile(dz, h_acc, weight, v0, v1, gh, grad_w, grad_b, first=s == 0)
            if grad_h is not None:
                grad_h[s : s + rows] = gh.to(hidden.dtype)
        return _cast(grad_h, grad_w, grad_b, weight, bias, ctx.tie) + (None,) * 5


def _count_head(tie):
    """The head's forward runs with `tie` (ops.tied): counted, kept for the backward."""
    if tie is not None:
        tie.heads += 1
    return tie


def _cast(grad_h, grad_w, grad_b, weight, bias, tie=None) -> tuple:
    """The accumulated gradients in the parameters' dtypes; W's handed over to a tied embedding's lookup
    (ops.tied) where it takes it."""
    gw = None if grad_w is None else grad_w.to(weight.dtype)
    if tie is not None and tie.take(gw):
        gw = None  # the lookup's backward returns it, with its rows added
    return (grad_h, gw, None if grad_b is None else grad_b.to(bias.dtype))


def _backprop_tile(dz, h_acc, weight, v0: int, v1: int, gh, grad_w, grad_b, first: bool) -> None:
    """Add dL/du (r, c) of columns [v0, v1) into the hidden-state rows' gradient gh (r, H), grad_w and grad_b
    (each None when not needed): gh += dz·W[v0:v1], grad_w[v0:v1] += dzᵀ·h, grad_b[v0:v1] += Σ_rows dz.
    `first`: the first chunk of rows, which writes grad_w and grad_b (left empty by _grad_buffers) instead."""
    if gh is not None:
        gh += matmul(dz.to(weight.dtype), weight[v0:v1])
    if grad_w is not None:
        if first:
            grad_weight(dz, h_acc, out=grad_w[v0:v1])
        else:
            grad_w[v0:v1].addmm_(dz.t(), h_acc)
    if grad_b is not None:
        if first:
            torch.sum(dz, 0, out=grad_b[v0:v1])
        else:
            grad_b[v0:v1] += dz.sum(0)


def _grad_buffers(ctx, hidden, weight, bias):
    """fp32 (fp64 for fp64 inputs) accumulators for the weight and bias gradients, None where not needed,
    and the hidden-state gradient: all empty (the first chunk of rows writes them, `_backprop_tile`), so
    no pass zeroes a (V, H) buffer that is overwritten anyway."""
    acc = _acc(hidden.dtype)
    grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    grad_w = torch.empty(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
    need_b = bias is not None and ctx.needs_input_grad[2]
    grad_b = torch.empty(bias.shape, dtype=acc, device=bias.device) if need_b else None
    return grad_h, grad_w, grad_b


def _entropy_grad(p, entropy, g_ent):
    """dL/dz of the entropy output on one tile: g_H·∂H/∂z_v = −g_H·p_v (log p_v + H)  (r, c); p (r, c) kept."""
    return (torch.xlogy(p, p) + p * entropy[:, None]).mul_(-g_ent[:, None])


def _tile_grad(p, g, targets, v0: int, v1: int, slope, extra=None):
    """dL/du = (g·(1[v = y] − p) + extra)·dz/du on one tile (extra: another output's dL/dz, e.g. the
    entropy's); p (r, c) is overwritten."""
    dz = p.mul_(-g[:, None])
    if extra is not None:
        dz += extra
    rows, col = _target_in_tile(targets, v0, v1)
    dz[rows, col] += g[rows]
    return dz.mul_(slope) if not (isinstance(slope, float) and slope == 1.0) else dz


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when the inputs are fp64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk: int = 1024,
    with_entropy: bool = False,
    scale: float = 1.0,
    softcap: float | None = None,
    tie=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp (N,), entropy (N,) | None) of `targets` under softmax(c·tanh(s·(hidden @ weight.T + bias)/c) / T).
    `chunk`: the most rows a tile spans; `tie`: the forward's ops.tied.TiedGrad (a tied embedding), or None."""
    hm = HeadMap(float(scale), None if softcap is None else float(softcap), float(temperature))
    with torch.autocast(hidden.device.type, enabled=False):  # the head runs in its own dtype, never autocast
        return _ChunkedLogProbs.apply(hidden.to(weight.dtype), weight, bias, targets, hm, int(chunk), bool(with_entropy), tie)


def head_logits(hidden, weight, bias=None, scale: float = 1.0, softcap: float | None = None,
                temperature: float = 1.0) -> torch.Tensor:
    """The full logits z (N, V) in fp32 (the head in its own dtype, never autocast): for callers that need
    the whole distribution of a few rows (a divergence, a kept set); (N x V) memory."""
    hm = HeadMap(float(scale), None if softcap is None else float(softcap), float(temperature))
    with torch.autocast(hidden.device.type, enabled=False):
        u = linear(hidden.to(weight.dtype), weight, bias)  # differentiable (a divergence's gradient flows here)
        return hm.apply(u.float() if u.dtype != torch.float64 else u)[0]


class _ChunkedKeptLogProbs(torch.autograd.Function):
    """`ops.sampling.trainer_logprobs` (the kept-set log-probs of a top-k / top-p draw) over chunks of whole rows
    (a kept set needs the whole row), at most one tile of logits each. Forward: no graph. Backward: per chunk,
    the logits again, dL/dz by autograd through trainer_logprobs on that chunk alone, then into one gradient
    accumulator as in _ChunkedLogProbs (no per-chunk (V x H) weight gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, kept, hm, temperature, rows, want_entropy, tie):
        logp, ent = [], []
        for s in range(0, hidden.shape[0], rows):
            z, _ = _tile(hidden[s : s + rows], weight, bias, 0, weight.shape[0], hm)  # (r, V), temperature 1
            lp, e = trainer_logprobs(z, targets[s : s + rows], temperature, kept=kept[s : s + rows], with_entropy=want_entropy)
            logp.append(lp)
            ent.append(e)
        ctx.save_for_backward(hidden, weight, bias, targets, kept)
        ctx.hm, ctx.temperature, ctx.rows, ctx.tie = hm, temperature, rows, _count_head(tie)
        entropy = torch.cat(ent) if want_entropy else None
        if want_entropy:
            ctx.mark_non_differentiable(entropy)
        return torch.cat(logp), entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, kept = ctx.saved_tensors
        acc = _acc(hidden.dtype)
        grad_h, grad_w, grad_b = _grad_buffers(ctx, hidden, weight, bias)
        V, rows = weight.shape[0], ctx.rows
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s : s + rows]
            z, slope = _tile(h, weight, bias, 0, V, ctx.hm, slope=True)
            with torch.enable_grad():
                z.requires_grad_(True)
                lp, _ = trainer_logprobs(z, targets[s : s + rows], ctx.temperature, kept=kept[s : s + rows])
                (dz,) = torch.autograd.grad(lp, z, grad_logp[s : s + rows].to(lp.dtype))
            dz = dz.mul_(slope) if not (isinstance(slope, float) and slope == 1.0) else dz
            gh = torch.zeros(h.shape, dtype=acc, device=h.device) if grad_h is not None else None
            _backprop_tile(dz.to(acc), h.to(acc) if grad_w is not None else None, weight, 0, V, gh, grad_w, grad_b,
                           first=s == 0)
            if grad_h is not None:
                grad_h[s : s + rows] = gh.to(hidden.dtype)
        return _cast(grad_h, grad_w, grad_b, weight, bias, ctx.tie) + (None,) * 7


def chunked_kept_logprobs(hidden, weight, targets, kept, bias=None, temperature: float = 1.0, scale: float = 1.0,
                          softcap: float | None = None, chunk: int = 1024, with_entropy: bool = False, tie=None):
    """(logp (N,), entropy (N,) | None): the kept-set log-probs (`ops.sampling.trainer_logprobs`, kept (N,) set
    sizes, 0 = not truncated) of softmax(c·tanh(s·(hidden @ weight.T + bias)/c) / T) restricted to each set,
    in chunks of whole rows of at most one tile of logits: (N, V) logits never exist at once."""
    hm = HeadMap(float(scale), None if softcap is None else float(softcap), 1.0)  # trainer_logprobs applies T
    rows = whole_rows(hidden.shape[0], hidden.shape[1], weight.shape[0], chunk)
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedKeptLogProbs.apply(hidden.to(weight.dtype), weight, bias, targets, kept.to(targets.device), hm,
                                          float(temperature), rows, bool(with_entropy), tie)


@dataclass(frozen=True)
class LogitHead:
    """What turns a model's last hidden states into its logits: z = c·tanh(s·(h·Wᵀ + b)/c) (models.forward.logit_head
    reads s and c from the model and checks them against its forward). Holds the tensors of one call (under FSDP
    the gathered weight): build one per forward. `tie`: that forward's ops.tied.TiedGrad where the weight is
    also the input embeddings (pass it to the backbone's lookup too), else None."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    tie: TiedGrad | None = None

    def logits(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Full logits (M, V) fp32 of `hidden` (M, H)."""
        return head_logits(hidden, self.weight, self.bias, self.scale, self.softcap, temperature)

    def rows_per_chunk(self, n: int, chunk: int = 1024) -> int:
        """Rows of whole-vocabulary logits (`logits`) one chunk of `n` hidden-state rows may take: at most a tile."""
        return whole_rows(n, self.weight.shape[1], self.weight.shape[0], chunk)

    def logprobs(self, hidden, targets, temperature: float = 1.0, kept: torch.Tensor | None = None,
                 with_entropy: bool = False, chunk: int = 1024):
        """(logp (M,), entropy (M,) | None) of `targets`: the temperature-only distribution, or with `kept`
        (the engine's kept-set sizes, 0 = not truncated) the set each token was drawn from."""
        if kept is not None and bool((kept > 0).any()):
            return chunked_kept_logprobs(hidden, self.weight, targets, kept, self.bias, temperature, self.scale,
                                         self.softcap, chunk, with_entropy, self.tie)
        return chunked_logprobs(hidden, self.weight, targets, self.bias, temperature, chunk, with_entropy,
                                self.scale, self.softcap, self.tie)


def reference_logprobs(hidden, weight, targets, bias=None, temperature: float = 1.0, scale: float = 1.0,
                       softcap: float | None = None):
    """The plain (full logits) computation; used by tests as the definition."""
    z = head_logits(hidden, weight, bias, scale, softcap, temperature)
    return torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)
