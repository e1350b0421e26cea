"""`eval compare` leads with tests over problems; McNemar over samples is labelled conditional on the problems."""

import itertools

import numpy as np
import pytest

from posttrain.eval import compare as C
from posttrain.eval import stats
from test_eval_cli import _fake


def test_sign_flip_exact_hand_values():
    # 3 problems +1, +1, −1: |Σ s·d| ≥ 1 for all 8 sign patterns (sums are odd) -> p = 1
    assert stats.sign_flip_test([1, 1, -1])["p_value"] == 1.0
    # 4 problems all +0.5: only ++++ and −−−− reach |2| -> p = 2/16; zero differences do not count
    r = stats.sign_flip_test([0.5, 0.5, 0.5, 0.5, 0.0, 0.0])
    assert (r["p_value"], r["nonzero"], r["method"]) == (2 / 16, 4, "exact")
    assert stats.sign_flip_test([0, 0])["p_value"] == 1.0


def test_sign_flip_exact_equals_brute_force_enumeration():
    d = np.array([0.25, -0.5, 0.75, 0.125, 1.0, -0.25, 0.5])
    brute = np.mean([abs(np.dot(s, d)) >= abs(d.sum()) - 1e-12 for s in itertools.product((-1, 1), repeat=d.size)])
    assert stats.sign_flip_test(d)["p_value"] == pytest.approx(brute)


def test_sign_flip_monte_carlo_agrees_with_exact():
    rng = np.random.default_rng(0)
    d = rng.normal(0.2, 1.0, size=14)
    exact = stats.sign_flip_test(d)["p_value"]
    mc = stats.sign_flip_test(d, resamples=20000, exact_up_to=0)
    assert mc["method"].startswith("monte carlo") and mc["p_value"] == pytest.approx(exact, abs=0.01)


def test_many_samples_on_few_problems_move_mcnemar_not_the_problem_level_verdict():
    # 4 problems, 64 samples each: B wins three, loses one. Conditional on these problems the samples differ
    # overwhelmingly (McNemar: 64 vs 192 discordant pairs); over problems 3 wins of 4 is weak evidence.
    a, b = _fake([0, 0, 0, 64], [64, 64, 64, 0], n=64)
    r = C.compare(a, b, resamples=2000)
    assert r["mcnemar"]["p_value"] == pytest.approx(stats.mcnemar_exact(64, 192)) and r["mcnemar"]["p_value"] < 1e-14
    assert r["mcnemar"]["conditional_on"] == "these problems"
    assert r["sign_flip"]["p_value"] == 10 / 16  # Σ ±1 over 4 problems: |S| ≥ 2 unless S = 0 (6 of 16 patterns)
    assert r["bootstrap"]["p_value"] > 0.05 and not r["significant"]


def test_printed_comparison_leads_with_problems_and_labels_mcnemar(capsys):
    a, b = _fake([0] * 27, [2] * 27)
    C.print_comparison(C.compare(a, b, resamples=500))
    out = capsys.readouterr().out
    assert out.index("over problems") < out.index("paired bootstrap") < out.index("sign-flip") < out.index("McNemar")
    assert "conditional on these problems" in out and "says nothing about other problems" in out
    assert "=> significantly different over problems" in out
