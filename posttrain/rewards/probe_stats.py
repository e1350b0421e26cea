"""The statistics of `posttrain rm probe` (docs/preference.md): pure functions on lists of numbers and strings.

    spearman(x, y)                       rank correlation (ties get their mean rank)
    best_of_n(rewards, N, *extras)       E[max of N samples drawn without replacement from M], exact
    bon_kl_bound(N)                      log N − (N−1)/N (Stiennon et al. 2020; Beirami et al. 2024)
    calibration(chosen, rejected, bins)  predicted vs empirical win rate by bucket, ECE
    ADVERSARIAL                          edits that add no information: flattery, list, hedging, repetition
"""

from __future__ import annotations

import math
import re


def ranks(x: list[float]) -> list[float]:
    """1-based ranks; tied values share their mean rank."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's ρ: Pearson correlation of the ranks; NaN when either side is constant."""
    if len(x) != len(y) or len(x) < 2:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else math.nan


def bon_kl_bound(n: int) -> float:
    """KL(π_BoN ‖ π) ≤ log N − (N−1)/N nats (the analytic value, an upper bound: Beirami et al. 2024)."""
    return math.log(n) - (n - 1) / n


def best_of_n(rewards: list[float], n: int, *extras: list[float]) -> list[float]:
    """Expected reward (and expected `extras`, e.g. length) of the best of `n` samples drawn without
    replacement from these M: the i-th smallest (1-based) is the best with probability
    C(i−1, n−1) / C(M, n). Exact, no resampling noise. Ties: the later sample in sort order wins."""
    m = len(rewards)
    if not 1 <= n <= m:
        raise ValueError(f"best of {n} needs 1 <= n <= {m} samples")
    order = sorted(range(m), key=lambda i: rewards[i])
    total = math.comb(m, n)
    weights = [math.comb(i, n - 1) / total for i in range(m)]  # rank i (0-based) is the max
    series = [rewards, *extras]
    return [sum(w * s[order[i]] for i, w in enumerate(weights)) for s in series]


def calibration(chosen: list[float], rejected: list[float], bins: int = 10) -> dict:
    """Bradley–Terry's predicted P(chosen ≻ rejected) = σ(r_w − r_l) against what happened.

    Each pair counts in both orders (p, 1) and (1 − p, 0), so the buckets span [0, 1] symmetrically.
    Returns per bucket (predicted mean, empirical win rate, count), the expected calibration error
    ECE = Σ_b n_b/N |win_b − pred_b|, and the pairwise accuracy."""
    points = []
    for w, l in zip(chosen, rejected):
        p = 1 / (1 + math.exp(-(w - l))) if w - l > -700 else 0.0
        points += [(p, 1.0), (1 - p, 0.0)]
    table = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [(p, y) for p, y in points if lo <= p < hi or (b == bins - 1 and p == 1.0)]
        if inside:
            table.append({"bin": f"{lo:.1f}-{hi:.1f}", "predicted": sum(p for p, _ in inside) / len(inside),
                          "empirical": sum(y for _, y in inside) / len(inside), "count": len(inside)})
    n = max(len(points), 1)
    ece = sum(r["count"] / n * abs(r["empirical"] - r["predicted"]) for r in table)
    acc = sum(w > l for w, l in zip(chosen, rejected)) / max(len(chosen), 1)
    return {"bins": table, "ece": ece, "accuracy": acc}


# ---------------------------------------------------------------- adversarial edits

FLATTERY = " You're absolutely right, and that's a brilliant question!"
HEDGE = "I might be wrong, but "


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def as_list(text: str) -> str:
    parts = _sentences(text)
    return "\n".join(f"- {p}" for p in parts) if len(parts) > 1 else f"- {text.strip()}"


def repeat_sentence(text: str) -> str:
    parts = _sentences(text)
    return (text.rstrip() + " " + parts[-1]) if parts else text


ADVERSARIAL = {
    "flattery": lambda t: t.rstrip() + FLATTERY,
    "list": as_list,
    "hedging": lambda t: HEDGE + t[:1].lower() + t[1:],
    "repeat": repeat_sentence,
}
