"""A simulated long-tail rollout device, for comparing synchronous and asynchronous RL on a CPU
(benchmarks/async_longtail.py, benchmarks/check_gpu.py; tests/test_async_rl.py imports it with benchmarks/
on sys.path, which tests/conftest.py adds). Test and benchmark apparatus: not part of the package.

`LongTailEngine` wraps the built-in engine (the tiny model really generates) and changes two things:

    lengths   each request's samples run to a length drawn from a Pareto distribution
              (P(L > x) = (x_min / x)^alpha, capped at max_len; alpha ~ 1.2-1.5 is the heavy tail of
              reasoning traces): max_new_tokens = L, ignore_eos; L is a function of the request's seed,
              so a synchronous and an asynchronous run see the same lengths for the same prompts
    latency   every engine step also waits `step_latency_s` (a sleep: the device is elsewhere), the
              cost of one decode step on an accelerator, whose time barely depends on the batch rows

A synchronous step then waits for its longest group (max of B draws), while the asynchronous producer
keeps the device busy with the next round during the long tail and during the update.
"""

from __future__ import annotations

import dataclasses
import random
import time


def pareto_length(seed: int, alpha: float, min_len: int, max_len: int) -> int:
    """L = min(max_len, floor(min_len / U^(1/alpha))), U ~ Uniform(0, 1] from `seed`."""
    u = 1.0 - random.Random(seed).random()  # (0, 1]
    return int(min(max_len, min_len / u ** (1.0 / alpha)))


class LongTailEngine:
    """The engine API (submit / step / has_work / generate / update_weights / sync_weights) over a real
    engine, with heavy-tailed lengths and a per-step device latency."""

    def __init__(self, engine, step_latency_s: float = 0.005, alpha: float = 1.3, min_len: int = 4, max_len: int = 128):
        self.engine, self.step_latency_s = engine, step_latency_s
        self.alpha, self.min_len, self.max_len = alpha, min_len, max_len
        self.steps = 0

    def _long_tail(self, requests):
        out = []
        for r in requests:
            L = pareto_length(r.params.seed if r.params.seed is not None else 0, self.alpha, self.min_len, self.max_len)
            out.append(dataclasses.replace(r, params=dataclasses.replace(r.params, max_new_tokens=L, ignore_eos=True)))
        return out

    def submit(self, requests):
        return self.engine.submit(self._long_tail(requests))

    def step(self) -> None:
        self.engine.step()
        self.steps += 1
        if self.step_latency_s:
            time.sleep(self.step_latency_s)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def generate(self, requests, on_output=None):
        states = self.submit(requests)
        while self.has_work():
            self.step()
        outs = [s.output for s in states]
        if on_output is not None:
            for o in outs:
                on_output(o)
        return outs

    def update_weights(self, state_dict: dict) -> None:
        self.engine.update_weights(state_dict)

    def sync_weights(self) -> None:
        self.engine.sync_weights()

    def __getattr__(self, name):  # config, metrics, … of the wrapped engine
        return getattr(self.engine, name)


def timed_run(args: list[str], async_rl: bool, wrap: dict) -> dict:
    """One RL run (posttrain rl arguments) on the long-tail device; wall time, idle times, staleness."""
    from posttrain.config import parse_args
    from posttrain.recipes import rl

    cfg = parse_args(rl.RLConfig, [*args, f"async_rl={str(async_rl).lower()}"])
    run = rl.setup(cfg)
    if async_rl:
        run.rollout.generator.engine = LongTailEngine(run.rollout.generator.engine, **wrap)
    else:
        run.engine = LongTailEngine(run.engine, **wrap)
    t0 = time.perf_counter()
    rows = [rl.rl_step(run, step) for step in range(cfg.max_steps)]
    wall = time.perf_counter() - t0
    summary = rl.finish(run)
    gen = sum(r.get("time/generate", 0.0) + r.get("time/reward", 0.0) for r in rows)
    if async_rl:
        trainer_idle, generator_idle = summary["async_trainer_idle_s"], summary["async_generator_idle_s"]
    else:  # one thread: the trainer waits for generation, the device waits for everything else
        trainer_idle, generator_idle = gen, wall - gen
    return {"wall_s": wall, "trainer_idle_s": trainer_idle, "generator_idle_s": generator_idle,
            "reward_first": rows[0]["reward/mean"], "reward_last": rows[-1]["reward/mean"],
            "response_length_mean": sum(r["response_length/mean"] for r in rows) / len(rows), "device_steps": run_engine(run, async_rl).steps,
            "staleness_hist": summary.get("async_staleness_hist", {0: sum(r["samples"] for r in rows)})}


def run_engine(run, async_rl: bool):
    return run.rollout.generator.engine if async_rl else run.engine


def compare_sync_async(args: list[str], step_latency_s: float = 0.005, alpha: float = 1.3, min_len: int = 4,
                       max_len: int = 128) -> dict:
    """The same run synchronously and asynchronously on the simulated device -> {sync, async, speedup}."""
    wrap = dict(step_latency_s=step_latency_s, alpha=alpha, min_len=min_len, max_len=max_len)
    rest = [a for a in args if not a.startswith("output_dir=")]
    sync = timed_run([*rest, "output_dir=" + _out(args, "sync")], False, wrap)
    asyn = timed_run([*rest, "output_dir=" + _out(args, "async")], True, wrap)
    return {"sync": sync, "async": asyn, "speedup": sync["wall_s"] / asyn["wall_s"]}


def _out(args: list[str], name: str) -> str:
    base = next((a.split("=", 1)[1] for a in args if a.startswith("output_dir=")), "runs/async_longtail")
    return f"{base}/{name}"
