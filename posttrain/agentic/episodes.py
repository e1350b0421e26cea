"""What `posttrain rl env=...` and `posttrain eval env=...` share about an agent's episodes: the set-up
(environment factory and tool format, checked on the data before any model loads), the agent/* metrics of
a batch of episodes, and an episode rendered turn by turn with its loss mask.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from posttrain.agentic.env import bind_env, start_messages, tools_of
from posttrain.agentic.envs import load_env
from posttrain.agentic.formats import make_format
from posttrain.agentic.rollout import Episode, RolloutStats


@dataclass
class AgentRun:
    make_env: object
    fmt: object
    prompt_len: int  # mean over the dataset (what the planner gets)
    totals: Counter = field(default_factory=Counter)


def setup_agent(cfg, tok, rows) -> AgentRun:
    """Environment factory and tool format, checked before any model loads (a reset per row).
    `cfg` has env, env_args and agent (tool_format, tool_tags)."""
    make_env = load_env(cfg.env, cfg.env_args)
    fmt = make_format(tok, tools_of(make_env()), cfg.agent.tool_format, tuple(cfg.agent.tool_tags))
    lengths = []
    for row in rows[:256]:
        env = make_env()
        bind_env(env, fmt)
        try:
            lengths.append(len(fmt.prompt_ids(start_messages(env, row.data, 0))))
        except (KeyError, ValueError, TypeError) as e:
            raise row.error(None, f"env {cfg.env} cannot start an episode from this row: {type(e).__name__}: {e}") from None
    return AgentRun(make_env, fmt, round(sum(lengths) / len(lengths)))


def episode_metrics(episodes: list[Episode], stats: RolloutStats, success_threshold: float = 1.0) -> dict:
    """agent/* metrics of a batch of episodes (means over episodes unless the name says otherwise)."""
    n = max(len(episodes), 1)
    calls = [c for e in episodes for c in e.tool_calls]
    context = sum(len(e.prompt_ids) + len(e.response_ids) for e in episodes)
    out = {
        "agent/success": sum(e.reward is not None and e.reward >= success_threshold for e in episodes) / n,
        "agent/turns": sum(len(e.turns) for e in episodes) / n,
        "agent/tool_calls": len(calls) / n,
        "agent/tool_errors": sum(c["status"] not in ("ok", "timeout") for c in calls),
        "agent/tool_timeouts": sum(c["status"] == "timeout" for c in calls),
        "agent/generated_tokens": sum(t.generated for e in episodes for t in e.turns) / n,
        "agent/returned_tokens": sum(t.returned for e in episodes for t in e.turns) / n,
        "agent/context_tokens": context / n,
        "agent/env_s": stats.env_s, "agent/model_s": stats.model_s, "agent/rollout_wall_s": stats.wall_s,
    }
    if stats.prefill_tokens is not None:
        out["agent/prefill_over_context"] = stats.prefill_tokens / max(context, 1)
    for reason, count in Counter(e.finish_reason for e in episodes).items():
        out[f"agent/finish/{reason}"] = count / n
    keys = sorted({k for e in episodes for k in e.metrics})
    for k in keys:
        vals = [e.metrics[k] for e in episodes if k in e.metrics]
        out[f"agent/{k}"] = sum(vals) / len(vals)
    return out


def render_episode(ep: Episode, tok) -> dict:
    """The episode turn by turn: segments of text with their loss mask (1 = the model's own tokens)."""
    segments, cursor = [], 0
    for s, e in ep.spans:
        if s > cursor:
            segments.append({"loss": 0, "text": tok.decode(ep.response_ids[cursor:s])})
        segments.append({"loss": 1, "text": tok.decode(ep.response_ids[s:e])})
        cursor = e
    if cursor < len(ep.response_ids):
        segments.append({"loss": 0, "text": tok.decode(ep.response_ids[cursor:])})
    return {"group": ep.group, "sample": ep.sample, "prompt": tok.decode(ep.prompt_ids), "segments": segments,
            "reward": ep.reward, "finish_reason": ep.finish_reason, "turns": len(ep.turns),
            "tool_calls": ep.tool_calls, "metrics": ep.metrics}
