"""Configs derived from another recipe's config (distillation runs the SFT, RL and rejection-sampling recipes
with its own settings): every field the two configs share by name is copied, so a field added to both
reaches the derived config without a key list to update."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

T = TypeVar("T", bound=BaseModel)


def shared_fields(source: BaseModel, target: type[BaseModel], exclude: tuple[str, ...] = ()) -> dict:
    """{name: value of `source`} for every field of `target` that `source`'s class also has (but `exclude`)."""
    have = type(source).model_fields
    return {k: getattr(source, k) for k in target.model_fields if k in have and k not in exclude}


def derive(source: BaseModel, target: type[T], exclude: tuple[str, ...] = (), **update) -> T:
    """A `target` config with `source`'s values of the fields they share, then `update` (wins), validated."""
    return target(**{**shared_fields(source, target, exclude), **update})
