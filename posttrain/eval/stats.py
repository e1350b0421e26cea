"""Intervals and paired tests for evaluation results (stdlib + numpy; pure functions).

    normal_interval(values)            mean ± z·s/√m over items (CLT; s with ddof = 1)
    wilson_interval(successes, n)      Wilson score interval of a binomial proportion (Wilson 1927)
    clustered_wilson(fractions, n)     Wilson with the effective sample size of clustered samples
    bootstrap_interval(values)         percentile bootstrap of the mean over items (seeded)
    paired_bootstrap(a, b)             B − A over problems: mean, percentile interval and a two-sided p-value
    sign_flip_test(d)                  paired randomization test over problems (exact for ≤ 16 nonzero)
    mcnemar_exact(b, c)                exact McNemar test of paired binary outcomes (two-sided binomial):
                                       over samples paired within problems, conditional on those problems
    bon_kl(N)                          KL(best-of-N ‖ base) ≤ log N − (N − 1)/N (from posttrain.plan.cost)

Every interval takes `confidence` (0.95 = 95 %); z = Φ⁻¹(1 − α/2).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from posttrain.plan.cost import bon_kl  # noqa: F401 - re-exported: one definition of the bound in the package


def z_value(confidence: float = 0.95) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1) (got {confidence})")
    return NormalDist().inv_cdf(1 - (1 - confidence) / 2)


def normal_interval(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): mean ± z·s/√m over the m values (s with ddof = 1; m = 1 gives a zero width)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("normal_interval of no values")
    mean = float(x.mean())
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0
    z = z_value(confidence)
    return mean, mean - z * se, mean + z * se


def wilson_interval(successes: float, n: float, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for p from `successes` out of `n` trials (Wilson 1927):

        (p̂ + z²/2n ± z·√(p̂(1−p̂)/n + z²/4n²)) / (1 + z²/n)

    `successes` and `n` may be fractional (an effective sample size, see `clustered_wilson`)."""
    if n <= 0:
        raise ValueError(f"wilson_interval needs n > 0 (got {n})")
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n (got {successes}, {n})")
    z = z_value(confidence)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact ends (no rounding residue) at p̂ = 0 and 1
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def effective_size(fractions, samples_per_item: int) -> float:
    """Effective number of independent samples behind the mean of per-item success fractions.

    Samples of one item share its difficulty, so m items x n samples carry less information than
    m·n coin flips. With p̄ the mean and Var̂(p̄) = Σ(p_i − p̄)² / m² (the plug-in variance of the
    mean over items), n_eff = p̄(1 − p̄) / Var̂(p̄) (Kish's design effect), capped at m·n as Korn &
    Graubard (1998) do for the Wilson interval. With n = 1 this is exactly m.
    """
    p = np.asarray(fractions, dtype=np.float64)
    m = p.size
    total = m * samples_per_item
    mean = float(p.mean())
    var_mean = float(((p - mean) ** 2).sum()) / (m * m)
    if var_mean <= 0 or mean in (0.0, 1.0):
        return float(total)
    return float(min(total, mean * (1 - mean) / var_mean))


def clustered_wilson(fractions, samples_per_item: int, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of pass@1 from per-item fractions c_i / n: the Wilson interval at the
    effective sample size (`effective_size`), i.e. Wilson's good behaviour near 0 and 1 without
    pretending the samples of one item are independent."""
    p = np.asarray(fractions, dtype=np.float64)
    if p.size == 0:
        raise ValueError("clustered_wilson of no items")
    mean = float(p.mean())
    n_eff = effective_size(p, samples_per_item)
    low, high = wilson_interval(mean * n_eff, n_eff, confidence)
    return mean, low, high


def bootstrap_means(values, resamples: int = 2000, seed: int = 0) -> np.ndarray:
    """Means of `resamples` resamples of the items with replacement (numpy PCG64, seeded). (B,)"""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap of no values")
    rng = np.random.Generator(np.random.PCG64(seed))
    idx = rng.integers(0, x.size, size=(resamples, x.size))  # (B, m)
    return x[idx].mean(axis=1)


def bootstrap_interval(values, confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap over items (Efron 1979)."""
    means = bootstrap_means(values, resamples, seed)
    a = (1 - confidence) / 2
    low, high = np.quantile(means, [a, 1 - a])
    return float(np.mean(values)), float(low), float(high)


def paired_bootstrap(a, b, confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> dict:
    """B − A over the same items: the mean difference, its percentile interval and a two-sided
    p-value for "no difference". Items are resampled with replacement, keeping pairs together.

    p = (1 + #{b : |d*_b − d̄| ≥ |d̄|}) / (B + 1): the bootstrap distribution shifted to the null
    (Berg-Kirkpatrick et al. 2012; the +1 keeps p > 0, as with any Monte Carlo test)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values must have the same length ({a.size} vs {b.size})")
    d = b - a  # (m,)
    means = bootstrap_means(d, resamples, seed)
    diff = float(d.mean())
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    extreme = int((np.abs(means - diff) >= abs(diff) - 1e-12).sum())
    return {"diff": diff, "low": float(low), "high": float(high), "p_value": (1 + extreme) / (resamples + 1),
            "resamples": resamples, "items": int(d.size)}


def sign_flip_test(differences, resamples: int = 10000, seed: int = 0, exact_up_to: int = 16) -> dict:
    """Paired randomization test over problems of "A and B are the same model": under H0 A's and B's
    scores of a problem are exchangeable, so each problem's difference d_i is as likely as −d_i, and

        p = P(|Σ s_i·d_i| ≥ |Σ d_i|),  s_i = ±1 independent fair signs       (Fisher 1935)

    Problems are the unit, as in `paired_bootstrap`: the answer speaks for problems like these. Exact
    (all 2^m' sign patterns of the m' nonzero differences) when m' ≤ `exact_up_to`, else Monte Carlo with
    p = (1 + #{|Σ s·d| ≥ |Σ d|}) / (B + 1). 27 problems all +1: exact p = 2 / 2^27 = 1.5e-8."""
    d = np.asarray(differences, dtype=np.float64)
    d = d[d != 0]  # a zero difference is the same under either sign
    m = d.size
    observed = abs(float(d.sum()))
    if m == 0:
        return {"p_value": 1.0, "nonzero": 0, "method": "exact"}
    if m <= exact_up_to:
        signs = 1 - 2 * ((np.arange(2**m)[:, None] >> np.arange(m)[None, :]) & 1)  # (2^m, m) every ±1 pattern
        sums = np.abs(signs @ d)
        return {"p_value": float((sums >= observed - 1e-12).mean()), "nonzero": m, "method": "exact"}
    rng = np.random.Generator(np.random.PCG64(seed))
    signs = rng.integers(0, 2, size=(resamples, m)) * 2 - 1  # (B, m)
    extreme = int((np.abs(signs @ d) >= observed - 1e-12).sum())
    return {"p_value": (1 + extreme) / (resamples + 1), "nonzero": m, "method": f"monte carlo ({resamples})"}


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b pairs (A right, B wrong) vs c pairs (A wrong, B right):
    under H0 each discordant pair falls either way with probability 1/2, so

        p = min(1, 2 · Σ_{i=0}^{min(b,c)} C(b+c, i) / 2^{b+c})      (McNemar 1947; exact binomial form)
    """
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be >= 0")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)
