"""What every reward module needs, and nothing that needs them: the registry's table and `register`,
`RewardSpec`, `RewardError`, and `completion_text` (from posttrain.data.formats).

The built-in rewards (code, format, judge, language, math, shaping) import this module to register
themselves; `posttrain.rewards.registry` imports them and does the lookup, file rewards and composition.
Register your own:

    from posttrain.rewards.base import completion_text, register

    @register("shout", columns=())
    def shout(prompts, completions, **kw):
        return [float(completion_text(c).isupper()) for c in completions]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from posttrain.data.formats import completion_text
from posttrain.errors import UserError

__all__ = ["REGISTRY", "RewardError", "RewardFn", "RewardSpec", "completion_text", "register"]

RewardFn = Callable[..., list]


@dataclass
class RewardSpec:
    name: str
    fn: RewardFn
    columns: tuple[str, ...] = ()  # dataset columns the reward needs (any one of a tuple-of-alternatives entry)
    description: str = ""
    factory: Callable[..., RewardFn] | None = None  # builds a configured variant: factory(**options)
    source: str = ""  # the file a user's reward was loaded from ("" for registered ones)

    def build(self, options: dict | None = None) -> RewardFn:
        if not options and not getattr(self.fn, "needs_options", False):  # needs_options: only the factory builds it (judge)
            return self.fn
        if self.factory is None:
            raise UserError(f"reward '{self.name}' takes no options (got {sorted(options)})")
        try:  # the factory checks its options (a math `mode`, a judge's URL) before any sample is drawn
            return self.factory(**(options or {}))
        except (TypeError, ValueError) as e:
            raise UserError(f"reward_args.{self.name}: bad options {options}: {e}") from None


REGISTRY: dict[str, RewardSpec] = {}  # name -> spec; filled by `register`


class RewardError(UserError):
    """A reward raised or returned a non-finite value. `errors`: [(sample index or None, message)]."""

    def __init__(self, reward: str, errors: list[tuple[int | None, str]], values: list | None = None,
                 samples: list | None = None):
        self.reward, self.errors, self.values = reward, errors, values
        super().__init__(_one_line(reward, errors, samples))


def _one_line(reward: str, errors: list[tuple[int | None, str]], samples: list | None) -> str:
    """One line (the CLI's `error:` line): the first failure with its completion, then where else it failed."""
    def first_line(msg: str) -> str:
        return msg.strip().splitlines()[0] if msg.strip() else msg

    def where(i: int | None) -> str:
        return f"sample {i}" if i is not None else "batch"

    i, msg = errors[0] if errors else (None, "failed")
    shown = ""
    if samples is not None and i is not None and i < len(samples):
        shown = f" (completion: {completion_text(samples[i])[:120]!r})"
    text = f"reward '{reward}' failed on {where(i)}{shown}: {first_line(msg)}"
    rest = errors[1:]
    if rest and all(first_line(m) == first_line(msg) for _, m in rest):
        text += f"; the same on {', '.join(where(j) for j, _ in rest[:8])}" + (f" and {len(rest) - 8} more" if len(rest) > 8 else "")
    elif rest:
        text += "; also " + "; ".join(f"{where(j)}: {first_line(m)}" for j, m in rest[:4])
        text += f"; and {len(rest) - 4} more" if len(rest) > 4 else ""
    return text


def register(name: str, *, columns: tuple[str, ...] = (), description: str | None = None,
             factory: Callable[..., RewardFn] | None = None):
    """Decorator: add `fn` to the registry under `name` (overwrites on purpose: users may replace).
    `columns`: dataset columns the reward reads; `factory(**options)` builds configured variants."""

    def deco(fn: RewardFn) -> RewardFn:
        doc = description or (fn.__doc__ or "").strip().split("\n")[0]
        REGISTRY[name] = RewardSpec(name, fn, tuple(columns), doc, factory)
        return fn

    return deco
