"""Where an RL step's trajectories come from: the synchronous sources of the `Rollout` protocol (run.py).

Setup chooses one source per run (build.py: `make_rollout`); the step only calls the protocol:

    collect(run, step) -> (trajectories, metrics)   B groups of G scored samples for this step
    sync_weights(run)                                after an update: the sampler picks up the new policy
    plan_inputs(run) -> dict                         token shape of a step, for the planner
    state() / load_state(checkpoint, start)          what a checkpoint keeps of the source / resume from one
    summary() -> dict                                totals for summary.json
    close()                                          stop background work (threads, actors)

Sources: `SyncRollout` (here: the engine generates, the reward scores), `ShardedRollout` (sharded.py:
torchrun ranks share generation), `AgentRollout` (agentic.py: multi-turn episodes with tools) and
`AsyncRollout` / `RayRollout` (async_rl.py, ray_cluster.py: a producer thread or Ray actor feeds a queue).
The synchronous kinds share `GroupRollout.collect`: dynamic sampling and refill (phases.refill_groups)
and scoring (phases.score) exist once.

Adding a source: implement the protocol in one file (usually a `GroupRollout` with its own `produce`)
and choose it in `make_rollout`.
"""

from __future__ import annotations

from posttrain.data.formats import Row
from posttrain.data.templates import render_prompt
from posttrain.recipes.rl import phases as ph
from posttrain.recipes.rl.run import RLRun
from posttrain.rollout.trajectory import Trajectory
from posttrain.training.curriculum import BandSampler, prompt_of


class GroupRollout:
    """A synchronous source: each round, `produce` turns new prompt rows into scored groups; `collect`
    draws the rows and, with dynamic sampling, refills groups without signal (phases.refill_groups)."""

    one_prompt_per_group = True  # the G samples of a group share their prompt (checked)

    def collect(self, run: RLRun, step: int) -> tuple[list[Trajectory], dict]:
        rows_by_group: dict[int, Row] = {}
        first_metrics: dict = {}

        def produce(rows: list[Row], first: int, rounds: int) -> list[Trajectory]:
            rows_by_group.update({first + j: r for j, r in enumerate(rows)})
            new, metrics = self.produce(run, step, rows, first, ph.batch_seed(run.cfg.seed, step, rounds), rows_by_group)
            if run.curriculum is not None:  # every group scored, dropped ones too: the band learns from them
                observe_groups(run.curriculum, rows_by_group, new)
            if rounds == 0:
                first_metrics.update(metrics)
            return new

        kept, dynamic = ph.refill_groups(run, produce)
        if self.one_prompt_per_group:
            assert all(len({tuple(t.prompt_ids) for t in kept if t.group == g}) == 1 for g in {t.group for t in kept})
        band = run.curriculum.step_metrics() if run.curriculum is not None else {}
        return kept, {**self.finish_metrics(run, step, first_metrics), **dynamic, **band}

    def produce(self, run: RLRun, step: int, rows: list[Row], first: int, seed: int,
                rows_by_group: dict[int, Row]) -> tuple[list[Trajectory], dict]:
        """rows -> (scored trajectories of groups first, first + 1, …; the round's metrics)."""
        raise NotImplementedError

    def finish_metrics(self, run: RLRun, step: int, metrics: dict) -> dict:
        """The step's collect metrics from the first round's (numbers only: rewards/<name>/…)."""
        return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}

    def sync_weights(self, run: RLRun) -> None:
        run.engine.sync_weights()  # the engine shares the policy's weights: its packed copies and KV are stale

    def plan_inputs(self, run: RLRun) -> dict:
        return sampled_plan_inputs(run)

    def state(self) -> dict:
        return {}  # the data position is the run's sampler, checkpointed by the step

    def load_state(self, checkpoint: dict, start: int) -> None:
        pass  # the step restores the sampler

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class SyncRollout(GroupRollout):
    """One process: the engine generates each round's groups, then the reward scores them."""

    def produce(self, run, step, rows, first, seed, rows_by_group):
        with run.timer("generate"):
            new = ph.generate(run.engine, run.tok, rows, first, run.cfg, seed, version=step)
        with run.timer("reward"):
            ph.score(run.reward_fn, rows_by_group, new)
        return new, run.reward_fn.last_metrics


def observe_groups(curriculum: BandSampler, rows_by_group: dict[int, Row], trajs: list[Trajectory]) -> None:
    """Each group's rewards into the curriculum's pass rate of its row's prompt."""
    rewards: dict[int, list] = {}
    for t in trajs:
        rewards.setdefault(t.group, []).append(t.reward)
    for g, values in rewards.items():
        curriculum.observe(prompt_of(rows_by_group[g].data), values)


def sampled_plan_inputs(run: RLRun) -> dict:
    """The planner's token shape of a step of single-turn samples: every sample runs to max_new_tokens,
    prompts as long as the dataset's mean."""
    prompt_len = round(sum(len(render_prompt(run.tok, r.data["prompt"])) for r in run.rows) / len(run.rows))
    return {"seq_len": run.cfg.sampling.max_new_tokens, "prompt_len": prompt_len}
