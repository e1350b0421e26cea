"""Policy losses: hand values, clip/dual-clip invariants, stop-gradient checks (CISPO, GSPO token
trick), TIS, masking, value loss."""

import math

import pytest
import torch

import posttrain.algos as A


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


def _tokens(ratios, advs):
    old = torch.full((1, len(ratios)), -1.0)
    logp = (old + torch.log(torch.tensor([ratios]))).requires_grad_()
    return logp, old, torch.tensor([advs]), torch.ones(1, len(ratios))


def test_ppo_hand_values_gradients_and_clip_fractions():
    logp, old, adv, m = _tokens([1.5, 1.5, 0.5, 0.5], [1.0, -1.0, 1.0, -1.0])
    loss, met = A.policy_losses.get("ppo")(logp, old, adv, m)
    # max(−A r, −A clip(r, .8, 1.2)): (+,1.5) -> −1.2 clipped; (−,1.5) -> 1.5; (+,.5) -> −.5; (−,.5) -> .8 clipped
    close(loss, [[-1.2, 1.5, -0.5, 0.8]])
    loss.sum().backward()
    close(logp.grad, [[0.0, 1.5, -0.5, 0.0]])  # d(−A r)/dlogp = −A r where unclipped, 0 where clipped
    close(met["clip_frac/high"], 0.25)
    close(met["clip_frac/low"], 0.25)
    close(met["ratio/max"], 1.5)
    close(met["ratio/min"], 0.5)
    close(met["ratio/mean"], 1.0)
    close(met["approx_kl"], ((0.5 - math.log(1.5)) * 2 + (-0.5 - math.log(0.5)) * 2) / 4)


def test_ppo_unclipped_equals_minus_adv_times_ratio():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    logp = old + (torch.rand(4, 6, generator=g) - 0.5) * 0.3  # |log r| < .15 -> r in (.86, 1.17)
    adv = torch.randn(4, generator=g)
    loss, met = A.policy_losses.get("ppo")(logp, old, adv, torch.ones(4, 6))
    close(loss, -adv[:, None] * torch.exp(logp - old))
    assert met["clip_frac/low"] == 0 and met["clip_frac/high"] == 0


def test_clip_higher_uses_decoupled_epsilons():
    logp, old, adv, m = _tokens([1.25, 0.75], [1.0, -1.0])
    close(A.policy_losses.get("ppo")(logp, old, adv, m)[0], [[-1.2, 0.8]])
    close(A.policy_losses.get("clip_higher")(logp, old, adv, m)[0], [[-1.25, 0.8]])  # 1.25 < 1.28 not clipped


def test_dual_clip_bound():
    logp, old, adv, m = _tokens([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, met = A.policy_losses.get("dual_clip")(logp, old, adv, m)
    close(loss, [[3.0, 2.0, -1.2]])  # min(5, 3·1); min(2, 3); positive A unchanged (PPO)
    close(met["clip_frac/dual"], 1 / 3)
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(8, 16, generator=g) * 3
    logp = old + torch.randn(8, 16, generator=g) * 2
    adv = torch.randn(8, 16, generator=g)
    loss, _ = A.policy_losses.get("dual_clip")(logp, old, adv, torch.ones(8, 16), clip_c=3.0)
    neg = adv < 0
    assert (loss[neg] <= 3.0 * adv.abs()[neg] + 1e-6).all()
    assert (loss[neg] > 3.0 * adv.abs()[neg] - 1e-6).any()  # the bound is attained somewhere
    ppo_loss, _ = A.policy_losses.get("ppo")(logp, old, adv, torch.ones(8, 16))
    close(loss[~neg], ppo_loss[~neg])


def test_cispo_gradient_is_clipped_weight_times_advantage():
    ratios = [1.5, 0.5, 1.1, 3.0]
    advs = [1.0, -1.0, -2.0, -0.5]
    logp, old, adv, m = _tokens(ratios, advs)
    old = old.clone().requires_grad_()
    loss, met = A.policy_losses.get("cispo")(logp, old, adv, m, eps_high=0.28)
    loss.sum().backward()
    w = torch.tensor([[1.28, 0.5, 1.1, 1.28]])  # clip(r, −∞, 1.28), no lower bound by default
    close(logp.grad, -w * adv)  # every token keeps a gradient, even the clipped ones
    assert old.grad is None or torch.count_nonzero(old.grad) == 0  # sg: nothing flows into old_logp
    close(met["clip_frac/high"], 0.5)
    # a PPO-clipped token (ratio 1.5, A > 0) has zero PPO gradient but a CISPO gradient
    logp2, old2, adv2, m2 = _tokens([1.5], [1.0])
    A.policy_losses.get("ppo")(logp2, old2, adv2, m2)[0].sum().backward()
    assert logp2.grad.item() == 0.0
    # with a lower bound
    logp3, old3, adv3, m3 = _tokens([0.5], [1.0])
    A.policy_losses.get("cispo")(logp3, old3, adv3, m3, eps_low=0.2)[0].sum().backward()
    close(logp3.grad, [[-0.8]])


def test_cispo_equals_ppo_gradient_when_unclipped():
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(3, 5, generator=g) * 3
    delta = (torch.rand(3, 5, generator=g) - 0.5) * 0.2
    adv = torch.randn(3, generator=g)
    grads = []
    for name in ("ppo", "cispo"):
        logp = (old + delta).requires_grad_()
        loss, _ = A.policy_losses.get(name)(logp, old, adv, torch.ones(3, 5))
        loss.sum().backward()
        grads.append(logp.grad)
    close(grads[0], grads[1])


def _gspo_sequence_reference(logp, old, adv, mask, eps_low, eps_high):
    """The paper's sequence-level objective: (1/G) Σ_i −min(s_i A_i, clip(s_i) A_i)."""
    m = mask.float()
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))  # (B,)
    obj = torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)
    return -obj.mean()


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.2)])
def test_gspo_token_trick_matches_sequence_gradient(eps):
    g = torch.Generator().manual_seed(4)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g) * 3
    scale = torch.tensor([1e-5, 1e-5, 0.5, 0.5, 1e-5, 0.5])[:, None]  # some sequences inside the clip, some out
    delta = torch.randn(B, T, generator=g) * scale
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(B, T)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    mask[5, 6:] = 0
    lp1 = (old + delta).requires_grad_()
    loss_tok, met = A.policy_losses.get("gspo")(lp1, old, adv, mask, eps_low=eps[0], eps_high=eps[1])
    total = A.aggregate(loss_tok, mask, "seq_mean_token_mean")
    total.backward()
    lp2 = (old + delta).requires_grad_()
    ref = _gspo_sequence_reference(lp2, old, adv, mask, *eps)
    ref.backward()
    close(total, ref.detach())
    close(lp1.grad, lp2.grad, tol=1e-6)
    assert torch.count_nonzero(lp1.grad) > 0


def test_gspo_clip_is_per_sequence():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.3, -0.3]])  # token ratios far outside 1 ± 4e-4, sequence ratio exactly 1
    loss, met = A.policy_losses.get("gspo")(logp, old, torch.tensor([1.0]), torch.ones(1, 2))
    close(loss, [[-1.0, -1.0]])
    assert met["clip_frac/high"] == 0 and met["clip_frac/low"] == 0
    close(met["seq_ratio/mean"], 1.0)


def test_tis_weight_truncated():
    logp, old, adv, m = _tokens([1.0, 1.0], [1.0, 1.0])
    behaviour = old - torch.tensor([[math.log(3.0), math.log(1.5)]])  # πold/πbeh = 3 (capped to 2), 1.5
    loss, met = A.policy_losses.get("ppo")(logp, old, adv, m, behaviour_logp=behaviour, tis_cap=2.0)
    close(loss, [[-2.0, -1.5]])
    close(met["tis/truncated_frac"], 0.5)
    close(met["tis/weight_mean"], 2.25)


@pytest.mark.parametrize("name", ["ppo", "dual_clip", "clip_higher", "gspo", "cispo"])
def test_masked_positions_are_zero_and_cannot_overflow(name):
    old = torch.tensor([[-1.0, -1.0, -1e4]])  # garbage old log-prob on padding: exp(logp − old) = inf
    logp = torch.tensor([[-0.9, -1.2, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    loss, met = A.policy_losses.get(name)(logp, old, torch.tensor([1.0]), mask)
    assert loss[0, 2] == 0 and torch.isfinite(loss).all()
    A.aggregate(loss, mask, "token_mean").backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0
    assert all(torch.isfinite(v) for v in met.values())
    assert met["ratio/max"] < 2


def test_value_loss_clipped():
    values = torch.tensor([[0.5, 1.1, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, met = A.value_loss(values, old, returns, mask, clip=0.2)
    # token 0: V_clip = .2 -> ½ max(.25, .64) = .32 (clipped: no gradient); token 1: ½ (.1)² = .005
    close(loss, [[0.32, 0.005, 0.0]])
    loss.sum().backward()
    close(values.grad, [[0.0, 0.1, 0.0]])
    close(met["vf/clip_frac"], 0.5)
    close(A.value_loss(values, old, returns, mask, clip=None)[0], [[0.125, 0.005, 0.0]])
