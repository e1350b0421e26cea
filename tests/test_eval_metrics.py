"""pass@k, pass^k, cons@k, mean@n: published values, brute force over subsets, hand-derived cases."""

import itertools
import math
from fractions import Fraction

import pytest

from posttrain.eval.metrics import cluster_answers, cons_at_k, group_answers, majority_vote, mean_at_n, pass_at_k, pass_hat_k


def test_pass_at_k_acceptance_values():
    # the values, given to 4 and 6 decimals: the tolerance is half a unit of the last printed digit
    assert abs(pass_at_k(3, 1, 2) - 0.6667) <= 0.5e-4
    assert abs(pass_at_k(200, 13, 10) - 0.497551) <= 0.5e-6
    # and against the exact rational 1 - C(n-c, k)/C(n, k): the product form loses only float rounding
    exact = 1 - Fraction(math.comb(187, 10), math.comb(200, 10))
    assert abs(pass_at_k(200, 13, 10) - float(exact)) <= 1e-14


def test_pass_at_k_edges_and_k1():
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 8, 3) == 1.0  # n - c = 2 < k: every 3-subset holds a correct sample
    for c in range(11):
        assert pass_at_k(10, c, 1) == pytest.approx(c / 10, abs=1e-15)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


@pytest.mark.parametrize("n,k", [(5, 2), (6, 3), (7, 4)])
def test_pass_at_k_and_pass_hat_k_equal_the_subset_average(n, k):
    """Unbiasedness made concrete: the estimators are the averages over all k-subsets of the n samples."""
    for c in range(n + 1):
        correct = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        any_ok = sum(any(correct[j] for j in s) for s in subsets) / len(subsets)
        all_ok = sum(all(correct[j] for j in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(any_ok, abs=1e-12)
        assert pass_hat_k(n, c, k) == pytest.approx(all_ok, abs=1e-12)


def test_pass_hat_k_hand_values():
    assert pass_hat_k(5, 3, 2) == pytest.approx(3 / 10)  # C(3,2)/C(5,2)
    assert pass_hat_k(4, 4, 4) == 1.0
    assert pass_hat_k(8, 2, 3) == 0.0  # fewer correct samples than k
    assert pass_hat_k(8, 5, 1) == pytest.approx(5 / 8)


def test_majority_vote_tie_rule():
    assert majority_vote([0, 0, 1], {0}) == 1.0
    assert majority_vote([0, 0, 1], {1}) == 0.0
    assert majority_vote([0, 1], {0}) == 0.5  # tie of 2 classes, one correct: expected score of a random break
    assert majority_vote([0, 1, 2], {0, 2}) == pytest.approx(2 / 3)
    assert majority_vote([None, None], {0}) == 0.0  # nobody answered
    assert majority_vote([0, None, None], {0}) == 1.0  # abstentions do not vote


def test_cons_at_k_hand_values():
    # classes per sample, verdict per sample
    assert cons_at_k([0, 0, 1, 1], [True, True, False, False], 4) == 0.5  # 2-2 tie
    assert cons_at_k([0, 1, None], [True, False, False], 3) == 0.5
    # k=2 of [a, a, b], a correct: subsets {0,1} -> 1, {0,2} -> 1/2, {1,2} -> 1/2
    assert cons_at_k([0, 0, 1], [True, True, False], 2) == pytest.approx(2 / 3)
    # a class is correct when any member verified (a hedged member scored 0 still votes for the right answer)
    assert cons_at_k([0, 0, 1], [True, False, False], 3) == 1.0
    assert cons_at_k([None, None], [False, False], 2) == 0.0
    assert cons_at_k([0, 1, 1], [True, False, False], 1) == pytest.approx(1 / 3)  # cons@1 = the sample's class


def test_cons_at_k_sampled_subsets_are_seeded_and_close_to_exact():
    classes = [0, 1, 0, 2, 1, 0, 1, 2, 0, 3, 1, 0]
    correct = [c == 0 for c in classes]
    exact = cons_at_k(classes, correct, 5, max_subsets=10**6)  # C(12,5) = 792 subsets
    a = cons_at_k(classes, correct, 5, max_subsets=400, seed=3)
    assert a == cons_at_k(classes, correct, 5, max_subsets=400, seed=3)
    # 400 draws of a score in [0, 1]: standard error <= 0.5/sqrt(400) = 0.025; allow 4 of them
    assert abs(a - exact) <= 4 * 0.5 / math.sqrt(400)


def test_group_answers_and_math_equivalence():
    same_number = lambda a, b: float(Fraction(a)) == float(Fraction(b))
    assert group_answers(["1/2", "0.5", "3", None, "3", "6/2"], same_number) == [0, 0, 1, None, 1, 1]
    # the math verifier's equivalence (run in-process here; the runner sends it to the pool)
    assert cluster_answers(["\\frac{1}{2}", "0.5", "1/2", "2", None]) == [0, 0, 0, 1, None]
    assert cluster_answers(["1/2", "0.5"], use_math_verify=False) == [0, 0]  # fallback comparator agrees


def test_mean_at_n():
    assert mean_at_n([1.0, 0.5, None, 0.0]) == pytest.approx(0.375)
    with pytest.raises(ValueError):
        mean_at_n([])
