"""A tiny name registry (the pattern of verl's `core_algos.py`): algorithms are plain functions
registered under a name; recipes look them up from the config string.

    policy_losses = Registry("policy loss")

    @policy_losses.register("ppo", level="token")
    def ppo(logp, old_logp, advantages, mask, *, eps=0.2): ...

    fn = policy_losses.get("ppo")          # unknown names raise ValueError with the nearest names
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Iterator


class Registry:
    """name -> function, plus free-form metadata per entry (e.g. {"level": "token"})."""

    def __init__(self, kind: str):
        self.kind = kind  # used in error messages: "unknown policy loss 'ppx'"
        self._fns: dict[str, Callable] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[Callable], Callable]:
        """Decorator adding `fn` under `name`. Re-registering a name replaces it (users may override)."""

        def deco(fn: Callable) -> Callable:
            self._fns[name] = fn
            self._meta[name] = dict(meta)
            return fn

        return deco

    def get(self, name: str) -> Callable:
        try:
            return self._fns[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._fns), n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"unknown {self.kind} {name!r}{hint} (known: {', '.join(self.names())})"
            ) from None

    def meta(self, name: str) -> dict[str, Any]:
        self.get(name)  # same error for unknown names
        return dict(self._meta[name])

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._fns)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


# The public registries. Each module below fills its own on import (see posttrain/algos/__init__.py).
advantages = Registry("advantage estimator")
policy_losses = Registry("policy loss")
preference_losses = Registry("preference loss")
kl_estimators = Registry("KL estimator")
distill_losses = Registry("distillation loss")
