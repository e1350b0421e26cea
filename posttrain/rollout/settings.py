"""Sampling settings as a config section, shared by every recipe that samples (rl, rs, eval, …).

The fields and their meaning are the engine's `SamplingParams` (rollout/types.py); this is the
validated, documented form that appears in a recipe's config as `sampling.*`, turned into
per-request `SamplingParams` by `params()`.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from posttrain.config import Config
from posttrain.rollout.types import SamplingParams


def check_stops(value: list[str]) -> list[str]:
    """stop_strings: non-empty strings (an empty one would stop every sample before its first token)."""
    if any(not s for s in value):
        raise ValueError(f"stop strings must be non-empty (got {value!r}); leave out the empty one")
    return value


class SamplingSettings(Config):
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0 = greedy); the trainer scores with the same")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (behaviour log-probs are of the truncated distribution)")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    max_new_tokens: int = Field(128, ge=1, description="generation limit per sample")
    ignore_eos: bool = Field(False, description="always generate max_new_tokens (benchmarks and planner checks)")
    stop_strings: list[str] = Field(default_factory=list, description="stop when the completion contains one (kept in the output)")

    _stops = field_validator("stop_strings")(check_stops)

    def params(self, n: int = 1, seed: int | None = None) -> SamplingParams:
        return SamplingParams(n=n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, ignore_eos=self.ignore_eos,
                              stop_strings=list(self.stop_strings), seed=seed)

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1
