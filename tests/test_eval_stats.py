"""Intervals and paired tests: published values, hand-derived values, determinism."""

import math

import numpy as np
import pytest

from posttrain.eval import stats


def test_wilson_acceptance_value():
    low, high = stats.wilson_interval(7, 10, 0.95)
    assert abs(low - 0.396778) <= 0.5e-6 and abs(high - 0.892209) <= 0.5e-6


def test_wilson_edges():
    low, high = stats.wilson_interval(0, 20)
    z2 = stats.z_value() ** 2
    assert low == 0.0 and high == pytest.approx(z2 / (20 + z2))  # p̂ = 0: the upper end is z²/(n + z²)
    assert stats.wilson_interval(20, 20)[1] == 1.0
    with pytest.raises(ValueError):
        stats.wilson_interval(3, 2)


def test_mcnemar_acceptance_and_hand_values():
    assert abs(stats.mcnemar_exact(10, 2) - 0.0385742) <= 0.5e-7
    assert stats.mcnemar_exact(2, 10) == stats.mcnemar_exact(10, 2)
    assert stats.mcnemar_exact(3, 0) == pytest.approx(0.25)  # 2 * (1/2)^3
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(5, 5) == 1.0


def test_bon_kl_acceptance_value():
    assert abs(stats.bon_kl(16) - 1.835089) <= 0.5e-6
    assert stats.bon_kl(1) == 0.0


def test_normal_interval_hand_value():
    mean, low, high = stats.normal_interval([0, 1, 1, 0], 0.95)
    se = math.sqrt(1 / 3) / 2  # sample sd sqrt(1/3) (ddof=1), over sqrt(4)
    assert mean == 0.5 and low == pytest.approx(0.5 - 1.959964 * se, abs=1e-6) and high == pytest.approx(0.5 + 1.959964 * se, abs=1e-6)


def test_effective_size_and_clustered_wilson():
    # one sample per item: exactly Wilson over the items
    xs = [1, 0, 0, 1, 1, 1, 0, 1, 1, 1]
    assert stats.effective_size(xs, 1) == pytest.approx(10)
    assert stats.clustered_wilson(xs, 1)[1:] == pytest.approx(stats.wilson_interval(7, 10))
    # perfectly clustered (each item all right or all wrong): 4 samples per item count as one
    assert stats.effective_size([0.0, 1.0], 4) == pytest.approx(2)
    # identical items: as many independent samples as were drawn (the cap m * n)
    assert stats.effective_size([0.5, 0.5, 0.5], 8) == 24
    # more clustering -> wider interval at the same mean
    spread = stats.clustered_wilson([0.0, 1.0] * 10, 4)
    even = stats.clustered_wilson([0.5] * 20, 4)
    assert spread[0] == even[0] == 0.5 and (spread[2] - spread[1]) > (even[2] - even[1])


def test_bootstrap_is_seeded():
    x = np.random.default_rng(0).random(50)
    a = stats.bootstrap_interval(x, 0.9, 500, seed=7)
    assert a == stats.bootstrap_interval(x, 0.9, 500, seed=7)
    assert a != stats.bootstrap_interval(x, 0.9, 500, seed=8)
    assert a[1] < a[0] < a[2]


def test_paired_bootstrap_hand_cases():
    a = [0.0, 0.5, 1.0, 0.25]
    same = stats.paired_bootstrap(a, a, resamples=300)
    assert same["diff"] == 0 and same["low"] == same["high"] == 0 and same["p_value"] == 1.0
    shifted = stats.paired_bootstrap(a, [v + 0.1 for v in a], resamples=300)
    # a constant difference: every resample equals it, none is as far from it as 0 is
    assert shifted["diff"] == pytest.approx(0.1) and shifted["low"] == pytest.approx(0.1) and shifted["high"] == pytest.approx(0.1)
    assert shifted["p_value"] == pytest.approx(1 / 301)
    with pytest.raises(ValueError):
        stats.paired_bootstrap([1, 2], [1])


def test_paired_bootstrap_p_value_is_roughly_uniform_under_the_null():
    """200 null datasets: the share with p < 0.1 estimates the test's size (binomial sd 0.021; allow 3)."""
    rng = np.random.default_rng(1)
    ps = []
    for seed in range(200):
        a, b = rng.random(40), rng.random(40)
        ps.append(stats.paired_bootstrap(a, b, resamples=400, seed=seed)["p_value"])
    size = np.mean(np.array(ps) < 0.1)
    assert abs(size - 0.1) <= 3 * math.sqrt(0.1 * 0.9 / 200), size
