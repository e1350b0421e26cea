"""Online RL (the GRPO family and PPO) under `torchrun --nproc-per-node W -m posttrain rl …`, FSDP2-sharded.

Per step, on every rank:
    generate   (ShardedRollout) rank r samples rows r, r + W, … of the round with a full, plain copy of the policy (the
               rollout engine's weights); row i samples with seed + i, so the samples are those one process
               would draw; each rank scores its own groups, then the scored groups of all ranks are gathered
               (every rank holds the whole batch, in group order: advantages and normalisers need no reduction)
    update     each minibatch's micro-batches are shared among the ranks (posttrain/systems/dist.py:
               rank_share, weight-0 padding); the loss statistics are gathered and merged once per update
    sync       the sharded weights are gathered into the rollout copy (a collective), the engine re-packs them

so the run follows the single-process run on the same seed, up to summation order. PPO's value model is
sharded like the policy (posttrain/recipes/rl/ppo.py: Critic); its values and the GAE run on every rank
over the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from posttrain.recipes.rl import phases as ph
from posttrain.recipes.rl.rollout import GroupRollout
from posttrain.recipes.rl.run import UpdateStats
from posttrain.systems import fsdp
from posttrain.systems.dist import DistInfo, gather_objects, rank_share


class ShardedRollout(GroupRollout):
    """Under torchrun: each rank generates and scores its share of the round's rows with a full, plain copy
    of the policy (`policy_copy`, the engine's weights), then every rank gathers the whole round."""

    def __init__(self, inner: torch.nn.Module, policy_copy: torch.nn.Module):
        self.inner, self.policy_copy = inner, policy_copy  # the HF model inside the FSDP root; the engine's copy

    def produce(self, run, step, rows, first, seed, rows_by_group):
        """This rank's rows generated and scored; -> (every rank's trajectories in group order, reward
        metrics over the ranks' samples)."""
        info = run.info
        mine = list(range(info.rank, len(rows), info.world))
        new = []
        with run.timer("generate"):
            requests = ph.requests_for(run.tok, rows, run.cfg, seed)
            results = run.engine.generate([requests[i] for i in mine]) if mine else []
            for i, res in zip(mine, results):
                new += ph.trajectories(res, rows[i], run.tok, first + i, step)
        values: dict = {}
        metrics: dict = {}
        with run.timer("reward"):
            if new:
                ph.score(run.reward_fn, rows_by_group, new)
                values = getattr(run.reward_fn, "last_values", {})
                metrics = {k: v for k, v in run.reward_fn.last_metrics.items() if isinstance(v, (int, float))}
        with run.timer("gather"):
            parts = gather_objects((new, values, metrics), info)
        trajs = sorted((t for part, _, _ in parts for t in part), key=lambda t: t.group)  # stable: sample order kept
        return trajs, merge_reward_metrics([(v, m) for _, v, m in parts])

    @torch.no_grad()
    def sync_weights(self, run) -> None:
        """The sharded policy's full weights into the engine's plain copy (a collective: every rank calls it)."""
        full = fsdp.full_state(self.inner)
        for name, p in self.policy_copy.named_parameters():
            p.copy_(full[name])
        run.engine.sync_weights()


def merge_reward_metrics(parts: list[tuple[dict, dict]]) -> dict:
    """One process's `rewards/<name>/…` metrics from the ranks' (per-sample values, metrics): mean and std
    over every applicable sample, `none` and `errors` summed, `seconds` the slowest rank's; a reward's own
    counters (math's rejected, timeouts, …) summed when they are integers, else averaged."""
    out: dict = {}
    for name in dict.fromkeys(n for values, _ in parts for n in values):
        vals = [v for values, _ in parts for v in values.get(name, [])]
        got = [v for v in vals if v is not None]
        errors = sum(m.get(f"rewards/{name}/errors", 0) for _, m in parts)
        mean = sum(got) / len(got) if got else float("nan")
        std = math.sqrt(sum((v - mean) ** 2 for v in got) / len(got)) if got else float("nan")
        out.update({f"rewards/{name}/mean": mean, f"rewards/{name}/std": std, f"rewards/{name}/errors": errors,
                    f"rewards/{name}/none": len(vals) - len(got) - errors,
                    f"rewards/{name}/seconds": max(m.get(f"rewards/{name}/seconds", 0.0) for _, m in parts)})
    for key in dict.fromkeys(k for _, m in parts for k in m if k not in out):
        xs = [m[key] for _, m in parts if key in m]
        out[key] = sum(xs) if all(isinstance(x, int) for x in xs) else sum(xs) / len(xs)
    return out


def my_batches(batches: list, minibatches: int, info: DistInfo) -> list:
    """The micro-batches this rank computes in `update` (its share of each minibatch, padding included)."""
    seen, out = set(), []
    for mb in ph.minibatches(batches, minibatches):
        for b, _ in rank_share(mb, info):
            if id(b) not in seen:
                seen.add(id(b))
                out.append(b)
    return out


def reduce_stats(stats: UpdateStats, info: DistInfo) -> UpdateStats:
    """The ranks' update statistics merged (token-weighted means, extremes, sums, the max |Δ log p|)."""
    if info.world == 1:
        return stats
    total = UpdateStats(grad_norm=stats.grad_norm)
    for part in gather_objects(replace(stats, grad_norm=None), info):
        total.merge(part)
    return total
