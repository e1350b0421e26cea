"""The last phase of every RL step: one metrics.jsonl row (rewards, lengths, throughput, the engine's
signals of the step: engine/tokens_per_s, engine/kv_peak_frac, engine/preemptions, engine/batch_occupancy,
the phases' metrics and timers), the held-out evaluation when due, the health alarms, a few samples."""

from __future__ import annotations

import math
import time

import torch

from posttrain.outputs import to_json
from posttrain.recipes.rl.run import RLRun
from posttrain.rollout.trajectory import Trajectory


def log_step(run: RLRun, step: int, trajs: list[Trajectory], t0: float, metrics: dict) -> dict:
    """Write step `step`'s row (merged with the phases' `metrics`) and act on alarms; -> the row logged."""
    cfg = run.cfg
    engine = run.engine_window.take(run.engine)  # this step's generation
    if run.eval_hook is not None:  # held-out pass@1 with its interval, when due
        with run.timer("eval"):
            metrics = {**metrics, **run.eval_hook.maybe(run.engine, step + 1, last=step + 1 == cfg.max_steps)}
        run.engine_window.take(run.engine)  # the evaluation's generation is in its eval/engine/* keys, not the next step's
    scored = [t.reward for t in trajs if t.reward is not None]
    lengths = torch.tensor([len(t.response_ids) for t in trajs], dtype=torch.float32)
    all_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    run.measured.add_step(all_tokens, int(lengths.sum()))
    timings = run.timer.pop()
    run.measured.add_phases(timings)  # plan.json's phase_seconds
    row = merge_metrics(metrics, {
        "reward/mean": sum(scored) / len(scored) if scored else math.nan,
        "reward/std": float(torch.tensor(scored).std()) if len(scored) > 1 else math.nan,
        "reward/none_frac": 1 - len(scored) / len(trajs),
        "response_length/mean": lengths.mean(), "response_length/max": lengths.max(),
        "response_length/clipped_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
        "samples": len(trajs), "tokens": all_tokens, "generated_tokens": int(lengths.sum()),
        "tokens_per_s": all_tokens / (time.perf_counter() - t0),
    }, engine, timings)
    fired = run.alarms.check(step + 1, row, [{"prompt": run.tok.decode(t.prompt_ids), "completion": t.text,
                                              "reward": t.reward} for t in trajs])
    row.update(run.alarms.metrics(fired))
    logged = run.metrics.write(step + 1, row)
    if run.life.main:  # a sharded run's other ranks hold the same samples
        with (run.life.out / "samples.jsonl").open("a") as f:
            for t in trajs[: cfg.samples_per_log]:
                f.write(to_json({"step": step + 1, "prompt": run.tok.decode(t.prompt_ids), "completion": t.text,
                                    "reward": t.reward, "finish_reason": t.finish_reason}) + "\n")
    run.alarms.act(fired)  # on_alarm=stop | checkpoint_and_stop raises AlarmStop
    return logged


def merge_metrics(*parts: dict) -> dict:
    """One row from the phases' metrics; a name two phases both produce is a bug, not an overwrite."""
    out: dict = {}
    for part in parts:
        clash = set(out) & set(part)
        if clash:
            raise ValueError(f"metric names produced twice in one step: {sorted(clash)}")
        out.update(part)
    return out
