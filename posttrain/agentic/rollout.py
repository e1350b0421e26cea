"""The multi-turn rollout: many episodes in flight on one engine, token ids concatenated turn by turn.

    episodes = new_episodes(make_env, rows, group_size, fmt, seed)
    stats = run_episodes(engine, fmt, episodes, agent_settings, sampling, tok)

Each episode's context is `prompt_ids + response_ids`; `response_ids` is the concatenation of the
model's turns (exactly the engine's sampled ids, loss mask 1: `spans`) and of the observations'
ids (template glue + tool output, loss mask 0). Nothing is ever decoded and re-encoded: the text
of a turn is decoded only to hand it to the environment.

Scheduling (the built-in engine): the first turn of a group is one request with n = G (the prompt
is prefilled once and forked); every later turn is a request for `prompt + response so far`, which
the engine's prefix cache serves from the blocks the previous turn left (a finished sequence
registers its full blocks), so only the tail (the last partial block and the observation) is
prefilled: cumulative prefill ≈ final context length, not Σ over turns. When a turn finishes, its
environment step runs in a worker thread while the engine keeps decoding the other episodes; the
episode's next request joins the running batch as soon as the step returns (continuous batching).
Other backends (HF, vLLM, a scripted test backend) run the same loop in synchronous waves.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from posttrain.agentic.env import bind_env, start_messages
from posttrain.rollout.trajectory import Trajectory
from posttrain.rollout.types import Request


@dataclass
class Turn:
    generated: int  # tokens the model sampled in this turn
    text: str = ""
    finish_reason: str = ""  # the engine's: stop | length
    returned: int = 0  # observation tokens appended after it (glue + tool output)
    observation: str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # tools.ToolResult.log() of each call
    env_s: float = 0.0


@dataclass(eq=False)
class Episode:
    env: object
    row: dict
    group: int
    sample: int
    seed: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # the model's tokens in response_ids
    logps: list[float] = field(default_factory=list)  # behaviour log-prob of each span token, in order
    kept: list[int] = field(default_factory=list)  # kept-set size of each span token (0 = untruncated)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = ""  # answer | max_turns | max_tokens | refused | env_error | env_timeout
    reward: float | None = None
    metrics: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def final_text(self) -> str:
        return self.turns[-1].text if self.turns else ""

    @property
    def tool_calls(self) -> list[dict]:
        return [c for t in self.turns for c in t.tool_calls]

    @property
    def env_s(self) -> float:
        return sum(t.env_s for t in self.turns)

    def loss_mask(self) -> list[int]:
        mask = [0] * len(self.response_ids)
        for s, e in self.spans:
            mask[s:e] = [1] * (e - s)
        return mask

    def to_trajectory(self, tok, version: int = 0) -> Trajectory:
        kept = torch.tensor(self.kept, dtype=torch.long) if any(self.kept) else None
        truncated = self.finish_reason == "max_tokens" or (bool(self.turns) and self.turns[-1].finish_reason == "length")
        return Trajectory(list(self.prompt_ids), list(self.response_ids), torch.tensor(self.logps, dtype=torch.float32),
                          self.group, loss_spans=list(self.spans), kept=kept, policy_version=version,
                          finish_reason="length" if truncated else "stop", text=tok.decode(self.response_ids),
                          reward=self.reward, valid=self.reward is not None)


def new_episodes(make_env, rows: list[dict], group_size: int, fmt, seed: int, first_group: int = 0) -> list[list[Episode]]:
    """G episodes per row, each with its own environment; reset(row, seed) is called with the group's
    seed for every sample, so a group shares its prompt (checked)."""
    groups = []
    for i, row in enumerate(rows):
        gseed = (seed * 1000003 + (first_group + i) * 7919) % 2**63
        group = []
        for j in range(group_size):
            env = make_env()
            bind_env(env, fmt)
            ids = fmt.prompt_ids(start_messages(env, row, gseed))
            if group and ids != group[0].prompt_ids:
                raise ValueError(f"env reset is not deterministic: row {i} gave two prompts for one (row, seed)")
            group.append(Episode(env, row, first_group + i, j, gseed, ids))
        groups.append(group)
    return groups


# ---------------------------------------------------------------- engine drivers


class _EngineDriver:
    """The built-in engine: requests join while others decode (add_request + step)."""

    def __init__(self, engine):
        self.engine, self.live = engine, []

    def submit(self, request: Request, tag) -> None:
        self.live.append((self.engine.add_request(request), tag))

    def busy(self) -> bool:
        return bool(self.live)

    def advance(self) -> list:
        if self.engine.scheduler.has_work():
            self.engine.step()
        done = [(s.output, tag) for s, tag in self.live if s.remaining == 0]
        if done:
            self.live = [(s, tag) for s, tag in self.live if s.remaining != 0]
        return done


class _BatchDriver:
    """Any backend with `generate(requests)` (HF, vLLM, a scripted test backend): waves of requests."""

    def __init__(self, backend):
        self.backend, self.queue = backend, []

    def submit(self, request: Request, tag) -> None:
        self.queue.append((request, tag))

    def busy(self) -> bool:
        return bool(self.queue)

    def advance(self) -> list:
        batch, self.queue = self.queue, []
        outs = self.backend.generate([r for r, _ in batch])
        return [(o, tag) for o, (_, tag) in zip(outs, batch)]


def driver_for(backend):
    from posttrain.rollout.engine import Engine  # only for isinstance; an Engine caller has it loaded

    return _EngineDriver(backend) if isinstance(backend, Engine) else _BatchDriver(backend)


# ---------------------------------------------------------------- the loop


@dataclass
class RolloutStats:
    model_s: float = 0.0  # time in the engine (generation)
    env_s: float = 0.0  # time in environment steps (tools), summed over episodes (runs overlapped)
    wall_s: float = 0.0
    requests: int = 0
    prefill_tokens: int | None = None  # built-in engine: prompt tokens computed (not served by the cache)
    cached_tokens: int | None = None


class _Loop:
    def __init__(self, backend, fmt, settings, sampling, tok):
        self.driver, self.fmt, self.cfg, self.sampling, self.tok = driver_for(backend), fmt, settings, sampling, tok
        self.eos = set(getattr(backend, "default_eos", []) or ([tok.eos_token_id] if tok.eos_token_id is not None else []))
        self.stats = RolloutStats()
        self.pending: dict = {}  # future -> (episode, started)

    def params(self, n: int, seed: int, budget: int):
        p = self.sampling.params(n=n, seed=seed)
        return dataclasses.replace(p, max_new_tokens=max(1, min(p.max_new_tokens, budget)),
                                   stop_strings=list(p.stop_strings) + [s for s in self.fmt.stop_strings if s not in p.stop_strings])

    def submit_next(self, ep: Episode) -> None:
        seed = (ep.seed * 31 + ep.sample * 104729 + len(ep.turns) * 15485863) % 2**63
        budget = self.cfg.max_total_tokens - len(ep.response_ids)
        self.driver.submit(Request(ep.prompt_ids + ep.response_ids, self.params(1, seed, budget)), ep)
        self.stats.requests += 1

    def record_turn(self, ep: Episode, c, pool) -> None:
        start = len(ep.response_ids)
        ep.response_ids += list(c.token_ids)
        ep.spans.append((start, len(ep.response_ids)))
        ep.logps += list(c.logprobs)
        ep.kept += list(c.kept_counts) if c.kept_counts is not None else [0] * len(c.token_ids)
        text = c.text if c.text is not None else self.tok.decode(c.token_ids, skip_special_tokens=True)
        ep.turns.append(Turn(len(c.token_ids), text, c.finish_reason))
        if c.finish_reason == "length" and len(ep.response_ids) >= self.cfg.max_total_tokens:
            ep.finish_reason = "max_tokens"
            return
        # a turn cut at the per-turn limit is still an action: the environment decides what follows
        self.pending[pool.submit(_env_step, ep.env, text)] = (ep, time.perf_counter())

    def after_step(self, ep: Episode, result) -> None:
        obs, done, info, seconds = result
        turn = ep.turns[-1]
        turn.env_s, turn.observation, turn.tool_calls = seconds, obs, list(info.get("tool_calls", []))
        self.stats.env_s += seconds
        if "env_error" in info:
            ep.finish_reason = "env_error"
            turn.observation = info["env_error"]
            return
        if done or obs is None:
            ep.finish_reason = "answer"
            return
        if len(ep.turns) >= self.cfg.max_turns:
            ep.finish_reason = "max_turns"
            return
        ids = self.fmt.observation_ids(obs, ep.response_ids[-1] in self.eos, self.cfg.max_observation_tokens)
        if len(ep.response_ids) + len(ids) >= self.cfg.max_total_tokens:
            ep.finish_reason = "max_tokens"
            return
        ep.response_ids += ids
        turn.returned = len(ids)
        self.submit_next(ep)

    def expire(self) -> None:
        now = time.perf_counter()
        for f, (ep, started) in list(self.pending.items()):
            if now - started > self.cfg.step_timeout_s:
                del self.pending[f]
                ep.finish_reason = "env_timeout"
                ep.turns[-1].env_s = now - started
                self.stats.env_s += now - started


def _env_step(env, text: str):
    t0 = time.perf_counter()
    try:
        obs, done, info = env.step(text)
    except Exception as e:  # a broken environment ends its episode, not the run
        return None, True, {"env_error": f"{type(e).__name__}: {e}"}, time.perf_counter() - t0
    return obs, done, dict(info or {}), time.perf_counter() - t0


def run_episodes(backend, fmt, groups: list[list[Episode]], settings, sampling, tok) -> RolloutStats:
    """Run every episode to its end and score it (env.reward, env.metrics); returns timing and counts."""
    loop = _Loop(backend, fmt, settings, sampling, tok)
    engine_stats = getattr(backend, "stats", None)
    before = (engine_stats.prefill_tokens, engine_stats.cached_tokens) if engine_stats is not None else None
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(settings.env_workers, thread_name_prefix="env")
    try:
        for g in groups:
            loop.driver.submit(Request(g[0].prompt_ids, loop.params(len(g), g[0].seed, settings.max_total_tokens)), g)
            loop.stats.requests += 1
        while loop.driver.busy() or loop.pending:
            if loop.driver.busy():
                t = time.perf_counter()
                finished = loop.driver.advance()
                loop.stats.model_s += time.perf_counter() - t
                for out, tag in finished:
                    eps = tag if isinstance(tag, list) else [tag]
                    if out.error:
                        for ep in eps:
                            ep.finish_reason = "refused"
                        continue
                    for ep, c in zip(eps, out.samples):
                        loop.record_turn(ep, c, pool)
                ready = [f for f in loop.pending if f.done()]
            else:  # only environments are working: wait for one
                ready = list(wait(list(loop.pending), timeout=1.0, return_when=FIRST_COMPLETED).done)
            for f in ready:
                ep, _ = loop.pending.pop(f)
                loop.after_step(ep, f.result())
            loop.expire()
    finally:  # a step past its backstop may still run in its thread: do not wait for it
        pool.shutdown(wait=False, cancel_futures=True)
    for ep in (e for g in groups for e in g):
        score(ep)
    loop.stats.wall_s = time.perf_counter() - t0
    if before is not None:
        loop.stats.prefill_tokens = engine_stats.prefill_tokens - before[0]
        loop.stats.cached_tokens = engine_stats.cached_tokens - before[1]
    return loop.stats


def score(ep: Episode) -> None:
    try:
        ep.reward = ep.env.reward(ep)
    except Exception as e:
        raise RuntimeError(f"env {type(ep.env).__name__}.reward failed on group {ep.group} sample {ep.sample}: "
                           f"{type(e).__name__}: {e}") from e
    metrics = getattr(ep.env, "metrics", None)
    ep.metrics = dict(metrics(ep)) if callable(metrics) else {}
