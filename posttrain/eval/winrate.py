"""Win rates from pairwise judgements: raw and length-controlled (AlpacaEval 2), Bradley–Terry ranking of
several models, agreement with human labels.

Length-controlled win rate (Dubois et al. 2024, "Length-Controlled AlpacaEval: A Simple Way to Debias
Automatic Evaluators", arXiv:2404.04475; `alpaca_eval/metrics/glm_winrate.py`). For item i, with
y_i = P(model preferred over the baseline) in {0, 0.5, 1} (a tie is 0.5):

    logit P(y_i = 1) = θ + φ · tanh(Δ_i / sd(Δ)) [+ ψ · γ_i]          Δ_i = len(model_i) − len(baseline_i)
    LC win rate      = 100 · mean_i σ(θ [+ ψ · γ_i])                   (the length term set to 0)

Lengths are in characters (AlpacaEval's `str.len()`), sd with ddof = 1; γ_i is an optional per-item
covariate (AlpacaEval's precomputed "instruction difficulty"). θ is the model term, φ the length term.
Deviations: AlpacaEval fits an L1-penalised regression with the strength chosen by 5-fold CV and
regularises toward its own "gamed" baselines (data only it has); here the fit is maximum likelihood
with soft labels by Newton's method (IRLS) and a small fixed L2 penalty `l2` on all coefficients,
which only keeps the estimate finite when the data are separable (e.g. the model wins every item).

Bradley–Terry (Bradley & Terry 1952): logit P(i beats j) = β_i − β_j, fit by maximum likelihood with ties
counted as half a win for each side (as Chatbot Arena does, Chiang et al. 2024) and β_anchor = 0;
ratings on the Elo scale, 1000 + 400 · β / ln 10.
"""

from __future__ import annotations

import math

import numpy as np


def _sigmoid(x):
    return np.exp(-np.logaddexp(0.0, -x))


def logistic_fit(X: np.ndarray, y: np.ndarray, l2: float = 1e-3, max_iter: int = 100, tol: float = 1e-10) -> np.ndarray:
    """argmin_β −Σ_i [y_i log σ(x_i·β) + (1 − y_i) log σ(−x_i·β)] + (l2 / 2) ‖β‖², y_i ∈ [0, 1] (soft labels).
    Newton's method (IRLS): β ← β + (XᵀWX + l2·I)⁻¹ (Xᵀ(y − p) − l2·β), W = diag(p(1 − p)). X: (N, D)."""
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
    beta = np.zeros(X.shape[1])
    eye = np.eye(X.shape[1])
    for _ in range(max_iter):
        p = _sigmoid(X @ beta)  # (N,)
        grad = X.T @ (y - p) - l2 * beta  # (D,)
        hess = (X * (p * (1 - p))[:, None]).T @ X + l2 * eye  # (D, D)
        step = np.linalg.lstsq(hess, grad, rcond=None)[0]
        beta = beta + step
        if np.max(np.abs(step)) < tol * (1 + np.max(np.abs(beta))):
            break
    return beta


def _check_preferences(preference) -> np.ndarray:
    y = np.asarray([np.nan if p is None else p for p in preference], dtype=np.float64)
    if y.size == 0:
        raise ValueError("no judgements")
    if np.isnan(y).any():
        raise ValueError(f"{int(np.isnan(y).sum())} judgements are missing (errors): drop them before computing a win rate")
    if ((y < 0) | (y > 1)).any():
        raise ValueError("preferences must be in [0, 1] (1 = model preferred, 0.5 = tie, 0 = baseline preferred)")
    return y


def length_features(len_model, len_baseline) -> np.ndarray:
    """tanh(Δ / sd(Δ)) with Δ = len_model − len_baseline (0 when every Δ is equal)."""
    delta = np.asarray(len_model, dtype=np.float64) - np.asarray(len_baseline, dtype=np.float64)
    sd = delta.std(ddof=1) if delta.size > 1 else 0.0
    return np.tanh(delta / sd) if sd > 0 else np.zeros_like(delta)


def lc_win_rate(preference, len_model, len_baseline, difficulty=None, l2: float = 1e-3,
                bootstrap: int = 0, seed: int = 0) -> dict:
    """Raw and length-controlled win rate of a model against a baseline (module docstring), in percent.
    `preference[i]`: 1 model preferred, 0.5 tie, 0 baseline preferred. `bootstrap` > 0 adds a 95 %
    percentile interval of the LC rate over items resampled with replacement."""
    y = _check_preferences(preference)
    n = y.size
    if not (len(len_model) == len(len_baseline) == n):
        raise ValueError(f"{n} preferences but {len(len_model)} model lengths and {len(len_baseline)} baseline lengths")
    lm, lb = np.asarray(len_model, dtype=np.float64), np.asarray(len_baseline, dtype=np.float64)
    gamma = None if difficulty is None else np.asarray(difficulty, dtype=np.float64)

    def fit(idx):
        cols = [np.ones(idx.size), length_features(lm[idx], lb[idx])]  # θ, φ
        if gamma is not None:
            cols.append(gamma[idx])  # ψ
        beta = logistic_fit(np.stack(cols, 1), y[idx], l2)
        no_length = beta[0] + (beta[2] * gamma[idx] if gamma is not None else 0.0)
        return beta, 100.0 * float(np.mean(_sigmoid(no_length)))

    beta, lc = fit(np.arange(n))
    out = {"n": n, "win_rate": 100.0 * float(y.mean()), "win_rate_se": 100.0 * float(y.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
           "lc_win_rate": lc, "model_term": float(beta[0]), "length_term": float(beta[1]),
           "wins": int((y == 1).sum()), "ties": int((y == 0.5).sum()), "losses": int((y == 0).sum()),
           "mean_length_model": float(lm.mean()), "mean_length_baseline": float(lb.mean())}
    if gamma is not None:
        out["difficulty_term"] = float(beta[2])
    if bootstrap > 0:
        rng = np.random.default_rng(seed)
        rates = [fit(rng.integers(0, n, n))[1] for _ in range(bootstrap)]
        out["lc_interval"] = [float(np.percentile(rates, 2.5)), float(np.percentile(rates, 97.5))]
    return out


def bradley_terry(comparisons, anchor: str | None = None, l2: float = 1e-4) -> dict:
    """comparisons: (model_i, model_j, p), p = P(i preferred) ∈ {1, 0.5, 0}. Returns {"ranking": [{model,
    strength, elo, wins, ties, losses, games}] best first, "win_prob": {i: {j: σ(β_i − β_j)}}} (module docstring)."""
    comps = [(str(i), str(j), float(p)) for i, j, p in comparisons]
    if not comps:
        raise ValueError("no comparisons")
    models = sorted({m for i, j, _ in comps for m in (i, j)})
    anchor = anchor or models[0]
    if anchor not in models:
        raise ValueError(f"anchor '{anchor}' is in no comparison")
    free = [m for m in models if m != anchor]
    col = {m: k for k, m in enumerate(free)}
    X = np.zeros((len(comps), len(free)))  # (N, M-1): +1 for i, -1 for j; the anchor has no column (β = 0)
    for r, (i, j, _) in enumerate(comps):
        if i == j:
            raise ValueError(f"comparison {r}: a model against itself ({i})")
        if i in col:
            X[r, col[i]] += 1
        if j in col:
            X[r, col[j]] -= 1
    y = _check_preferences([p for _, _, p in comps])
    beta = logistic_fit(X, y, l2) if free else np.zeros(0)
    strength = {anchor: 0.0, **{m: float(beta[col[m]]) for m in free}}
    tally = {m: {"wins": 0.0, "ties": 0, "losses": 0.0, "games": 0} for m in models}
    for i, j, p in comps:
        for m, s in ((i, p), (j, 1 - p)):
            t = tally[m]
            t["games"] += 1
            t["ties"] += s == 0.5
            t["wins"] += s == 1
            t["losses"] += s == 0
    ranking = [{"model": m, "strength": strength[m], "elo": 1000 + 400 * strength[m] / math.log(10), **tally[m]}
               for m in sorted(models, key=lambda m: -strength[m])]
    win_prob = {i: {j: float(_sigmoid(strength[i] - strength[j])) for j in models} for i in models}
    return {"ranking": ranking, "win_prob": win_prob, "anchor": anchor}


def agreement(judge_labels, human_labels) -> dict:
    """Agreement of judge labels with human labels ('a' | 'b' | 'tie'; None entries are skipped):
    the share of equal labels, Cohen's kappa (chance-corrected, Cohen 1960), and the share among the
    items where both named a winner."""
    pairs = [(j, h) for j, h in zip(judge_labels, human_labels) if j is not None and h is not None]
    if not pairs:
        return {"n": 0, "agreement": math.nan, "cohen_kappa": math.nan, "agreement_decided": math.nan, "n_decided": 0}
    labels = sorted({x for p in pairs for x in p})
    n = len(pairs)
    po = sum(j == h for j, h in pairs) / n
    pe = sum((sum(j == c for j, _ in pairs) / n) * (sum(h == c for _, h in pairs) / n) for c in labels)
    decided = [(j, h) for j, h in pairs if j != "tie" and h != "tie"]
    return {"n": n, "agreement": po, "cohen_kappa": (po - pe) / (1 - pe) if pe < 1 else math.nan,
            "agreement_decided": sum(j == h for j, h in decided) / len(decided) if decided else math.nan,
            "n_decided": len(decided)}
