"""Logit-level distillation losses (docs/distill.md), per token. One signature:

    f(student_logits (B, T, V), mask (B, T), *, teacher_logits (B, T, V) = None,
      teacher_topk_logps (B, T, k) = None, teacher_topk_ids (B, T, k) long = None,
      teacher_tail_logp (B, T) = None, temperature = 1.0, **hp) -> (per-token loss (B, T), metrics)

P = teacher distribution, Q = student distribution at each position (softmax of logits / τ):

    forward_kl   KL(P ‖ Q) = Σ_v P log(P/Q)          mode covering (classic KD, Hinton et al. 2015)
    reverse_kl   KL(Q ‖ P) = Σ_v Q log(Q/P)          mode seeking (MiniLLM, Gu et al. 2024)
    jsd          JSD(β) = β KL(P ‖ M) + (1−β) KL(Q ‖ M),  M = β P + (1−β) Q      (GKD, Agarwal et
                 al. 2024, eq. 3); 0 < β < 1, default 0.5. As β → 0 it behaves like β·forward KL,
                 as β → 1 like (1−β)·reverse KL: use forward_kl / reverse_kl for the end points
                 (TRL special-cases β ∈ {0, 1} to those inside its jsd).

Top-k teacher (stored k = 64 log-probs per token): the divergence is taken on the k-token support
S of the teacher, with BOTH distributions renormalised on S:

    P̃(v) = P(v) / Σ_{u∈S} P(u),   Q̃(v) = Q(v) / Σ_{u∈S} Q(u),    v ∈ S

so each loss is an exact divergence between the two conditional distributions on S (≥ 0, 0 iff
they agree on S); the student mass outside S gets no gradient.

Top-k with a tail bucket (`teacher_tail_logp` = log Σ_{v∉S} P(v), the teacher cache of `posttrain
distill mode=logit`): the divergence is taken on the coarser partition S ∪ {tail}, k + 1 outcomes:

    P̄ = (P(v) for v ∈ S, Σ_{v∉S} P(v)),   Q̄ = (Q(v) for v ∈ S, Σ_{v∉S} Q(v))

Nothing is renormalised (the stored P̄ is renormalised over its k + 1 entries only to absorb the
rounding of a 16-bit cache), so the loss is exactly the divergence of the coarsened distributions
(by the data-processing inequality ≤ the full-vocabulary divergence, equal when k = V), and the
student mass outside S is pushed toward the teacher's tail mass.

Temperature: the teacher's stored log-probs are used as given (they were computed at whatever
temperature the teacher used); `temperature` divides the student logits (and full teacher logits).

The loss is 0 where mask is 0; aggregate with `posttrain.algos.aggregate.aggregate`.
On-policy distillation (GKD) uses the same functions on student-sampled sequences.
Metrics: distill/loss (mean over mask tokens), distill/top1_agree (full logits only).
"""

from __future__ import annotations

import torch

from posttrain.algos.registry import distill_losses as registry
from posttrain.ops.masked import masked_mean


def _log_dists(student_logits, teacher_logits, teacher_topk_logps, teacher_topk_ids, temperature,
               teacher_tail_logp=None):
    """-> (log Q (B, T, K), log P (B, T, K)) on a common support: the full vocabulary, top-k, or
    top-k plus the tail bucket (K = k + 1)."""
    log_q = torch.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, T, V)
    if teacher_logits is not None:
        if teacher_logits.shape != student_logits.shape:
            raise ValueError(
                f"teacher and student logits differ in shape {tuple(teacher_logits.shape)} vs "
                f"{tuple(student_logits.shape)}: logit distillation needs the same tokenizer/vocabulary"
            )
        log_p = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
        return log_q, log_p
    if teacher_topk_logps is None or teacher_topk_ids is None:
        raise ValueError("distillation needs teacher_logits, or teacher_topk_logps with teacher_topk_ids")
    log_q_s = log_q.gather(-1, teacher_topk_ids)  # (B, T, k)
    lp = teacher_topk_logps.detach().float()
    if teacher_tail_logp is not None:  # coarse partition S ∪ {tail}: (B, T, k + 1)
        rest = log_q.scatter(-1, teacher_topk_ids, float("-inf"))  # log Q with S removed
        log_q_tail = torch.logsumexp(rest, dim=-1, keepdim=True)  # log Σ_{v∉S} Q(v)  (B, T, 1)
        log_p_bar = torch.cat([lp, teacher_tail_logp.detach().float()[..., None]], dim=-1)
        log_p_bar = log_p_bar - torch.logsumexp(log_p_bar, dim=-1, keepdim=True)  # absorbs cache rounding
        # an empty tail (k = V) is -inf on both sides: a finite floor keeps 0·log 0 terms free of NaN gradients
        floor = -1e4
        return torch.cat([log_q_s, log_q_tail], dim=-1).clamp(min=floor), log_p_bar.clamp(min=floor)
    log_q_s = log_q_s - torch.logsumexp(log_q_s, dim=-1, keepdim=True)  # renormalise Q on S
    log_p_s = lp - torch.logsumexp(lp, dim=-1, keepdim=True)  # renormalise P on S
    return log_q_s, log_p_s


def _kl(log_a, log_b):
    """KL(A ‖ B) = Σ_v A (log A − log B) over the last dim, with 0 log 0 = 0  # (B, T)."""
    a = log_a.exp()
    term = torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a))
    return term.sum(-1)


def _finish(loss, mask, log_q, log_p, topk):
    m = mask.to(loss.dtype)
    loss = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    metrics = {"distill/loss": masked_mean(loss.detach(), m)}
    if not topk:
        agree = (log_q.detach().argmax(-1) == log_p.argmax(-1)).to(loss.dtype)
        metrics["distill/top1_agree"] = masked_mean(agree, m)
    return loss, metrics


@registry.register("forward_kl")
def forward_kl(student_logits, mask, *, teacher_logits=None, teacher_topk_logps=None, teacher_topk_ids=None,
               teacher_tail_logp=None, temperature: float = 1.0):
    """KL(P_teacher ‖ Q_student) per token  # (B, T)."""
    log_q, log_p = _log_dists(student_logits, teacher_logits, teacher_topk_logps, teacher_topk_ids, temperature,
                              teacher_tail_logp)
    return _finish(_kl(log_p, log_q), mask, log_q, log_p, teacher_logits is None)


@registry.register("reverse_kl")
def reverse_kl(student_logits, mask, *, teacher_logits=None, teacher_topk_logps=None, teacher_topk_ids=None,
               teacher_tail_logp=None, temperature: float = 1.0):
    """KL(Q_student ‖ P_teacher) per token  # (B, T)."""
    log_q, log_p = _log_dists(student_logits, teacher_logits, teacher_topk_logps, teacher_topk_ids, temperature,
                              teacher_tail_logp)
    return _finish(_kl(log_q, log_p), mask, log_q, log_p, teacher_logits is None)


@registry.register("jsd")
def jsd(student_logits, mask, *, teacher_logits=None, teacher_topk_logps=None, teacher_topk_ids=None,
        teacher_tail_logp=None, temperature: float = 1.0, beta: float = 0.5):
    """Generalised JSD(β) = β KL(P ‖ M) + (1−β) KL(Q ‖ M), M = βP + (1−β)Q, 0 < β < 1  # (B, T)."""
    if not 0.0 < beta < 1.0:
        raise ValueError("jsd needs 0 < beta < 1 (use forward_kl for beta -> 0, reverse_kl for beta -> 1)")
    log_q, log_p = _log_dists(student_logits, teacher_logits, teacher_topk_logps, teacher_topk_ids, temperature,
                              teacher_tail_logp)
    b = torch.tensor(beta, dtype=log_q.dtype, device=log_q.device)
    log_m = torch.logsumexp(torch.stack([log_p + b.log(), log_q + torch.log1p(-b)]), dim=0)  # log M
    loss = beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    return _finish(loss, mask, log_q, log_p, teacher_logits is None)
