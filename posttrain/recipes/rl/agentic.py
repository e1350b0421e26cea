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

from pathlib import Path

from posttrain.agentic.episodes import AgentRun, episode_metrics, render_episode
from posttrain.agentic.formats import encode
from posttrain.agentic.rollout import Episode, RolloutStats, new_episodes, run_episodes
from posttrain.outputs import to_json, write_json
from posttrain.recipes.rl.rollout import GroupRollout


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


def write_episodes(path, step: int, episodes: list[Episode], tok) -> None:
    with open(path, "a") as f:
        for ep in episodes:
            f.write(to_json({"step": step + 1, **render_episode(ep, tok)}, ensure_ascii=False) + "\n")


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
    write_json(out / "agent_plan.json", doc, indent=2)
