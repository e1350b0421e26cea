"""Format reward: 1 if the whole completion matches a regex (full match), else 0.

The default is DeepSeek-R1's template (DeepSeek-AI 2025, "DeepSeek-R1", §2.2.2):
`<think> reasoning </think> <answer> answer </answer>` with nothing else around it. A
user-supplied pattern runs in the killable worker pool, since a pattern with nested quantifiers can
backtrack for exponential time on a hostile completion; the default pattern is linear and runs
inline.
"""

from __future__ import annotations

import re

from posttrain.rewards.base import RewardError, completion_text, register
from posttrain.rewards.pool import default_pool

THINK_ANSWER = r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*"


def _match(pattern: str, flags: int, text: str) -> float:
    return 1.0 if re.fullmatch(pattern, text, flags) else 0.0


def make_format_reward(pattern: str = THINK_ANSWER, dotall: bool = True, timeout: float = 2.0,
                       workers: int | None = None):
    """Build a full-match regex reward. `pattern` is compiled now, so a bad one fails early."""
    flags = re.S if dotall else 0
    re.compile(pattern, flags)
    isolated = pattern != THINK_ANSWER

    def format_reward(prompts, completions, **_):
        texts = [completion_text(c) for c in completions]
        if not isolated:
            format_reward.last_metrics = {}
            return [_match(pattern, flags, t) for t in texts]
        outs = default_pool(workers).map(_match, [(pattern, flags, t) for t in texts], timeout=timeout)
        scores, errors, timeouts = [], [], 0
        for i, o in enumerate(outs):
            if o.timed_out:
                timeouts += 1
            if o.error:
                errors.append((i, o.error))
            scores.append(o.value if o.ok else (0.0 if o.timed_out else None))
        format_reward.last_metrics = {"timeouts": timeouts}
        if errors:
            raise RewardError("format", errors, scores, samples=completions)
        return scores

    format_reward.last_metrics = {}
    return format_reward


register("format", factory=make_format_reward,
         description="1 if the completion is exactly <think>...</think><answer>...</answer> (or a given full-match regex)")(
    make_format_reward())
