"""The one sampling function: logits -> the exact distribution a token is drawn from.

The engine samples with it and the trainer recomputes behaviour log-probs with it, so the two can
only disagree by the logits (train–inference consistency: docs/engine.md, "Sampling semantics").

Semantics of `process_logits(logits, temperature, top_k, top_p)` (same order as HF `generate` and
vLLM: temperature, then top-k, then top-p), per row:

1. temperature == 0 means greedy: the distribution is one-hot at `argmax` (first index on ties);
   log-prob 0 there, -inf elsewhere. Otherwise `z = logits / temperature` (computed in float32).
2. top_k > 0 keeps every token whose value is >= the k-th largest value of z (ties at the k-th
   value are all kept, as in HF's TopKLogitsWarper, so more than k tokens can survive); top_k = 0
   (or >= vocab) keeps all.
3. top_p < 1 acts on p = softmax(z restricted to the kept set): token i is kept iff the mass of the
   tokens strictly more probable than it is < top_p. Without ties this is HF's TopPLogitsWarper
   (the smallest most-probable set whose mass reaches top_p; the top token is always kept); with
   ties it keeps the whole tied group, so the result never depends on sort order.
4. The result is log_softmax over the kept set: finite log-probs that sum (in prob) to 1 on the
   kept set, -inf outside it.

`sample(logprobs, uniforms)` draws one token per row by inverting the CDF of exp(logprobs) at a
given uniform in [0, 1). Tokens with probability 0 are never drawn. The uniforms come from
`counter_uniforms(seed, sample_index, step)`: a stateless hash of (seed, sample index, token
index), so a sample's tokens depend on its seed only, never on what else is in the batch, and a
preempted sequence that is recomputed draws the same tokens again.

Kept counts (train–inference consistency under truncation). Top-k/top-p decide set membership by
comparisons, so float noise between the engine's logits and the trainer's (different kernels and
summation orders) can move a token at the edge of the kept set to the other side: the trainer's
`process_logits` then gives -inf, or renormalises over a different set, for a token the engine drew.
So the engine also records, per drawn token, `kept` = the size of the set it was drawn from (tokens
with finite log-prob, ties included; 0 = not truncated), and the trainer recomputes with
`kept_logprobs` / `trainer_logprobs`: log_softmax over the `kept` largest values of its own
logits / temperature, the drawn token always among them. Both sides then use sets of the same size
that contain the drawn token, and differ only by logit noise.
"""

from __future__ import annotations

import torch

from posttrain.ops import cpu_kernels

_M32 = 0xFFFFFFFF


def process_logits(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """Log-probs (float32, same shape as `logits` (..., V)) of the truncated, renormalised distribution.

    `temperature`, `top_k`, `top_p` are scalars or tensors broadcastable to logits.shape[:-1]
    (one value per row). See the module docstring for the exact semantics.
    """
    z = logits.float()
    lead, V = z.shape[:-1], z.shape[-1]
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=z.device).expand(lead)
    greedy = temp == 0
    if not bool((temp == 1).all()):
        z = z / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(-1)

    k = torch.as_tensor(top_k, dtype=torch.long, device=z.device).expand(lead)
    k = torch.where((k <= 0) | (k > V), torch.full_like(k, V), k)
    if bool((k < V).any()):
        kmax = int(k.max())
        top = torch.topk(z, kmax, dim=-1).values  # (..., kmax) descending
        kth = top.gather(-1, (k - 1).unsqueeze(-1))  # (..., 1) the k-th largest value
        z = z.masked_fill(z < kth, float("-inf"))

    p = torch.as_tensor(top_p, dtype=torch.float32, device=z.device).expand(lead)
    if bool((p < 1).any()):
        probs = torch.softmax(z, dim=-1)
        sorted_p, _ = torch.sort(probs, dim=-1, descending=True)
        mass_above = torch.cumsum(sorted_p, dim=-1) - sorted_p  # exclusive prefix sum
        n_keep = (mass_above < p.unsqueeze(-1)).sum(-1, keepdim=True).clamp(min=1)
        p_min = sorted_p.gather(-1, n_keep - 1)  # smallest kept probability; ties are kept too
        z = z.masked_fill((probs < p_min) & (p < 1).unsqueeze(-1), float("-inf"))

    logprobs = torch.log_softmax(z, dim=-1)
    if bool(greedy.any()):
        onehot = torch.full_like(logprobs, float("-inf"))
        onehot.scatter_(-1, logits.float().argmax(-1, keepdim=True), 0.0)
        logprobs = torch.where(greedy.unsqueeze(-1), onehot, logprobs)
    return logprobs


def sample(logprobs: torch.Tensor, uniforms: torch.Tensor, chunks: int = 256) -> torch.Tensor:
    """One token per row of `logprobs` (N, V): the smallest index whose CDF exceeds u·total.

    `uniforms` (N,) in [0, 1). Two-level inverse CDF: the sums of `chunks` vocabulary chunks pick
    the chunk (a float64 cumsum over them), a float64 cumsum inside it picks the token. Tokens of
    probability 0 are never drawn (a flat CDF step cannot exceed the target first; a rounding
    overshoot falls back to the chunk's last token of positive probability).
    """
    return _inverse_cdf(logprobs.float().exp(), uniforms, chunks)


def _inverse_cdf(p: torch.Tensor, uniforms: torch.Tensor, chunks: int = 256, with_total: bool = False):
    """`sample` on non-negative weights `p` (N, V) that need not be normalised; with_total: also
    return the weights' row sums (N,) float64 (from the chunk sums, no extra pass)."""
    N, V = p.shape
    W = -(-V // chunks)
    if W * chunks != V:
        p = torch.nn.functional.pad(p, (0, W * chunks - V))
    p = p.view(N, chunks, W)
    csum = p.sum(-1).double().cumsum(-1)  # (N, C); float32 chunk sums (a float64 cast of all of p is slow)
    target = uniforms.double().unsqueeze(-1) * csum[:, -1:]  # (N, 1)
    c = torch.searchsorted(csum, target, right=True).clamp_(max=chunks - 1)  # (N, 1)
    base = torch.where(c > 0, csum.gather(1, (c - 1).clamp(min=0)), torch.zeros_like(target))
    inner = p.gather(1, c.unsqueeze(-1).expand(N, 1, W)).squeeze(1)  # (N, W)
    cdf = inner.double().cumsum(-1) + base
    j = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (N,)
    last_pos = (W - 1) - (inner > 0).flip(-1).int().argmax(-1)  # last positive token of the chunk
    j = torch.minimum(j, last_pos)
    tok = c.squeeze(-1) * W + j
    return (tok, csum[:, -1]) if with_total else tok


def sample_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                  uniforms: torch.Tensor, with_kept: bool = False, all_plain: bool = False):
    """Draw one token per row of `logits` (N, V) and return (tokens (N,), their behaviour log-probs (N,)),
    plus, with `with_kept`, the kept counts (N,) long: the size of the set each token was drawn from
    (see `kept_logprobs`; 0 for greedy and plain rows, which are not truncated).

    The same distribution as `sample(process_logits(logits, T, k, p), uniforms)`, with fast paths
    chosen per row from the row's own parameters (so a row's draw never depends on its neighbours):
    greedy rows (T == 0) take the argmax (log-prob 0); plain rows (T > 0, no top-k, top_p >= 1) skip
    the sorts and the full log_softmax: one exp(z - max) pass gives the (unnormalised) weights the
    inverse CDF needs, and the token's log-prob is z_tok - max - log(sum) (the sum from the inverse
    CDF's chunk sums); on CPU one fused kernel does it (`_plain_rows`). Other rows go through
    `process_logits` + `sample`. All per-row parameters are (N,) tensors. `all_plain=True`: the caller knows
    every row is plain, so the per-row checks (a few small tensor ops, ~0.2 ms of a CPU decode step) are skipped
    (top_k and top_p are not read then: None will do).
    """
    N, V = logits.shape
    if all_plain:
        tok, lp = _plain_rows(logits, temperature, uniforms)
        return (tok, lp, torch.zeros(N, dtype=torch.long, device=logits.device)) if with_kept else (tok, lp)
    tok = torch.empty(N, dtype=torch.long, device=logits.device)
    lp = torch.empty(N, dtype=torch.float32, device=logits.device)
    kept = torch.zeros(N, dtype=torch.long, device=logits.device)
    out = (tok, lp, kept) if with_kept else (tok, lp)
    greedy = temperature == 0
    plain = ~greedy & ((top_k <= 0) | (top_k >= V)) & (top_p >= 1)
    rest = ~greedy & ~plain
    all_plain = bool(plain.all())
    if all_plain or bool(plain.any()):
        rows = None if all_plain else plain.nonzero().squeeze(1)
        x = logits if rows is None else logits[rows]
        t = temperature if rows is None else temperature[rows]
        u = uniforms if rows is None else uniforms[rows]
        t_, l_ = _plain_rows(x, t, u)
        if rows is None:
            return (t_, l_, kept) if with_kept else (t_, l_)
        tok[rows], lp[rows] = t_, l_
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(1)
        tok[rows] = logits[rows].float().argmax(-1)
        lp[rows] = 0.0
    if bool(rest.any()):
        rows = rest.nonzero().squeeze(1)
        logprobs = process_logits(logits[rows], temperature[rows], top_k[rows], top_p[rows])
        t_ = sample(logprobs, uniforms[rows])
        tok[rows], lp[rows] = t_, logprobs.gather(1, t_.unsqueeze(1)).squeeze(1)
        kept[rows] = torch.isfinite(logprobs).sum(-1)
    return out


def _plain_rows(x: torch.Tensor, t: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probs) of plain rows: the inverse CDF over exp(y), y = z / t - max(z / t) in float32.
    On CPU the fused kernel (`cpu_kernels.sample_plain`: two passes over the logits, no (N, V) temporaries)
    computes the same, up to the order of each chunk's float32 sum."""
    fused = cpu_kernels.sample_plain(x, t, u)
    if fused is not None:
        return fused
    if bool((t == 1).all()):  # y = z - max z in float32 (the logits are never modified)
        # a float32 copy, then an in-place subtract: bf16 - float32 in one op takes a slow mixed-dtype
        # path (11 ms vs 0.7 ms at (64, 49152) on 2 cores), with the same values
        y = x.to(torch.float32, copy=True).sub_(x.amax(-1, keepdim=True).float())
    else:
        y = x.float() / t.unsqueeze(-1)
        y.sub_(y.amax(-1, keepdim=True))
    tok, total = _inverse_cdf(y.exp(), u, with_total=True)  # weights exp(z - max), unnormalised
    return tok, y.gather(1, tok.unsqueeze(1)).squeeze(1) - total.log().float()


def kept_logprobs(logits: torch.Tensor, temperature, kept: torch.Tensor, targets: torch.Tensor,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs (M,) of `targets`, entropy (M,) or None) under the distribution the engine drew from,
    given its kept counts. Differentiable in `logits` (the entropy is a detached metric).

    logits (M, V) (computed in at least float32), temperature > 0 (scalar or (M,)), kept (M,) long,
    targets (M,) long. Per row, with z = logits / temperature:
    - kept == 0: not truncated, p = softmax(z) over the whole vocabulary;
    - kept == k > 0: S = the k largest entries of z, where the target replaces the smallest of them
      if it is not among them; p = softmax over S, 0 elsewhere (so log p(target) is always finite).
    When `kept` is process_logits' kept-set size on the same logits, this equals process_logits up to
    fp32 rounding (ties at the edge have equal values, so which tied index is picked does not matter).
    """
    M, V = logits.shape
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    temp = torch.as_tensor(temperature, dtype=z.dtype, device=z.device).expand(M)
    if bool((temp <= 0).any()):
        raise ValueError("kept_logprobs needs temperature > 0 (greedy tokens have log-prob 0 and no gradient)")
    if not bool((temp == 1).all()):
        z = z / temp.unsqueeze(-1)
    kept = torch.as_tensor(kept, device=z.device).long().clamp(max=V)
    trunc = kept > 0
    if bool(trunc.all()):
        return _topk_logprobs(z, kept, targets, with_entropy)
    if not bool(trunc.any()):
        return _full_logprobs(z, targets, with_entropy)
    rows, rest = trunc.nonzero().squeeze(1), (~trunc).nonzero().squeeze(1)
    lp_t, ent_t = _topk_logprobs(z[rows], kept[rows], targets[rows], with_entropy)
    lp_f, ent_f = _full_logprobs(z[rest], targets[rest], with_entropy)
    logp = z.new_zeros(M).index_put((rows,), lp_t).index_put((rest,), lp_f)  # out of place: autograd flows
    ent = z.new_zeros(M).index_put_((rows,), ent_t).index_put_((rest,), ent_f) if with_entropy else None
    return logp, ent


@torch.no_grad()
def kept_from_logprobs(logits: torch.Tensor, temperature: float, targets: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """Kept-set sizes (M,) long that reproduce a sampler's behaviour log-probs on these logits, for a backend that
    reports log p(token) under its truncated distribution but not the size of the set (vLLM's processed log-probs).

    logits (M, V), temperature > 0, targets (M,), behaviour (M,) the sampler's log-probs. A top-k / top-p set is the
    k largest entries of z = logits / T, so log p(t) = z_t - LSE_k with LSE_k = logsumexp(z_(1) .. z_(k)) (sorted
    descending). LSE_k grows with k, so k = the size whose LSE_k is nearest to z_t - behaviour. Where logit noise
    between the sampler's forward and this one picks a neighbouring size, kept_logprobs over it differs from the
    behaviour log-prob by at most that noise plus the edge token's mass (e^(z_edge - LSE) <= the step between sizes).
    """
    z = logits.float() / float(temperature)
    lse = torch.logcumsumexp(z.sort(-1, descending=True).values, -1)  # (M, V): LSE_k at index k - 1
    c = (z.gather(1, targets.view(-1, 1)) - behaviour.to(z).view(-1, 1)).contiguous()  # (M, 1)
    hi = torch.searchsorted(lse, c).clamp(max=z.shape[1] - 1)  # first index with LSE >= c
    lo = (hi - 1).clamp(min=0)
    nearer_lo = (c - lse.gather(1, lo)).abs() < (lse.gather(1, hi) - c).abs()
    return (torch.where(nearer_lo, lo, hi) + 1).squeeze(1)


def _full_logprobs(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """log softmax(z)[target] = z_t - logsumexp(z) for rows z (R, V); entropy = -sum p log p (detached)."""
    lse = torch.logsumexp(z, -1)
    logp = z.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
    ent = torch.special.entr(torch.softmax(z.detach(), -1)).sum(-1) if with_entropy else None
    return logp, ent


def _topk_logprobs(z: torch.Tensor, kept: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """`kept_logprobs` on rows z (R, V) that are all truncated (kept (R,) in [1, V]).

    With S_r the row's set: log p(t) = z_t - log sum_{j in S_r} exp(z_j), so d log p / d z_j = 1[j = t] - p_j
    on S_r and 0 outside (autograd gets it through topk's and gather's scatter-backward). One topk with
    K = max kept serves all rows (no full sort of V; (R, K) buffers instead of (R, V)); row r uses the
    first kept[r] of its K sorted values. Entropy of the set: -sum_{j in S_r} p_j log p_j.
    """
    K = int(kept.max())
    vals, idx = torch.topk(z, K, dim=-1)  # (R, K) descending, differentiable in z
    pos = torch.arange(K, device=z.device)
    inside = pos < kept.unsqueeze(1)  # (R, K): row r's set is its first kept[r] entries
    z_t = z.gather(1, targets.unsqueeze(1))  # (R, 1) the target's value
    missing = ~((idx == targets.unsqueeze(1)) & inside).any(1, keepdim=True)  # target not in the top kept[r]
    vals = torch.where(missing & (pos == kept.unsqueeze(1) - 1), z_t, vals)  # it replaces the smallest kept
    vals = vals.masked_fill(~inside, float("-inf"))
    lse = torch.logsumexp(vals, -1)  # log of the set's normaliser
    logp = z_t.squeeze(1) - lse
    ent = torch.special.entr(torch.softmax(vals.detach(), -1)).sum(-1) if with_entropy else None
    return logp, ent


def trainer_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature=1.0, kept: torch.Tensor | None = None,
                     top_k=0, top_p=1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The trainer's behaviour/policy log-probs (M,) of `targets` (M,) under `logits` (M, V), and the
    entropy (M,) (detached) or None. Differentiable in `logits`.

    kept (M,) given (the engine's `Completion.kept_counts`, concatenated): `kept_logprobs` (exact set
    size; top_k/top_p are then already encoded in it). kept None (a backend that does not report it,
    e.g. vLLM) or temperature 0: `process_logits(logits, temperature, top_k, top_p)`, which is exact only
    up to sets flipped by logit noise at the truncation edge (and temperature-only when nothing truncates).
    """
    M, V = logits.shape
    if bool((torch.as_tensor(temperature) == 0).any()):
        kept = None  # greedy rows: one-hot (log-prob 0 at the argmax), as the engine records them
    elif kept is None and not _truncates(top_k, top_p, V):
        kept = torch.zeros(M, dtype=torch.long)  # temperature only: logsumexp, no (M, V) log-prob tensor
    if kept is not None:
        return kept_logprobs(logits, temperature, kept, targets, with_entropy)
    lp_all = process_logits(logits, temperature, top_k, top_p)  # (M, V), -inf outside the kept set
    logp = lp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    ent = torch.special.entr(lp_all.detach().exp()).sum(-1) if with_entropy else None
    return logp, ent


def _truncates(top_k, top_p, vocab_size: int) -> bool:
    """Whether any row's top-k / top-p removes tokens (scalars or tensors, as process_logits takes them)."""
    k, p = torch.as_tensor(top_k), torch.as_tensor(top_p)
    return bool(((k > 0) & (k < vocab_size)).any() or (p < 1).any())


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 integer hash on int64 tensors holding values in [0, 2^32)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def counter_uniforms(seed: torch.Tensor, sample_index: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) (multiples of 2^-24), a pure function of (seed, sample index, token index).

    All arguments are int64 tensors of the same shape (N,); `seed` may use all 64 bits. On CPU one C++ pass
    (`cpu_kernels.counter_uniforms`, the same integer arithmetic), else the tensor ops below.
    """
    if seed.device.type == "cpu" and cpu_kernels.load() is not None:
        return cpu_kernels.counter_uniforms(seed.long().contiguous(), sample_index.long().contiguous(), step.long().contiguous())
    return _counter_uniforms_eager(seed, sample_index, step)


def _counter_uniforms_eager(seed: torch.Tensor, sample_index: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    seed = seed.long()
    h = _hash32(step.long() ^ 0x5BD1E995)
    h = _hash32(h ^ sample_index.long())
    h = _hash32(h ^ (seed & _M32))
    h = _hash32(h ^ ((seed >> 32) & _M32))
    return (h >> 8).double() / float(1 << 24)


def sample_with_seed(logits, temperature, top_k, top_p, seed, sample_index, step):
    """Convenience: process -> draw with counter uniforms. Returns (tokens (N,), logprobs of them (N,))."""
    logprobs = process_logits(logits, temperature, top_k, top_p)
    u = counter_uniforms(torch.as_tensor(seed).expand(logits.shape[0]), torch.as_tensor(sample_index).expand(logits.shape[0]),
                         torch.as_tensor(step).expand(logits.shape[0]))
    tokens = sample(logprobs, u.to(logprobs.device))
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
