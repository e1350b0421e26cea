"""Preference losses and the Bradley–Terry RM loss: hand values from the papers' formulas,
DPO gradient weight, IPO minimum, KTO reference point."""

import math

import pytest
import torch

import posttrain.algos as A

logsig = lambda x: -math.log1p(math.exp(-x))  # log σ(x)
sig = lambda x: 1 / (1 + math.exp(-x))


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


def _pair(pc=-10.0, pr=-12.0, rc=-11.0, rr=-11.0):
    t = lambda v: torch.tensor([v])
    return t(pc).requires_grad_(), t(pr).requires_grad_(), t(rc), t(rr)


def test_dpo_hand_value_and_metrics():
    pc, pr, rc, rr = _pair()  # chosen log ratio +1, rejected −1, h = 2
    loss, m = A.preference_losses.get("dpo")(pc, pr, rc, rr, beta=0.1)
    close(loss, [-logsig(0.2)])
    close(m["rewards/chosen"], 0.1)
    close(m["rewards/rejected"], -0.1)
    close(m["rewards/margins"], 0.2)
    close(m["rewards/accuracies"], 1.0)
    close(m["kl"], 1.0)  # E[r̂_w]/β
    close(m["logps/chosen"], -10.0)


def test_dpo_gradient_weight_is_sigmoid_of_reward_gap():
    g = torch.Generator().manual_seed(0)
    pc, pr = (torch.randn(16, generator=g) * 3).requires_grad_(), (torch.randn(16, generator=g) * 3).requires_grad_()
    rc, rr = torch.randn(16, generator=g) * 3, torch.randn(16, generator=g) * 3
    beta = 0.3
    loss, _ = A.preference_losses.get("dpo")(pc, pr, rc, rr, beta=beta)
    loss.sum().backward()
    rw, rl = beta * (pc - rc).detach(), beta * (pr - rr).detach()
    weight = torch.sigmoid(rl - rw)  # σ(r̂_l − r̂_w)
    close(pc.grad, -beta * weight)
    close(pr.grad, beta * weight)


def test_cdpo_and_robust_dpo():
    pc, pr, rc, rr = _pair()
    loss, _ = A.preference_losses.get("dpo")(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1)
    close(loss, [-0.9 * logsig(0.2) - 0.1 * logsig(-0.2)])
    loss, _ = A.preference_losses.get("robust_dpo")(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1)
    close(loss, [(0.9 * -logsig(0.2) - 0.1 * -logsig(-0.2)) / 0.8])
    loss0, _ = A.preference_losses.get("robust_dpo")(pc, pr, rc, rr, label_smoothing=0.0)
    close(loss0, A.preference_losses.get("dpo")(pc, pr, rc, rr)[0])
    with pytest.raises(ValueError):
        A.preference_losses.get("robust_dpo")(pc, pr, rc, rr, label_smoothing=0.5)


def test_ipo_minimum_at_half_inverse_beta():
    beta = 0.1  # target h = 1/(2β) = 5
    h = torch.tensor([4.0, 5.0, 6.0])
    pc = h.clone().requires_grad_()
    zeros = torch.zeros(3)
    loss, _ = A.preference_losses.get("ipo")(pc, zeros.clone().requires_grad_(), zeros, zeros, beta=beta)
    close(loss, [1.0, 0.0, 1.0])
    loss.sum().backward()
    close(pc.grad, [-2.0, 0.0, 2.0])  # ∂/∂h (h − 5)² = 2(h − 5)


def test_kto_reference_point():
    pc = torch.tensor([-5.0])  # desirable, log ratio +1 vs ref −6
    pr = torch.tensor([-8.0, -3.0])  # undesirable, log ratios −1 and +0.5
    rc, rr = torch.tensor([-6.0]), torch.tensor([-7.0, -3.5])
    loss, m = A.preference_losses.get("kto")(pc, pr, rc, rr, kl=0.3, beta=0.1, desirable_weight=1.0,
                                             undesirable_weight=2.0)
    close(loss, [1 - sig(0.1 * (1 - 0.3)), 2 * (1 - sig(0.1 * (0.3 + 1))), 2 * (1 - sig(0.1 * (0.3 - 0.5)))])
    close(m["kl"], 0.3)
    close(m["rewards/chosen"], 0.1)
    loss_neg, m_neg = A.preference_losses.get("kto")(pc, pr, rc, rr, kl=-1.0)  # z0 clamped at 0
    close(loss_neg[:1], [1 - sig(0.1)])
    close(m_neg["kl"], 0.0)
    assert A.preference_losses.meta("kto")["paired"] is False


def test_orpo_hand_value():
    pc, pr = torch.tensor([-1.0]), torch.tensor([-3.0])
    lens = torch.tensor([2.0])
    loss, m = A.preference_losses.get("orpo")(pc, pr, None, None, chosen_lengths=lens, rejected_lengths=lens, lam=0.1)
    aw, al = -0.5, -1.5  # average log-probs
    log_odds = (aw - math.log(1 - math.exp(aw))) - (al - math.log(1 - math.exp(al)))
    close(loss, [0.5 + 0.1 * -logsig(log_odds)])
    close(m["orpo/log_odds_ratio"], log_odds)
    assert "kl" not in m


def test_simpo_hand_value():
    pc, pr = torch.tensor([-4.0]), torch.tensor([-9.0])
    loss, m = A.preference_losses.get("simpo")(pc, pr, None, None, chosen_lengths=torch.tensor([4.0]),
                                               rejected_lengths=torch.tensor([3.0]), beta=2.0, gamma=1.0)
    close(loss, [-logsig(2 * -1 - 2 * -3 - 1)])  # β/|y| log π: −2 and −6, margin γ = 1
    close(m["rewards/margins"], 4.0)


def test_rpo_adds_length_normalised_nll():
    pc, pr, rc, rr = _pair()
    loss, m = A.preference_losses.get("rpo")(pc, pr, rc, rr, chosen_lengths=torch.tensor([5.0]))
    close(loss, [-logsig(0.2) + 0.2 * 10 / 5])
    close(m["rpo/nll"], 2.0)
    with pytest.raises(TypeError):
        A.preference_losses.get("rpo")(pc, pr, rc, rr)  # lengths are required


def test_dpo_norm_hand_value():
    pc, pr, rc, rr = _pair(pc=-10.0, pr=-12.0, rc=-12.0, rr=-9.0)  # log ratios +2 (len 4), −3 (len 6)
    loss, m = A.preference_losses.get("dpo_norm")(pc, pr, rc, rr, chosen_lengths=torch.tensor([4.0]),
                                                  rejected_lengths=torch.tensor([6.0]), beta=5.0)
    close(loss, [-logsig(5 * (0.5 + 0.5))])
    close(m["rewards/chosen"], 2.5)


def test_reference_losses_require_reference():
    pc, pr, _, _ = _pair()
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        A.preference_losses.get("dpo")(pc, pr, None, None)


def test_bradley_terry_loss():
    rw, rl = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    loss, m = A.bradley_terry_loss(rw, rl)
    close(loss, [-logsig(1.0), -logsig(-1.0)])
    close(m["rm/accuracy"], 0.5)
    loss, _ = A.bradley_terry_loss(rw, rl, margin=torch.tensor([0.5, 0.0]), center_coef=0.01)
    close(loss, [-logsig(0.5) + 0.01 * 9, -logsig(-1.0) + 0.01 * 1])
