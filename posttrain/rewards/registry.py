"""Reward registry and weighted composition (SPEC §5).

Every reward has the signature of TRL's reward functions:

    f(prompts, completions, **columns) -> list[float | None]     # None = "does not apply, skip"

`completions` may be strings or conversations (`[{"role", "content"}, ...]`); `completion_text`
takes the last assistant message. Extra dataset columns (`answer`, `tests`, ...) arrive as keyword
arguments, one list per column. Register your own:

    from posttrain.rewards.registry import register
    @register("shout", columns=())
    def shout(prompts, completions, **kw):
        return [float(completion_text(c).isupper()) for c in completions]

`compose("math:1.0,format:0.2")` builds the weighted sum r = Σ_i w_i r_i over the rewards that are
not None for a sample (TRL's nansum semantics; all None -> None), with per-reward metrics. A reward
that raises or returns NaN/inf is never turned into 0: it raises `RewardError` naming the reward
and the sample, or, with `on_error="record"`, the value becomes None and the error is listed in
`last_errors` with the sample index.
"""

from __future__ import annotations

import difflib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from posttrain.errors import UserError

RewardFn = Callable[..., list]


@dataclass
class RewardSpec:
    name: str
    fn: RewardFn
    columns: tuple[str, ...] = ()  # dataset columns the reward needs (any one of a tuple-of-alternatives entry)
    description: str = ""
    factory: Callable[..., RewardFn] | None = None  # builds a configured variant: factory(**options)

    def build(self, options: dict | None = None) -> RewardFn:
        if not options:
            return self.fn
        if self.factory is None:
            raise UserError(f"reward '{self.name}' takes no options (got {sorted(options)})")
        try:
            return self.factory(**options)
        except TypeError as e:
            raise UserError(f"reward '{self.name}': bad options {options}: {e}") from None


_REGISTRY: dict[str, RewardSpec] = {}


class RewardError(UserError):
    """A reward raised or returned a non-finite value. `errors`: [(sample index or None, message)]."""

    def __init__(self, reward: str, errors: list[tuple[int | None, str]], values: list | None = None,
                 samples: list | None = None):
        self.reward, self.errors, self.values = reward, errors, values
        lines = []
        for i, msg in errors[:5]:
            where = f"sample {i}" if i is not None else "batch"
            shown = ""
            if samples is not None and i is not None and i < len(samples):
                shown = f" (completion: {completion_text(samples[i])[:120]!r})"
            lines.append(f"reward '{reward}' failed on {where}{shown}: {msg.strip().splitlines()[0] if msg.strip() else msg}")
        more = f"\n... and {len(errors) - 5} more" if len(errors) > 5 else ""
        super().__init__("\n".join(lines) + more)


def register(name: str, *, columns: tuple[str, ...] = (), description: str | None = None,
             factory: Callable[..., RewardFn] | None = None):
    """Decorator: add `fn` to the registry under `name` (overwrites on purpose: users may replace).
    `columns`: dataset columns the reward reads; `factory(**options)` builds configured variants."""

    def deco(fn: RewardFn) -> RewardFn:
        doc = description or (fn.__doc__ or "").strip().split("\n")[0]
        _REGISTRY[name] = RewardSpec(name, fn, tuple(columns), doc, factory)
        return fn

    return deco


def _load_builtins() -> None:
    # importing the modules registers their rewards
    from posttrain.rewards import code, format, language, math as _math, shaping  # noqa: F401


def get(name: str) -> RewardSpec:
    _load_builtins()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"unknown reward '{name}'{hint} (known: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def completion_text(completion: Any) -> str:
    """Plain string, or the content of the last assistant message of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, list):
        for msg in reversed(completion):
            if isinstance(msg, dict) and msg.get("role", "assistant") == "assistant":
                content = msg.get("content", "")
                if isinstance(content, list):  # multimodal parts: keep the text ones
                    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
                return str(content)
        return ""
    return "" if completion is None else str(completion)


def parse_spec(spec: str | dict | list) -> list[tuple[str, float]]:
    """'math:1.0,format:0.2' | {'math': 1.0} | [('math', 1.0)] -> [(name, weight)]; weight defaults to 1."""
    if isinstance(spec, dict):
        items = list(spec.items())
    elif isinstance(spec, (list, tuple)):
        items = [(s, 1.0) if isinstance(s, str) else tuple(s) for s in spec]
    else:
        items = []
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            name, _, w = part.partition(":")
            try:
                items.append((name.strip(), float(w) if w.strip() else 1.0))
            except ValueError:
                raise UserError(f"reward spec '{spec}': weight of '{name}' is not a number: {w!r}") from None
    if not items:
        raise UserError(f"reward spec '{spec}' names no reward")
    for name, w in items:
        get(name)
        if not math.isfinite(float(w)):
            raise UserError(f"reward spec '{spec}': weight of '{name}' must be finite")
    return [(n, float(w)) for n, w in items]


def _check_values(name: str, values: Any, n: int) -> tuple[list, list[tuple[int | None, str]]]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        return [None] * n, [(None, f"must return a list of {n} values, got {got}")]
    out, errors = [], []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            out.append(None)
            errors.append((i, f"returned a non-number: {v!r}"))
            continue
        if not math.isfinite(f):
            out.append(None)
            errors.append((i, f"returned {f}"))
            continue
        out.append(f)
    return out, errors


def call_reward(name: str, fn: RewardFn, prompts: list, completions: list, columns: dict) -> tuple[list, list]:
    """Call one reward; on an exception, re-run sample by sample to name the culprits."""
    n = len(completions)
    try:
        values = fn(prompts, completions, **columns)
    except RewardError as e:  # built-in rewards report per-sample errors themselves
        vals = e.values if e.values is not None else [None] * n
        out, errs = _check_values(name, vals, n)
        return out, e.errors + errs
    except Exception as e:
        if n <= 1:
            return [None] * n, [(0 if n else None, f"{type(e).__name__}: {e}")]
        out, errors = [], []
        for i in range(n):
            sub = {k: v[i:i + 1] for k, v in columns.items()}
            o, errs = call_reward(name, fn, prompts[i:i + 1], completions[i:i + 1], sub)
            out.extend(o)
            errors.extend((i, m) for _, m in errs)
        return out, errors
    return _check_values(name, values, n)


@dataclass
class ComposedReward:
    """Σ w_i r_i over registered rewards, TRL-compatible (`__name__` set for TRL's logging)."""

    parts: list[tuple[str, float]]
    on_error: str = "raise"  # or "record"
    options: dict = field(default_factory=dict)  # reward name -> factory options
    last_metrics: dict = field(default_factory=dict)
    last_values: dict = field(default_factory=dict)  # name -> list of per-sample values
    last_errors: list = field(default_factory=list)  # [{"reward", "index", "error"}]

    def __post_init__(self):
        self.__name__ = "+".join(n for n, _ in self.parts)
        unknown = set(self.options) - {n for n, _ in self.parts}
        if unknown:
            raise UserError(f"options given for rewards not in the composition: {sorted(unknown)}")
        self.fns = {n: get(n).build(self.options.get(n)) for n, _ in self.parts}

    @property
    def columns(self) -> dict[str, tuple]:
        return {n: get(n).columns for n, _ in self.parts}

    def __call__(self, prompts: list, completions: list, **columns) -> list[float | None]:
        n = len(completions)
        prompts = list(prompts) if prompts is not None else [None] * n
        total: list[float | None] = [None] * n
        self.last_metrics, self.last_values, self.last_errors = {}, {}, []
        for name, w in self.parts:
            t0 = time.perf_counter()
            values, errors = call_reward(name, self.fns[name], prompts, completions, columns)
            dt = time.perf_counter() - t0
            if errors and self.on_error == "raise":
                raise RewardError(name, errors, values, samples=completions)
            self.last_errors += [{"reward": name, "index": i, "error": m} for i, m in errors]
            self.last_values[name] = values
            got = [v for v in values if v is not None]
            mean = sum(got) / len(got) if got else float("nan")
            std = math.sqrt(sum((v - mean) ** 2 for v in got) / len(got)) if got else float("nan")
            self.last_metrics.update({
                f"rewards/{name}/mean": mean, f"rewards/{name}/std": std,
                f"rewards/{name}/none": n - len(got) - len(errors), f"rewards/{name}/errors": len(errors),
                f"rewards/{name}/seconds": dt,
            })
            extra = getattr(self.fns[name], "last_metrics", None)
            if isinstance(extra, dict):
                self.last_metrics.update({f"rewards/{name}/{k}": v for k, v in extra.items()})
            for i, v in enumerate(values):
                if v is not None:
                    total[i] = (total[i] or 0.0) + w * v
        return total


def compose(spec: str | dict | list, on_error: str = "raise", options: dict | None = None) -> ComposedReward:
    """`compose("math:1.0,format:0.2", options={"math": {"require": "answer_tag"}})` -> a callable
    reward with TRL's signature."""
    if on_error not in ("raise", "record"):
        raise ValueError("on_error must be 'raise' or 'record'")
    return ComposedReward(parse_spec(spec), on_error=on_error, options=dict(options or {}))
