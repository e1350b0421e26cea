"""`posttrain rl env=...`: the rollout source for multi-turn episodes (`AgentRollout`).

The recipe is unchanged otherwise (same algorithms, advantage, reference, update): with `env` set,
setup chooses this source, which returns Trajectories whose `loss_spans` cover the
model's own tokens only, with the environment's reward at the end. The advantage is the
trajectory-level group baseline of the chosen algorithm (GRPO: (r − mean_G) / std_G), shared by
every token the model generated in the episode; the policy loss's importance ratios are per token
(or per sequence with GSPO), over the model's tokens only.

Per step it logs agent/* metrics (turns, tool calls, tool errors and timeouts, environment vs model
time, finish reasons, tokens generated vs returned, prefill vs context), writes a few episodes turn
by turn with the loss mask visible (episodes.jsonl), and keeps agent_plan.json: the planner's
turns × (generated + returned) prediction against the measured tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.agentic.envs import load_env
from posttrain.agentic.formats import encode, make_format
from posttrain.agentic.rollout import Episode, RolloutStats, new_episodes, run_episodes
from posttrain.recipes.rl.rollout import GroupRollout


@dataclass
class AgentRun:
    make_env: object
    fmt: object
    prompt_len: int  # mean over the dataset (what the planner gets)
    totals: Counter = field(default_factory=Counter)


def setup_agent(cfg, tok, rows) -> AgentRun:
    """Environment factory and tool format, checked before any model loads (a reset per row)."""
    make_env = load_env(cfg.env, cfg.env_args)
    proto = make_env()
    fmt = make_format(tok, list(proto.tools), cfg.agent.tool_format, tuple(cfg.agent.tool_tags))
    lengths = []
    for row in rows[:256]:
        env = make_env()
        env.bind(fmt)
        try:
            lengths.append(len(fmt.prompt_ids(env.reset(row.data, 0))))
        except (KeyError, ValueError, TypeError) as e:
            raise row.error(None, f"env {cfg.env} cannot start an episode from this row: {type(e).__name__}: {e}") from None
    return AgentRun(make_env, fmt, round(sum(lengths) / len(lengths)))


class AgentRollout(GroupRollout):
    """B groups of G episodes per step; dynamic sampling refills like every synchronous source."""

    one_prompt_per_group = False  # an environment may start each episode of a group differently

    def __init__(self, agent: AgentRun, life):
        self.agent, self.life = agent, life
        self.episodes: list[Episode] = []
        self.stats = RolloutStats()
        life.fresh_file("episodes.jsonl")

    def collect(self, run, step: int):
        self.episodes, self.stats = [], RolloutStats()
        return super().collect(run, step)

    def produce(self, run, step, rows, first, seed, rows_by_group):
        cfg, agent = run.cfg, self.agent
        with run.timer("generate"):
            groups = new_episodes(agent.make_env, [r.data for r in rows], cfg.group_size, agent.fmt, seed, first)
            stats = run_episodes(run.engine, agent.fmt, groups, cfg.agent, cfg.sampling, run.tok)
        _add_stats(self.stats, stats)
        eps = [e for g in groups for e in g]
        self.episodes.extend(eps)
        return [e.to_trajectory(run.tok, version=step) for e in eps], {}

    def finish_metrics(self, run, step: int, metrics: dict) -> dict:
        """agent/* metrics; a few episodes written turn by turn; agent_plan.json updated."""
        write_episodes(self.life.out / "episodes.jsonl", step, self.episodes[: run.cfg.samples_per_log], run.tok)
        update_plan_check(self.life.out, self.agent, self.episodes, step)
        return episode_metrics(self.episodes, self.stats)

    def plan_inputs(self, run) -> dict:
        return {"method": "agent", **plan_inputs(run.cfg, self.agent)}


def _add_stats(total: RolloutStats, s: RolloutStats) -> None:
    total.model_s += s.model_s
    total.env_s += s.env_s
    total.wall_s += s.wall_s
    total.requests += s.requests
    if s.prefill_tokens is not None:
        total.prefill_tokens = (total.prefill_tokens or 0) + s.prefill_tokens


# ---------------------------------------------------------------- metrics, episodes, plan check


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


def histogram(values) -> dict:
    return {str(k): v for k, v in sorted(Counter(values).items())}


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


def write_episodes(path, step: int, episodes: list[Episode], tok) -> None:
    with open(path, "a") as f:
        for ep in episodes:
            f.write(json.dumps({"step": step + 1, **render_episode(ep, tok)}, ensure_ascii=False) + "\n")


def plan_inputs(cfg, agent: AgentRun) -> dict:
    """What the planner is told before the run: every episode takes max_turns turns of max_new_tokens,
    each observation the glue plus `plan_return_len` (default: max_observation_tokens) tokens."""
    glue = len(encode(agent.fmt.tok, agent.fmt.glue.before)) + len(encode(agent.fmt.tok, agent.fmt.glue.after))
    obs = cfg.agent.plan_return_len if cfg.agent.plan_return_len is not None else cfg.agent.max_observation_tokens
    return {"turns": cfg.agent.max_turns, "seq_len": cfg.sampling.max_new_tokens, "return_len": glue + obs,
            "prompt_len": agent.prompt_len}


def update_plan_check(out: Path, agent: AgentRun, episodes: list[Episode], step: int) -> None:
    """agent_plan.json: the planner's context formula P + T·g + (T − 1)·r at the measured means of
    turns, generated and returned tokens per turn, against the measured context tokens."""
    t = agent.totals
    t["episodes"] += len(episodes)
    t["turns"] += sum(len(e.turns) for e in episodes)
    t["generated"] += sum(x.generated for e in episodes for x in e.turns)
    t["returned"] += sum(x.returned for e in episodes for x in e.turns)
    t["prompt"] += sum(len(e.prompt_ids) for e in episodes)
    t["context"] += sum(len(e.prompt_ids) + len(e.response_ids) for e in episodes)
    n, turns = t["episodes"], t["turns"]
    T = turns / n
    g = t["generated"] / turns
    r = t["returned"] / max(turns - n, 1)  # observations follow every turn but the last
    predicted = {"context_tokens": t["prompt"] / n + T * g + (T - 1) * r}  # plan.cost.agent_trajectory's formula
    doc = {"steps": step + 1, "measured": {"episodes": n, "turns_mean": T, "generated_per_turn": g,
                                           "returned_per_observation": r, "context_tokens_mean": t["context"] / n},
           "planner_at_measured_means": predicted,
           "context_over_predicted": (t["context"] / n) / predicted["context_tokens"]}
    (out / "agent_plan.json").write_text(json.dumps(doc, indent=2))
