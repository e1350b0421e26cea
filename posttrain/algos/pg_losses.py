"""Policy-gradient losses (docs/algorithms.md). One signature:

    f(logp (B, T), old_logp (B, T), advantages (B, T) or (B,), mask (B, T), **hp)
        -> (per-token loss (B, T), metrics)

The loss is 0 where mask is 0; reducing it to a scalar is `posttrain.algos.aggregate.aggregate`'s
job (token-mean, seq-mean-token-mean, constant norm). logp carries the gradient; old_logp (the
policy that produced the rollout, as recomputed by the trainer) is treated as a constant.

Ratio r_t = πθ/πold = exp(logp − old_logp), computed from the masked log ratio so padded positions
cannot overflow exp(). A (B,) advantage is broadcast over the sequence's tokens.

Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
You Off-Policy RL Training") is available to every loss: with `behaviour_logp` (the inference
engine's log-probs of the sampled tokens) each token's loss is multiplied by the constant
w_t = min(πold/πbehaviour, tis_cap), correcting the trainer/engine mismatch.

Metrics (0-dim tensors, detached): clip_frac/low, clip_frac/high (fraction of loss tokens whose
gradient the clip removed), ratio/mean, ratio/min, ratio/max, approx_kl = mean k3 estimate of
KL(πold ‖ πθ) = E[(r − 1) − log r] (tokens sampled from πold), and tis/* when TIS is on.
"""

from __future__ import annotations

import torch

from posttrain.algos.registry import policy_losses as registry
from posttrain.ops.masked import masked_mean


def _prepare(logp, old_logp, advantages, mask):
    if logp.shape != old_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(
            f"logp, old_logp, mask must share one (B, T) shape; got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # (B,) -> (B, 1), broadcast over T
    adv = advantages.detach().to(logp.dtype).expand_as(logp)  # (B, T)
    keep = mask.bool()
    log_ratio = torch.where(keep, logp - old_logp.detach(), torch.zeros_like(logp))  # (B, T)
    return adv, keep, mask.to(logp.dtype), log_ratio


def _ratio_metrics(ratio, log_ratio, m, keep, low, high):
    r = ratio.detach()
    big = torch.finfo(r.dtype).max
    lr = log_ratio.detach()
    return {
        "clip_frac/low": masked_mean(low.to(r.dtype), m),
        "clip_frac/high": masked_mean(high.to(r.dtype), m),
        "ratio/mean": masked_mean(r, m),
        "ratio/min": torch.where(keep, r, torch.full_like(r, big)).min(),
        "ratio/max": torch.where(keep, r, torch.full_like(r, -big)).max(),
        "approx_kl": masked_mean(torch.expm1(lr) - lr, m),
    }


def _finish(loss, m, metrics, old_logp, behaviour_logp, tis_cap):
    """Apply TIS (optional) and zero masked positions."""
    if behaviour_logp is not None:
        log_w = torch.where(m.bool(), old_logp.detach() - behaviour_logp.detach(), torch.zeros_like(loss))
        w = torch.exp(log_w)  # πold / πbehaviour  (B, T)
        w_trunc = w.clamp(max=tis_cap)
        loss = loss * w_trunc
        metrics["tis/weight_mean"] = masked_mean(w, m).detach()
        metrics["tis/truncated_frac"] = masked_mean((w > tis_cap).to(loss.dtype), m).detach()
    return torch.where(m.bool(), loss, torch.zeros_like(loss)), metrics


def _clipped_surrogate(ratio, adv, eps_low, eps_high):
    """PPO: max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)) per token (the negated min of surrogates)."""
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(pg1, pg2)


@registry.register("ppo")
def ppo(logp, old_logp, advantages, mask, *, eps: float = 0.2, eps_low: float | None = None,
        eps_high: float | None = None, behaviour_logp=None, tis_cap: float = 2.0):
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), per token:

        L_t = −min(r_t A_t, clip(r_t, 1−ε_low, 1+ε_high) A_t),   ε_low = ε_high = ε = 0.2

    Unclipped (1−ε ≤ r ≤ 1+ε) it equals −A·r."""
    eps_low = eps if eps_low is None else eps_low
    eps_high = eps if eps_high is None else eps_high
    adv, keep, m, log_ratio = _prepare(logp, old_logp, advantages, mask)
    ratio = torch.exp(log_ratio)  # (B, T)
    loss = _clipped_surrogate(ratio, adv, eps_low, eps_high)
    low = (adv < 0) & (ratio < 1 - eps_low)  # clip active: no gradient
    high = (adv > 0) & (ratio > 1 + eps_high)
    metrics = _ratio_metrics(ratio, log_ratio, m, keep, low, high)
    return _finish(loss, m, metrics, old_logp, behaviour_logp, tis_cap)


@registry.register("clip_higher")
def clip_higher(logp, old_logp, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.28,
                behaviour_logp=None, tis_cap: float = 2.0):
    """DAPO's decoupled clip ("Clip-Higher", Yu et al. 2025 §3.1): PPO with ε_low = 0.2, ε_high = 0.28,
    so low-probability tokens can grow further (against entropy collapse)."""
    return ppo(logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
               behaviour_logp=behaviour_logp, tis_cap=tis_cap)


@registry.register("dual_clip")
def dual_clip(logp, old_logp, advantages, mask, *, eps: float = 0.2, eps_low: float | None = None,
              eps_high: float | None = None, clip_c: float = 3.0, behaviour_logp=None, tis_cap: float = 2.0):
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5): for A < 0 the
    objective is also bounded below by c·A, so a huge ratio on a bad token cannot blow up the loss:

        A < 0:  L_t = min(L_t^PPO, −c·A_t)   (≤ c·|A_t|),   c = 3 > 1
        A ≥ 0:  L_t = L_t^PPO"""
    if clip_c <= 1.0:
        raise ValueError("dual clip needs c > 1")
    eps_low = eps if eps_low is None else eps_low
    eps_high = eps if eps_high is None else eps_high
    adv, keep, m, log_ratio = _prepare(logp, old_logp, advantages, mask)
    ratio = torch.exp(log_ratio)
    ppo_loss = _clipped_surrogate(ratio, adv, eps_low, eps_high)
    bound = -clip_c * adv  # (B, T)
    loss = torch.where(adv < 0, torch.minimum(ppo_loss, bound), ppo_loss)
    low = (adv < 0) & (ratio < 1 - eps_low)
    high = (adv > 0) & (ratio > 1 + eps_high)
    metrics = _ratio_metrics(ratio, log_ratio, m, keep, low, high)
    metrics["clip_frac/dual"] = masked_mean(((adv < 0) & (ratio > clip_c)).to(ratio.dtype), m)
    return _finish(loss, m, metrics, old_logp, behaviour_logp, tis_cap)


@registry.register("gspo")
def gspo(logp, old_logp, advantages, mask, *, eps_low: float = 3e-4, eps_high: float = 4e-4,
         behaviour_logp=None, tis_cap: float = 2.0):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in its GSPO-token form (eq. 13–14):

        s_i     = exp( (1/|y_i|) Σ_t log(πθ/πold)(y_i,t) )                   sequence ratio  (B,)
        s_i,t   = sg[s_i] · πθ(y_i,t) / sg[πθ(y_i,t)]                       = s_i in value
        L_i,t   = −min(s_i,t A_i,t, clip(s_i,t, 1−ε_low, 1+ε_high) A_i,t)    clipped per sequence

    ∇ s_i,t = s_i ∇log πθ(y_i,t), so with a sequence advantage and `seq_mean_token_mean` aggregation
    the gradient equals the sequence-level GSPO objective's (1/G) Σ_i −min(s_i A_i, clip(s_i) A_i).
    (`token_mean` aggregation weights sequences by length instead: a deviation from the paper.)
    ε_low = 3e-4, ε_high = 4e-4 are the paper's values (ratios of geometric means are near 1).
    A (B, T) advantage is allowed (GSPO-token's point); the clip test then uses each token's sign."""
    adv, keep, m, log_ratio = _prepare(logp, old_logp, advantages, mask)
    n_tok = m.sum(-1)  # (B,)
    seq_log_ratio = log_ratio.sum(-1) / n_tok.clamp(min=1)  # (B,)  (1/|y_i|) Σ_t log r_i,t
    # token trick: value s_i, gradient s_i·∇logp_t
    log_s_tok = seq_log_ratio.detach()[:, None] + logp - logp.detach()  # (B, T)
    log_s_tok = torch.where(keep, log_s_tok, torch.zeros_like(log_s_tok))
    s_tok = torch.exp(log_s_tok)
    loss = _clipped_surrogate(s_tok, adv, eps_low, eps_high)
    low = (adv < 0) & (s_tok < 1 - eps_low)
    high = (adv > 0) & (s_tok > 1 + eps_high)
    metrics = _ratio_metrics(torch.exp(log_ratio), log_ratio, m, keep, low, high)
    metrics["seq_ratio/mean"] = masked_mean(torch.exp(seq_log_ratio.detach()), (n_tok > 0).to(m.dtype))
    return _finish(loss, m, metrics, old_logp, behaviour_logp, tis_cap)


@registry.register("cispo")
def cispo(logp, old_logp, advantages, mask, *, eps_low: float | None = None, eps_high: float = 0.28,
          behaviour_logp=None, tis_cap: float = 2.0):
    """CISPO (MiniMax 2025, "MiniMax-M1", §3.1 eq. 4): clip the importance-sampling weight, not the update.

        r̂_t = clip(r_t, 1 − ε_low, 1 + ε_high);     L_t = −sg(r̂_t) · A_t · log πθ(y_t)

    The gradient −sg(r̂_t) A_t ∇log πθ flows through every token (PPO's clip zeroes it for clipped
    tokens). The paper imposes no lower bound ("setting ε_low to a large value") and tunes only
    ε_high without publishing it: eps_low=None means no lower bound; eps_high = 0.28 follows the
    common open-source default (DAPO's ε_high). The loss *value* is −r̂·A·logp, not a surrogate of
    the same scale as PPO's: compare gradients, not loss values, across losses."""
    adv, keep, m, log_ratio = _prepare(logp, old_logp, advantages, mask)
    ratio = torch.exp(log_ratio)
    lo = None if eps_low is None else 1.0 - eps_low
    weight = ratio.clamp(min=lo, max=1.0 + eps_high).detach()  # sg(r̂)  (B, T)
    safe_logp = torch.where(keep, logp, torch.zeros_like(logp))
    loss = -weight * adv * safe_logp
    low = (ratio < lo) if lo is not None else torch.zeros_like(keep)
    high = ratio > 1.0 + eps_high
    metrics = _ratio_metrics(ratio, log_ratio, m, keep, low, high)
    return _finish(loss, m, metrics, old_logp, behaviour_logp, tis_cap)


def vanishes_at_zero_advantage(loss_fn, tis_cap: float | None = None, **hp) -> bool:
    """Whether `loss_fn`'s gradient is exactly 0 when every advantage is 0, probed on random log-probs with ratios
    far from 1 and a masked tail (`hp`: the run's loss arguments; `tis_cap`: TIS on, as the step passes it). Every
    loss above is linear in A (so is TIS's weight): then a group of zero advantages adds nothing to a step's
    gradient (recipes/rl `zero_advantage`). A registered loss with a term of its own (an entropy or KL term) fails."""
    g = torch.Generator().manual_seed(0)
    logp = (-3 * torch.rand(4, 6, generator=g)).requires_grad_()  # (B, T)
    old = logp.detach() + 0.5 * torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    if tis_cap:
        hp = {**hp, "behaviour_logp": old + 0.3 * torch.randn(4, 6, generator=g), "tis_cap": tis_cap}
    loss, _ = loss_fn(logp, old, torch.zeros(4), mask, **hp)
    if not loss.requires_grad:
        return True
    (grad,) = torch.autograd.grad(loss.sum(), logp, allow_unused=True)
    return grad is None or bool((grad == 0).all())


def value_loss(values, old_values, returns, mask, *, clip: float | None = 0.2):
    """PPO clipped value loss (Schulman et al. 2017 baselines; InstructGPT/OpenAI lm-human-preferences):

        V_clip = V_old + clip(V − V_old, −c, c)
        L_t    = ½ · max((V − R)², (V_clip − R)²)          c = 0.2;  clip=None -> ½ (V − R)²

    Shapes (B, T); returns (per-token loss (B, T), 0 where mask is 0; metrics: vf/clip_frac,
    vf/values_mean, vf/explained_var = 1 − Var(R − V)/Var(R) over mask tokens)."""
    m = mask.to(values.dtype)
    keep = mask.bool()
    returns = returns.detach()
    err = (values - returns) ** 2
    if clip is None:
        loss = 0.5 * err
        clipped = torch.zeros_like(keep)
    else:
        old = old_values.detach()
        v_clip = old + (values - old).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(err, err_clip)
        clipped = err_clip > err
    v = values.detach()
    var_r = masked_mean((returns - masked_mean(returns, m)) ** 2, m)
    resid = returns - v
    var_e = masked_mean((resid - masked_mean(resid, m)) ** 2, m)
    metrics = {
        "vf/clip_frac": masked_mean(clipped.to(v.dtype), m),
        "vf/values_mean": masked_mean(v, m),
        "vf/explained_var": 1.0 - var_e / var_r,
    }
    return torch.where(keep, loss, torch.zeros_like(loss)), metrics
