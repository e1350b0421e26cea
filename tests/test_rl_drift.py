"""KL to the start policy at β = 0 (recipes/rl/drift.py): the probe set, the k3 estimate, what the rows carry."""

import json
import math

import pytest
import torch

from conftest import run_rl
from posttrain.recipes.rl.drift import DriftProbe, spread_pick
from posttrain.rollout.trajectory import Trajectory
from test_rl_recipe import space_share  # noqa: F401  (registers the test reward run_rl uses)


def traj(group: int, n: int = 2) -> Trajectory:
    return Trajectory([1, 2], list(range(3, 3 + n)), torch.zeros(n), group=group)


def test_probe_set_spans_groups_first():
    trajs = [traj(g) for g in (0, 0, 0, 1, 1, 2, 3)]
    assert [t.group for t in spread_pick(trajs, 5)] == [0, 1, 2, 3, 0]
    order = [0, 3, 5, 6, 1, 4, 2]  # one of each group, then the second of each, ...
    assert spread_pick(trajs, 100) == [trajs[i] for i in order]


def test_k3_against_hand_values(monkeypatch):
    """Two samples: log-ratios log(1/2) on one token; 0 and log 2 on two tokens.
    k3(r) = r − 1 − log r: k3(1/2) = log 2 − 1/2, k3(1) = 0, k3(2) = 1 − log 2."""
    probe = DriftProbe(every=1, size=2)
    probe.samples = [([1], [2], [[0, 1]]), ([1], [2, 3], [[0, 2]])]
    probe.start_logp = [[math.log(0.5)], [math.log(0.2), math.log(0.1)]]
    now = [torch.tensor([math.log(0.25)]), torch.tensor([math.log(0.2), math.log(0.2)])]
    monkeypatch.setattr(probe, "_score", lambda run: now)
    k = [math.log(2) - 0.5, 0.0, 1 - math.log(2)]
    out = probe.measure(None, 0)
    assert out["kl_start"] == pytest.approx(sum(k) / 3, rel=1e-6)
    assert out["kl_start/seq"] == pytest.approx((k[0] + k[1] + k[2]) / 2, rel=1e-6)
    assert probe.measure(None, 1) != {} and DriftProbe(every=5, size=2).measure(None, 0) == {}  # nothing kept yet
    probe.every = 5
    assert probe.measure(None, 3) == {} and probe.measure(None, 5) != {}


def test_beta0_rows_carry_a_measured_kl_to_the_start_and_no_fake_kl(tmp_path):
    _, out = run_rl(tmp_path, "beta=0", "kl_probe_every=2", "max_steps=5")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("kl" not in r for r in rows)  # not measured: absent, never 0.0
    measured = [r.get("kl_start") for r in rows]
    assert [m is not None for m in measured] == [True, False, True, False, True]  # steps 1, 3, 5
    kl = [m for m in measured if m is not None]
    assert kl[0] >= 0 and kl[-1] > kl[0]  # lr 2e-2 moves the tiny policy away from where it started


def test_with_a_reference_kl_is_to_the_reference(tmp_path):
    _, out = run_rl(tmp_path, "beta=0.05", "max_steps=2")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("kl" in r and "kl_start" not in r for r in rows)
