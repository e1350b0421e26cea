"""algos registries and KL estimators/controller: hand values and invariants."""

import math

import pytest
import torch

import posttrain.algos as A
from posttrain.algos.registry import Registry


def test_public_registries_hold_the_spec_names():
    assert set(A.advantages.names()) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                         "learnability", "gae"}
    assert set(A.policy_losses.names()) == {"ppo", "dual_clip", "clip_higher", "gspo", "cispo"}
    assert set(A.preference_losses.names()) == {"dpo", "robust_dpo", "ipo", "kto", "orpo", "simpo", "rpo", "dpo_norm"}
    assert A.kl_estimators.names() == ["k1", "k2", "k3"]
    assert A.distill_losses.names() == ["forward_kl", "jsd", "reverse_kl"]
    assert A.advantages.meta("gae") == {"level": "token"} and A.advantages.meta("grpo") == {"level": "outcome"}


def test_registry_unknown_name_suggests_nearest():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo_clip'; did you mean .*'ppo'"):
        A.policy_losses.get("ppo_clip")
    with pytest.raises(ValueError, match="did you mean 'grpo'"):
        A.advantages.get("gpro")
    with pytest.raises(ValueError, match="known: "):
        A.kl_estimators.get("zzzz")


def test_registry_register_get_override():
    r = Registry("widget")

    @r.register("b", level="x")
    def b():
        return 1

    r.register("a")(lambda: 2)
    assert r.names() == ["a", "b"] and "b" in r and len(r) == 2
    assert r.get("b")() == 1 and r.meta("b") == {"level": "x"}
    r.register("b")(lambda: 3)
    assert r.get("b")() == 3


def test_kl_hand_values():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    assert A.kl_k1(logp, ref).item() == pytest.approx(math.log(2))
    assert A.kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    # ρ = πref/πθ = 0.5: k3 = 0.5 − 1 − log 0.5
    assert A.kl_k3(logp, ref).item() == pytest.approx(0.5 - 1 - math.log(0.5))
    assert A.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 - math.log(0.5))


def test_kl_invariants():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 32, generator=g) * 5
    ref = -torch.rand(64, 32, generator=g) * 5
    assert (A.kl_k3(logp, ref) >= 0).all() and (A.kl_k2(logp, ref) >= 0).all()
    assert (A.kl_k1(logp, ref) < 0).any()  # k1 is not pointwise non-negative
    for k in ("k1", "k2", "k3"):
        assert torch.equal(A.kl_estimators.get(k)(logp, logp), torch.zeros_like(logp))


def test_k1_k3_unbiased_k2_biased_monte_carlo():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(6, generator=g), -1)  # πθ
    q = torch.softmax(torch.randn(6, generator=g), -1)  # πref
    true_kl = (p * (p / q).log()).sum().item()
    idx = torch.multinomial(p, 400_000, replacement=True, generator=g)  # tokens sampled from πθ
    lp, lq = p.log()[idx], q.log()[idx]
    assert A.kl_k1(lp, lq).mean().item() == pytest.approx(true_kl, abs=0.01)
    assert A.kl_k3(lp, lq).mean().item() == pytest.approx(true_kl, abs=0.01)


def test_adaptive_kl_controller():
    c = A.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    assert c.update(12.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))  # error clipped at +0.2
    b = c.value
    assert c.update(6.6, 256) == pytest.approx(b * (1 + 0.1 * 256 / 10000))  # (6.6 − 6)/6 = 0.1
    b = c.value
    assert c.update(0.0, 1000) == pytest.approx(b * (1 - 0.2 * 1000 / 10000))  # clipped at −0.2
    assert A.FixedKLController(0.04).update(100.0, 10) == 0.04
    with pytest.raises(ValueError):
        A.AdaptiveKLController(0.1, target=0.0)


def test_beta_presets():
    assert A.BETA_PRESETS == {"instructgpt": 0.02, "llama2": 0.01, "deepseekmath": 0.04, "tulu3": 0.05, "dapo": 0.0}
