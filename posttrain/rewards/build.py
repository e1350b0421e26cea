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
    check_columns(rows, reward_fn.columns)
    return reward_fn


def check_columns(rows: list[Row], columns: dict[str, tuple]) -> None:
    """Every row has a value (not null) for each column a reward reads (`columns`: reward -> columns, a tuple
    entry = any one of its alternatives): the first row without one is refused with its file, row and field,
    as `posttrain eval` does (a row whose reward can never apply would only skip its steps)."""
    for row in rows:
        for reward, cols in columns.items():
            for col in cols:
                alts = col if isinstance(col, tuple) else (col,)
                if not any(row.data.get(a) is not None for a in alts):
                    raise row.error(" or ".join(alts), f"missing or null (reward '{reward}' needs it)")
