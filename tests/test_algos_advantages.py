"""Advantage estimators: hand-derived values on one small grouped batch, GAE against hand values
and a plain per-sequence reference, metrics."""

import math

import pytest
import torch

import posttrain.algos as A

# three groups with non-contiguous ids: 7 -> [1,0,0,1] (p=.5), 3 -> all pass, 5 -> [0,0,1,0] (p=.25)
R = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0])
G = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3, 5, 5, 5, 5])


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


def test_grpo_group_std():
    adv, m = A.advantages.get("grpo")(R, G)
    s7 = math.sqrt(1 / 3)  # unbiased std of [1,0,0,1]; group 5: std .5, mean .25
    close(adv, [0.5 / s7, -0.5 / s7, -0.5 / s7, 0.5 / s7, 0, 0, 0, 0, -0.5, -0.5, 1.5, -0.5])
    close(m["groups/zero_adv_frac"], 1 / 3)
    close(m["groups/all_pass_frac"], 1 / 3)
    close(m["groups/all_fail_frac"], 0.0)
    close(m["adv/mean"], adv.mean())
    assert set(m) >= {"adv/mean", "adv/std", "groups/zero_adv_frac"} and "reward/mean" not in m


def test_grpo_batch_and_none_and_dr_grpo():
    sb = math.sqrt(12 / 11 * (7 / 12) * (5 / 12))  # unbiased std of 7 ones and 5 zeros
    adv, _ = A.advantages.get("grpo")(R, G, std_scale="batch")
    close(adv[:4], [0.5 / sb, -0.5 / sb, -0.5 / sb, 0.5 / sb])
    centered = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.25, -0.25, 0.75, -0.25]
    close(A.advantages.get("grpo")(R, G, std_scale="none")[0], centered)
    close(A.advantages.get("dr_grpo")(R, G)[0], centered)
    with pytest.raises(ValueError):
        A.advantages.get("grpo")(R, G, std_scale="global")


def test_rloo_leave_one_out():
    adv, _ = A.advantages.get("rloo")(R, G)
    # group 7: 1 − (0+0+1)/3 = 2/3, 0 − 2/3; group 5: 1 − 0 = 1, 0 − 1/3
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0, -1 / 3, -1 / 3, 1, -1 / 3])
    with pytest.raises(ValueError, match="at least 2"):
        A.advantages.get("rloo")(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


def test_reinforce_pp_and_baseline():
    sb = math.sqrt(12 / 11 * (7 / 12) * (5 / 12))
    adv, _ = A.advantages.get("reinforce_pp")(R, G, whiten="sequence")
    close(adv, (R - 7 / 12) / sb)
    # token whitening with every length 1 is the sequence whitening
    close(A.advantages.get("reinforce_pp")(R, G, lengths=torch.ones(12))[0], (R - 7 / 12) / sb)
    centered = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.25, -0.25, 0.75, -0.25])
    sc = math.sqrt((4 * 0.25 + 3 * 0.0625 + 0.5625) / 11)  # mean of centred is 0
    close(A.advantages.get("reinforce_pp_baseline")(R, G, whiten="sequence")[0], centered / sc)
    close(A.advantages.get("reinforce_pp_baseline")(R, G, lengths=torch.ones(12))[0], centered / sc)


def test_learnability_weights():
    grpo, _ = A.advantages.get("grpo")(R, G)
    adv, m = A.advantages.get("learnability")(R, G)
    # 4p(1−p): group 7 p=.5 -> 1, group 3 p=1 -> 0, group 5 p=.25 -> .75
    w = torch.tensor([1.0] * 4 + [0.0] * 4 + [0.75] * 4)
    close(adv, grpo * w)
    close(m["groups/learnability_weight_mean"], (1 + 0 + 0.75) / 3)
    adv2, _ = A.advantages.get("learnability")(R, G, weight="maxent", lam=2.0)
    kl = lambda p: math.log(2) + (p * math.log(p) if p > 0 else 0) + ((1 - p) * math.log(1 - p) if p < 1 else 0)
    w2 = torch.tensor([math.exp(-2 * kl(0.5))] * 4 + [math.exp(-2 * kl(1.0))] * 4 + [math.exp(-2 * kl(0.25))] * 4)
    close(adv2, grpo * w2)
    assert w2[0] == 1.0


def test_group_of_one_and_group_order_independence():
    adv, _ = A.advantages.get("grpo")(torch.tensor([3.0]), torch.tensor([0]))
    assert adv.item() == 0.0
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    adv, _ = A.advantages.get("grpo")(R, G)
    adv_p, _ = A.advantages.get("grpo")(R[perm], G[perm])
    close(adv_p, adv[perm])


def test_gae_hand_values_and_mask_skipping():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = A.gae(r, v, torch.ones(1, 3), gamma=1.0, lam=0.5)
    # δ2 = 1 − .7 = .3; δ1 = .7 − .6 = .1, A1 = .1 + .5·.3; δ0 = .6 − .5 = .1, A0 = .1 + .5·.25
    close(adv, [[0.225, 0.25, 0.3]])
    close(ret, [[0.725, 0.85, 1.0]])
    # the same sequence with a tool-output token in the middle and padding at the end (garbage there)
    r2 = torch.tensor([[0.0, 5.0, 0.0, 1.0, 7.0]])
    v2 = torch.tensor([[0.5, 9.0, 0.6, 0.7, 9.0]])
    m2 = torch.tensor([[1, 0, 1, 1, 0]])
    adv2, ret2 = A.gae(r2, v2, m2, gamma=1.0, lam=0.5)
    close(adv2, [[0.225, 0, 0.25, 0.3, 0]])
    close(ret2, [[0.725, 0, 0.85, 1.0, 0]])


def _gae_reference(r, v, m, gamma, lam):
    """Plain per-sequence GAE over the compacted mask-1 tokens."""
    out = torch.zeros_like(v)
    for b in range(r.shape[0]):
        idx = m[b].nonzero().squeeze(-1).tolist()
        a_next, v_next = 0.0, 0.0
        for t in reversed(idx):
            delta = r[b, t] + gamma * v_next - v[b, t]
            a_next = delta + gamma * lam * a_next
            v_next = v[b, t]
            out[b, t] = a_next
    return out


def test_gae_matches_reference_random():
    g = torch.Generator().manual_seed(3)
    B, T = 5, 9
    r = torch.randn(B, T, generator=g)
    v = torch.randn(B, T, generator=g)
    m = (torch.rand(B, T, generator=g) > 0.3).long()
    m[0] = 0  # a row with no loss tokens
    adv, ret = A.gae(r, v, m, gamma=0.9, lam=0.8)
    ref = _gae_reference(r, v, m, 0.9, 0.8)
    close(adv, ref)
    close(ret, (ref + v) * m)
    adv_w, _ = A.gae(r, v, m, gamma=0.9, lam=0.8, whiten=True)
    sel = m.bool()
    assert abs(adv_w[sel].mean().item()) < 1e-5 and adv_w[sel].std().item() == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "learnability"])
def test_equal_rewards_that_are_inexact_in_float32_get_exactly_zero_advantage(name):
    """8 × 1.2: float32 mean != 1.2, so (r − mean)/(std + eps) was ≈ +0.106 for every sample."""
    from posttrain.algos import advantages

    rewards = torch.tensor([1.2] * 8 + [0.0, 1.0, 1.0, 0.0], dtype=torch.float32)
    groups = torch.tensor([0] * 8 + [1] * 4)
    extra = {"lengths": torch.arange(1.0, 13.0)} if name == "reinforce_pp_baseline" else {}  # token whitening
    adv, m = advantages.get(name)(rewards, groups, **extra)
    assert torch.equal(adv[:8], torch.zeros(8)), adv[:8]
    assert adv[8:].abs().sum() > 0
    assert float(m["groups/zero_adv_frac"]) == 0.5
