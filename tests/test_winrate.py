"""Length-controlled win rate (AlpacaEval 2), Bradley–Terry ranking and agreement, each checked against an
independent implementation written here (a different optimiser or algorithm on the published formula)."""

import math

import numpy as np
import pytest
import torch

from posttrain.eval.winrate import agreement, bradley_terry, lc_win_rate, length_features


def reference_lc(y, len_model, len_baseline, l2):
    """The published GLM written out again: logit p = θ + φ·tanh(Δ / sd(Δ)), soft-label log loss + (l2/2)‖β‖²,
    minimised with torch's L-BFGS in float64 (not Newton); LC = 100·mean σ(θ)."""
    y = torch.tensor(y, dtype=torch.float64)
    delta = torch.tensor(len_model, dtype=torch.float64) - torch.tensor(len_baseline, dtype=torch.float64)
    feat = torch.tanh(delta / delta.std(unbiased=True))
    beta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([beta], lr=1, max_iter=500, tolerance_grad=1e-13, tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        z = beta[0] + beta[1] * feat
        loss = -(y * torch.nn.functional.logsigmoid(z) + (1 - y) * torch.nn.functional.logsigmoid(-z)).sum() + l2 / 2 * (beta ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    theta = beta.detach()[0]
    return 100 * torch.sigmoid(theta).item(), beta.detach().numpy()


def synthetic(n, theta, phi, seed, tie_frac=0.0):
    """Model answers mostly longer than the baseline's; P(model preferred) = σ(θ + φ·tanh(Δ/sd))."""
    rng = np.random.default_rng(seed)
    lb = rng.integers(100, 400, n)
    lm = lb + rng.normal(200, 150, n).round().astype(int)
    p = 1 / (1 + np.exp(-(theta + phi * length_features(lm, lb))))
    y = (rng.random(n) < p).astype(float)
    y[rng.random(n) < tie_frac] = 0.5
    return y, lm, lb


def lc_standard_error(y, lm, lb, l2):
    """SE of the LC rate from the Fisher information at the fit (delta method): 100·σ'(θ)·sqrt((H⁻¹)_θθ)."""
    r = lc_win_rate(y, lm, lb, l2=l2)
    X = np.stack([np.ones(len(y)), length_features(lm, lb)], 1)
    p = 1 / (1 + np.exp(-(X @ np.array([r["model_term"], r["length_term"]]))))
    H = (X * (p * (1 - p))[:, None]).T @ X + l2 * np.eye(2)
    s = 1 / (1 + math.exp(-r["model_term"]))
    return 100 * s * (1 - s) * math.sqrt(np.linalg.inv(H)[0, 0])


@pytest.mark.parametrize("tie_frac", [0.0, 0.2])
def test_lc_removes_a_pure_length_preference(tie_frac):
    """The judge prefers the longer answer for its length alone (θ = 0, φ = 3): the raw win rate is high,
    the LC rate is 50 % within 4 standard errors, and both implementations agree to optimiser precision."""
    y, lm, lb = synthetic(3000, theta=0.0, phi=3.0, seed=1, tie_frac=tie_frac)
    r = lc_win_rate(y, lm, lb, l2=1e-3)
    ref, beta = reference_lc(y, lm, lb, l2=1e-3)
    assert r["win_rate"] > 70  # E[raw] = 0.8·mean σ(3·tanh(Δ/sd)) + 0.2·0.5 ≈ 77 % with 20 % ties, ≈ 84 % without
    assert abs(r["lc_win_rate"] - 50) < 4 * lc_standard_error(y, lm, lb, 1e-3)
    assert r["lc_win_rate"] == pytest.approx(ref, abs=1e-6)
    assert [r["model_term"], r["length_term"]] == pytest.approx(beta.tolist(), abs=1e-6)
    assert r["length_term"] > 1.5  # the preference went into φ (true 3; ties at 0.5 shrink it toward 0)


def test_lc_keeps_a_real_advantage():
    """A model better for its content (θ = 1) and no length effect: LC ≈ raw ≈ 100·σ(1) = 73.1 %."""
    y, lm, lb = synthetic(3000, theta=1.0, phi=0.0, seed=2)
    r = lc_win_rate(y, lm, lb, bootstrap=200, seed=0)
    se = lc_standard_error(y, lm, lb, 1e-3)
    assert abs(r["lc_win_rate"] - 100 / (1 + math.exp(-1))) < 4 * se
    assert abs(r["lc_win_rate"] - r["win_rate"]) < 4 * se
    lo, hi = r["lc_interval"]
    assert lo < r["lc_win_rate"] < hi and hi - lo < 8 * se


def test_lc_stays_finite_when_the_model_wins_everything():
    y = np.ones(40)
    r = lc_win_rate(y, np.arange(40) + 50, np.full(40, 60))
    assert r["win_rate"] == 100 and 99 < r["lc_win_rate"] < 100 and math.isfinite(r["model_term"])


def test_lc_refuses_missing_judgements():
    with pytest.raises(ValueError, match="missing"):
        lc_win_rate([1.0, None], [1, 2], [2, 1])


def hunter_mm(models, games, iters=5000):
    """Bradley–Terry by Hunter's (2004) MM algorithm: π_i ← W_i / Σ_j n_ij / (π_i + π_j); no ties."""
    idx = {m: k for k, m in enumerate(models)}
    wins = np.zeros(len(models))
    n = np.zeros((len(models), len(models)))
    for i, j, p in games:
        wins[idx[i] if p == 1 else idx[j]] += 1
        n[idx[i], idx[j]] += 1
        n[idx[j], idx[i]] += 1
    pi = np.ones(len(models))
    for _ in range(iters):
        pi = wins / (n / (pi[:, None] + pi[None, :])).sum(1)
        pi /= pi[0]
    return np.log(pi)


def test_bradley_terry_matches_hunters_mm_and_recovers_the_order():
    rng = np.random.default_rng(0)
    true = {"m0": 0.0, "m1": 0.5, "m2": 1.0, "m3": -0.7}
    models = sorted(true)
    games = []
    for _ in range(4000):
        i, j = rng.choice(models, 2, replace=False)
        p = 1 / (1 + math.exp(-(true[i] - true[j])))
        games.append((i, j, float(rng.random() < p)))
    bt = bradley_terry(games, anchor="m0", l2=0.0)
    got = {r["model"]: r["strength"] for r in bt["ranking"]}
    ref = dict(zip(models, hunter_mm(models, games)))
    assert [got[m] for m in models] == pytest.approx([ref[m] for m in models], abs=1e-6)
    assert [r["model"] for r in bt["ranking"]] == ["m2", "m1", "m0", "m3"]
    assert all(abs(got[m] - true[m]) < 0.15 for m in models)  # ~4 SE with ~2000 games per model
    r0 = next(r for r in bt["ranking"] if r["model"] == "m2")
    assert r0["elo"] == pytest.approx(1000 + 400 * got["m2"] / math.log(10))
    assert bt["win_prob"]["m2"]["m3"] == pytest.approx(1 / (1 + math.exp(-(got["m2"] - got["m3"]))))


def test_bradley_terry_ties_count_half():
    """One win each way plus ties: equal strengths; tallies count each side."""
    bt = bradley_terry([("a", "b", 1), ("a", "b", 0), ("a", "b", 0.5), ("b", "a", 0.5)], l2=0.0)
    assert abs(bt["ranking"][0]["strength"] - bt["ranking"][1]["strength"]) < 1e-9
    a = next(r for r in bt["ranking"] if r["model"] == "a")
    assert (a["wins"], a["losses"], a["ties"], a["games"]) == (1, 1, 2, 4)


def test_agreement_and_cohens_kappa():
    judge = ["a", "a", "b", "b", "tie", "a"]
    human = ["a", "b", "b", "b", "a", "a"]
    r = agreement(judge, human)
    # po = 4/6; pe = P(a)P(a) + P(b)P(b) + P(tie)P(tie) = (3/6)(3/6) + (2/6)(3/6) + (1/6)(0)
    po, pe = 4 / 6, 0.5 * 0.5 + (2 / 6) * 0.5
    assert r["agreement"] == pytest.approx(po) and r["cohen_kappa"] == pytest.approx((po - pe) / (1 - pe))
    assert r["agreement_decided"] == pytest.approx(4 / 5) and r["n_decided"] == 5
