"""Per-item estimators of what n samples of one problem say about k attempts (pure functions).

    pass@k   P(at least one of k attempts is correct)           unbiased: 1 − C(n−c, k) / C(n, k)
    pass^k   P(all k attempts are correct) (τ-bench, "pass hat k")  unbiased: C(c, k) / C(n, k)
    cons@k   P(the majority answer of k attempts is correct)    (self-consistency, majority vote)
    mean@n   the mean reward of the n samples (non-binary rewards included)

n = samples drawn for the item, c = how many were correct. A benchmark's value is the mean over
items; `posttrain.eval.stats` gives the intervals.

cons@k votes over *answers*, not strings: answers are grouped into classes by the verifier's
equivalence (`posttrain.rewards.math.equivalent`, "1/2" = "0.5"; `cluster_answers` runs in a killable
pool worker like the verifier). A class is correct when any of its members was scored correct (its
answer is equivalent to the gold). Samples without an extractable answer abstain.
Tie rule: when m classes tie for the most votes, the vote scores the fraction of them that are
correct — the expected score of breaking the tie uniformly at random, so the result does not
depend on sample order. No answer at all in the k attempts scores 0.
With k < n the score is the mean over k-subsets of the n samples: all C(n, k) of them when there
are at most `max_subsets`, else `max_subsets` subsets drawn with a fixed seed.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

from posttrain.rewards.answers import cluster_answers, group_answers  # noqa: F401 - re-exported (defined with the extraction)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", the numerically stable product form):

        1 − C(n−c, k) / C(n, k) = 1 − Π_{i = n−c+1}^{n} (1 − k / i)
    """
    _check(n, c, k)
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k, the chance that k i.i.d. attempts all succeed (Yao et al. 2024, τ-bench):
    C(c, k) / C(n, k) = Π_{i=0}^{k−1} (c − i) / (n − i)."""
    _check(n, c, k)
    prod = 1.0
    for i in range(k):
        prod *= (c - i) / (n - i)
        if prod == 0.0:
            break
    return prod


def _check(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n):
        raise ValueError(f"need 0 <= c <= n (got n={n}, c={c})")
    if not (1 <= k <= n):
        raise ValueError(f"need 1 <= k <= n (got n={n}, k={k}): draw at least k samples per item")


def mean_at_n(scores: list[float | None]) -> float:
    """Mean reward of an item's samples; a sample without a reward (None) counts as 0."""
    if not scores:
        raise ValueError("mean@n of an item without samples")
    return sum(0.0 if s is None else float(s) for s in scores) / len(scores)


# ---------------------------------------------------------------- cons@k (majority vote)


def majority_vote(classes: list[int | None], correct_classes: set[int]) -> float:
    """Score of one vote: the share of correct classes among those with the most votes (see the
    module docstring's tie rule); None = no answer (abstains); 0 when nobody answered."""
    votes = Counter(c for c in classes if c is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [c for c, v in votes.items() if v == top]
    return sum(c in correct_classes for c in winners) / len(winners)


def cons_at_k(classes: list[int | None], correct: list[bool], k: int, max_subsets: int = 1000, seed: int = 0) -> float:
    """cons@k of one item: `classes[j]` = answer class of sample j (None: no answer), `correct[j]` =
    the verifier's verdict on sample j. Mean majority-vote score over k-subsets of the samples."""
    n = len(classes)
    if len(correct) != n:
        raise ValueError("classes and correct must have one entry per sample")
    _check(n, 0, k)
    good = {cl for cl, ok in zip(classes, correct) if ok and cl is not None}
    if k == n:
        return majority_vote(classes, good)
    if math.comb(n, k) <= max_subsets:
        subsets = itertools.combinations(range(n), k)
    else:
        rng = random.Random(seed)
        subsets = (rng.sample(range(n), k) for _ in range(max_subsets))
    scores = [majority_vote([classes[j] for j in s], good) for s in subsets]
    return sum(scores) / len(scores)
