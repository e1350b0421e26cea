"""`posttrain methods`: the method table (policy / reward / reference / value per method), from the registry."""

from __future__ import annotations

from posttrain import algos
from posttrain.algos.presets import RL_PRESETS
from posttrain.errors import UserError
from posttrain.plan.methods import method_table


def main(argv: list[str]) -> None:
    """`posttrain methods [METHOD ...]`: the table (only those rows when methods are named), then the registries."""
    rows = method_table()
    if argv:
        known = [r["method"] for r in rows]
        unknown = [a for a in argv if a not in known]
        if unknown:
            raise UserError(f"posttrain methods: unknown method '{unknown[0]}' (the table has {', '.join(known)}; "
                            "`posttrain methods` alone prints them all)")
        rows = [r for r in rows if r["method"] in argv]
    cols = ["method", "reward comes from", "reference constrains by", "value model", "models in memory"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    print("  ".join("-" * widths[c] for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    print()
    for label, names in registries():
        print(f"{label:22s} {', '.join(names)}")


def registries() -> list[tuple[str, list[str]]]:
    """The public registries users extend (`posttrain.algos.*`, `posttrain.rewards.registry`), as they are now."""
    from posttrain.rewards import registry as rewards  # math-verify (slow): not for the table

    return [
        ("rl algos", list(RL_PRESETS)),
        ("advantage estimators", algos.advantages.names()),
        ("policy losses", algos.policy_losses.names()),
        ("preference losses", algos.preference_losses.names()),
        ("KL estimators", algos.kl_estimators.names()),
        ("distillation losses", algos.distill_losses.names()),
        ("rewards", rewards.names()),
    ]
