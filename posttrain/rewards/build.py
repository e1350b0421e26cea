"""A recipe's reward from its config values: the composition, its options, checked against the data."""

from __future__ import annotations

from posttrain.data.formats import Row
from posttrain.rewards.registry import ComposedReward, compose, parse_spec
from posttrain.rewards.shaping import overlong_defaults


def build_reward(spec: str, options: dict, rows: list[Row], max_new_tokens: int) -> ComposedReward:
    """The composed reward `spec` ('math:1.0,format:0.2', 'my.py:fn'); DAPO's overlong shaping defaults to the
    run's generation limit `max_new_tokens`. A column the reward needs and the data lacks is refused here,
    naming the file and row, before any model loads."""
    options = {k: dict(v) for k, v in options.items()}
    if any(name == "overlong" for name, _ in parse_spec(spec)) and "overlong" not in options:
        options["overlong"] = overlong_defaults(max_new_tokens)
    reward_fn = compose(spec, options=options)
    missing = {c for cols in reward_fn.columns.values() for c in cols if isinstance(c, str) and c not in rows[0].data}
    if missing:
        raise rows[0].error(sorted(missing)[0], f"reward '{spec}' needs this column")
    return reward_fn
