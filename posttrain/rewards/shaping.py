"""Length shaping: DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13).

With maximum length Lmax and buffer Lcache:

    R(L) = 0                          if L <= Lmax - Lcache
         = ((Lmax - Lcache) - L) / Lcache   if Lmax - Lcache < L <= Lmax     (0 -> -1 linearly)
         = -1                         if L > Lmax

It is added to the task reward (compose "math:1,overlong:1"). L is the token count when the
trainer passes `completion_ids` (TRL does), else the number of whitespace-separated words, or
characters with unit="chars". `overlong_defaults(max_new_tokens)` gives DAPO's proportions
(Lcache = Lmax / 5) for a generation limit.
"""

from __future__ import annotations

from posttrain.rewards.base import completion_text, register


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    """R(L) above. DAPO uses Lmax = 20480, Lcache = 4096 tokens."""
    soft = max_len - cache_len
    if length <= soft:
        return 0.0
    if length <= max_len:
        return (soft - length) / cache_len
    return -1.0


def overlong_defaults(max_new_tokens: int) -> dict:
    """Options for `make_overlong_reward` scaled to the generation limit: Lmax = max_new_tokens and
    Lcache = max_new_tokens / 5, DAPO's ratio (20,480-token limit with a 4,096-token soft buffer).
    Pass `completion_ids` to the reward so that L is counted in tokens, like max_new_tokens."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return {"max_len": max_new_tokens, "cache_len": max(1, round(max_new_tokens / 5))}


def make_overlong_reward(max_len: int = 4096, cache_len: int = 512, unit: str = "auto"):
    """Build the overlong penalty; unit: auto (completion_ids if given, else words) | tokens | words | chars."""
    if not 0 < cache_len <= max_len:
        raise ValueError("need 0 < cache_len <= max_len")
    if unit not in ("auto", "tokens", "words", "chars"):
        raise ValueError("unit must be auto, tokens, words or chars")

    def overlong_reward(prompts, completions, completion_ids=None, **_):
        out = []
        for i, c in enumerate(completions):
            if unit in ("auto", "tokens") and completion_ids is not None:
                n = len(completion_ids[i])
            elif unit == "tokens":
                raise ValueError("unit='tokens' needs completion_ids (passed by the trainer)")
            elif unit == "chars":
                n = len(completion_text(c))
            else:
                n = len(completion_text(c).split())
            out.append(overlong_penalty(n, max_len, cache_len))
        return out

    return overlong_reward


register("overlong", factory=make_overlong_reward,
         description="DAPO soft overlong punishment: 0, then linear to -1 in the last cache_len, -1 beyond max_len")(
    make_overlong_reward())
