"""`posttrain plan model=... method=... [key=value ...] [--json]`: print a plan as a table or JSON."""

from __future__ import annotations

import json

from posttrain.config import ConfigError, parse_args, split_flags
from posttrain.errors import UserError
from posttrain.plan.config import PlanConfig
from posttrain.plan.predict import predict_config
from posttrain.plan.report import render


def main(argv: list[str]) -> None:
    rest, flags = split_flags(argv, ("--json",))
    try:
        cfg = parse_args(PlanConfig, rest, prog="posttrain plan")
    except ConfigError as e:  # bad keys or values are user errors too (the message names the key)
        raise UserError(str(e)) from None
    plan = predict_config(cfg)
    print(json.dumps(plan, indent=2) if "--json" in flags else render(plan))
