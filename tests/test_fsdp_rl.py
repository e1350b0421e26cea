"""Pieces of the sharded RL step that need no process group (posttrain/recipes/rl/sharded.py)."""

import math

import pytest

from posttrain.recipes.rl.sharded import merge_reward_metrics, my_batches
from posttrain.rewards.base import register
from posttrain.rewards.registry import compose
from posttrain.systems.dist import DistInfo


@register("half_none", description="test reward: the length of the completion, None for odd lengths")
def half_none(prompts, completions, **kw):
    return [float(len(c)) if len(c) % 2 == 0 else None for c in completions]


def test_reward_metrics_merged_over_ranks_equal_one_process():
    completions = ["ab", "abc", "abcd", "a", "abcdef", "xy", "z"]
    whole = compose("half_none")
    whole([None] * len(completions), completions)
    parts = []
    for rank in range(2):  # rank r scored samples r, r + 2, ...
        mine = completions[rank::2]
        r = compose("half_none")
        r([None] * len(mine), mine)
        parts.append((r.last_values, r.last_metrics))
    merged = merge_reward_metrics(parts)
    for key in ("mean", "std", "none", "errors"):
        k = f"rewards/half_none/{key}"
        assert merged[k] == pytest.approx(whole.last_metrics[k], rel=1e-12), k
    assert merged["rewards/half_none/none"] == 3 and not math.isnan(merged["rewards/half_none/std"])


def test_reward_counters_summed_and_a_rank_without_samples_ignored():
    parts = [({"m": [1.0, None]}, {"rewards/m/errors": 0, "rewards/m/seconds": 0.5, "rewards/m/timeouts": 2}),
             ({}, {}),
             ({"m": [0.0]}, {"rewards/m/errors": 0, "rewards/m/seconds": 0.2, "rewards/m/timeouts": 1})]
    out = merge_reward_metrics(parts)
    assert out["rewards/m/mean"] == 0.5 and out["rewards/m/none"] == 1
    assert out["rewards/m/timeouts"] == 3 and out["rewards/m/seconds"] == 0.5


def test_my_batches_are_the_shares_update_computes():
    batches = list("abcde")
    # 2 minibatches: [a, c, e] and [b, d]; rank 1 of 2 takes c (+ a as padding) and d
    assert my_batches(batches, 2, DistInfo(1, 2)) == ["c", "a", "d"]
    assert my_batches(batches, 1, DistInfo(0, 1)) == batches
