"""Offline preference losses (docs/algorithms.md). One signature:

    f(policy_chosen_logps (B,), policy_rejected_logps (B,), ref_chosen_logps (B,) | None,
      ref_rejected_logps (B,) | None, **hp) -> (loss (B,), metrics)

Inputs are *summed* log-probs of the completion tokens (mask applied upstream). Losses that need
average (per-token) log-probs — orpo, simpo, dpo_norm, and rpo's NLL term — take
`chosen_lengths` / `rejected_lengths` (B,) (completion token counts) and divide. Reference-free
losses (orpo, simpo) accept None for the reference arguments. `kto` is unpaired: its "chosen" are
the desirable examples (B_d,) and "rejected" the undesirable ones (B_u,), B_d ≠ B_u allowed.

Notation: implicit reward r̂ = β (log πθ − log πref); h = (log πθ(y_w) − log πref(y_w))
− (log πθ(y_l) − log πref(y_l)). Metrics (0-dim, detached): rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies (r̂_w > r̂_l), logps/chosen, logps/rejected, and
kl = E[log πθ(y_w) − log πref(y_w)] = E[r̂_w]/β (past 2–3 nats, check the policy with a judge).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.algos.registry import preference_losses as registry


def _metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected, kl):
    cr, rr = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": cr.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/margins": (cr - rr).mean(),
        "rewards/accuracies": (cr > rr).float().mean(),
        "logps/chosen": policy_chosen.detach().mean(),
        "logps/rejected": policy_rejected.detach().mean(),
        "kl": kl.detach().mean(),
    }


def _need(name, value, loss):
    if value is None:
        raise ValueError(f"preference loss {loss!r} needs {name}")
    return value


def _logratios(pc, pr, rc, rr, loss):
    rc, rr = _need("ref_chosen_logps", rc, loss), _need("ref_rejected_logps", rr, loss)
    return pc - rc.detach(), pr - rr.detach()  # (B,), (B,)


@registry.register("dpo", reference=True)
def dpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
        beta: float = 0.1, label_smoothing: float = 0.0):
    """DPO (Rafailov et al. 2023, eq. 7): L = −log σ(β h), β = 0.1.

    With label_smoothing ε > 0: conservative DPO (cDPO, Mitchell 2023), labels flipped with
    probability ε:  L = −(1−ε) log σ(βh) − ε log σ(−βh).
    ∂L/∂h = −β σ(−βh) = −β σ(r̂_l − r̂_w) for ε = 0 (the DPO gradient weight)."""
    cw, cl = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, "dpo")
    z = beta * (cw - cl)  # (B,)  β h
    loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return loss, _metrics(beta * cw, beta * cl, policy_chosen_logps, policy_rejected_logps, cw)


@registry.register("robust_dpo", reference=True)
def robust_dpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
               beta: float = 0.1, label_smoothing: float = 0.1):
    """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO", eq. 8): unbiased under label-flip
    rate ε < ½:   L = [(1−ε)(−log σ(βh)) − ε(−log σ(−βh))] / (1 − 2ε)."""
    eps = label_smoothing
    if not 0 <= eps < 0.5:
        raise ValueError("robust_dpo needs 0 <= label_smoothing < 0.5")
    cw, cl = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, "robust_dpo")
    z = beta * (cw - cl)
    loss = ((1 - eps) * -F.logsigmoid(z) - eps * -F.logsigmoid(-z)) / (1 - 2 * eps)
    return loss, _metrics(beta * cw, beta * cl, policy_chosen_logps, policy_rejected_logps, cw)


@registry.register("ipo", reference=True)
def ipo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
        beta: float = 0.1):
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm...", eq. 17 with τ = β):
    L = (h − 1/(2β))², minimised at h = 1/(2β) (it does not push h to infinity like DPO).
    TRL feeds per-token average log-probs here; pass those if you want TRL's numbers."""
    cw, cl = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, "ipo")
    loss = (cw - cl - 1.0 / (2.0 * beta)) ** 2
    return loss, _metrics(beta * cw, beta * cl, policy_chosen_logps, policy_rejected_logps, cw)


@registry.register("kto", reference=True, paired=False)
def kto(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
        kl: torch.Tensor | float, beta: float = 0.1, desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0):
    """KTO (Ethayarajh et al. 2024, eq. 8), unpaired. r_θ = log πθ(y|x) − log πref(y|x); z0 = `kl`,
    the reference point: a detached estimate of KL(πθ‖πref) (the paper: mismatched (x, y') pairs
    of the batch, clamped at 0 — computed by the caller and passed in):

        desirable:    L = λ_D (1 − σ(β (r_θ − z0)))
        undesirable:  L = λ_U (1 − σ(β (z0 − r_θ)))

    Returns the losses concatenated: (B_d + B_u,), desirable first. β = 0.1, λ_D = λ_U = 1
    (the paper: keep λ_D n_D / (λ_U n_U) in [1, 4/3])."""
    cw, cl = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, "kto")
    z0 = torch.as_tensor(kl, dtype=cw.dtype, device=cw.device).detach().clamp(min=0)
    loss_d = desirable_weight * (1 - torch.sigmoid(beta * (cw - z0)))  # (B_d,)
    loss_u = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - cl)))  # (B_u,)
    loss = torch.cat([loss_d, loss_u])
    cr, rr = (beta * cw).detach(), (beta * cl).detach()
    nan = cw.new_tensor(float("nan"))
    metrics = {
        "rewards/chosen": cr.mean() if cr.numel() else nan,
        "rewards/rejected": rr.mean() if rr.numel() else nan,
        "rewards/margins": (cr.mean() - rr.mean()) if cr.numel() and rr.numel() else nan,
        "logps/chosen": policy_chosen_logps.detach().mean() if cr.numel() else nan,
        "logps/rejected": policy_rejected_logps.detach().mean() if rr.numel() else nan,
        "kl": z0,
    }
    return loss, metrics


@registry.register("orpo", reference=False)
def orpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps=None, ref_rejected_logps=None, *,
         chosen_lengths, rejected_lengths, lam: float = 0.1):
    """ORPO (Hong et al. 2024, eq. 6–7), no reference model. With average log-probs
    ā = log P(y|x)/|y| and odds(y) = P/(1−P), P = exp(ā):

        L = −ā_w  +  λ · (−log σ(log odds(y_w) − log odds(y_l)))
        log odds = ā − log(1 − exp(ā))

    λ = 0.1 (TRL's `beta`). The NLL term is the chosen completion's per-token average (the paper's
    L_SFT); TRL averages over all chosen tokens of the batch instead (token_mean across rows).
    rewards/* metrics are λ·ā (TRL's convention)."""
    aw = policy_chosen_logps / chosen_lengths  # (B,)  ā_w
    al = policy_rejected_logps / rejected_lengths
    # log(1 − e^a) for a < 0, computed stably; clamp keeps a = 0 (P = 1) finite
    log_odds = (aw - torch.log1p(-torch.exp(aw).clamp(max=1 - 1e-7))) - (
        al - torch.log1p(-torch.exp(al).clamp(max=1 - 1e-7)))
    or_loss = -F.logsigmoid(log_odds)
    loss = -aw + lam * or_loss
    m = _metrics(lam * aw, lam * al, policy_chosen_logps, policy_rejected_logps, aw.new_tensor(float("nan")))
    m["orpo/log_odds_ratio"] = log_odds.detach().mean()
    m["orpo/nll"] = (-aw).detach().mean()
    del m["kl"]  # no reference model
    return loss, m


@registry.register("simpo", reference=False)
def simpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps=None, ref_rejected_logps=None, *,
          chosen_lengths, rejected_lengths, beta: float = 2.0, gamma: float = 1.0,
          label_smoothing: float = 0.0):
    """SimPO (Meng et al. 2024, eq. 6), no reference model, length-normalised:

        L = −log σ( β/|y_w| log πθ(y_w) − β/|y_l| log πθ(y_l) − γ )

    β = 2.0, γ = 1.0 (γ/β = 0.5; the paper tunes β ∈ [2, 10] and γ/β ∈ [0.3, 0.8] per model).
    label_smoothing as in cDPO (the SimPO code supports it)."""
    cr = beta * policy_chosen_logps / chosen_lengths  # (B,)
    rr = beta * policy_rejected_logps / rejected_lengths
    z = cr - rr - gamma
    loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    m = _metrics(cr, rr, policy_chosen_logps, policy_rejected_logps, cr)
    del m["kl"]  # no reference model
    return loss, m


@registry.register("rpo", reference=True)
def rpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
        chosen_lengths, beta: float = 0.1, alpha: float = 0.2):
    """RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 1): DPO plus a
    length-normalised NLL on the chosen completion,

        L = −log σ(β h) + α · (−log πθ(y_w)/|y_w|),   α = 0.2 (Llama 3, Dubey et al. 2024 §4.1.4).

    Pang et al. use α = 1; the Llama 3 report's 0.2 is the default here."""
    loss, m = dpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=beta)
    nll = -policy_chosen_logps / chosen_lengths  # (B,)
    m["rpo/nll"] = nll.detach().mean()
    return loss + alpha * nll, m


@registry.register("dpo_norm", reference=True)
def dpo_norm(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
             chosen_lengths, rejected_lengths, beta: float = 5.0):
    """Length-normalised DPO (Tülu 3, Lambert et al. 2024 §5.3; open-instruct `dpo_norm`):

        L = −log σ( β/|y_w| (log πθ(y_w) − log πref(y_w)) − β/|y_l| (log πθ(y_l) − log πref(y_l)) )

    β = 5 (Tülu 3's value for this loss: normalised log ratios are per token, so β is larger)."""
    cw, cl = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, "dpo_norm")
    cw, cl = cw / chosen_lengths, cl / rejected_lengths  # per-token log ratios (B,)
    loss = -F.logsigmoid(beta * (cw - cl))
    # kl: per-token log ratio on chosen (a per-token KL estimate, not per sequence)
    return loss, _metrics(beta * cw, beta * cl, policy_chosen_logps, policy_rejected_logps, cw)
