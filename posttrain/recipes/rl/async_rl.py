"""Asynchronous RL in one process (`posttrain rl async_rl=true max_staleness=k`).

A rollout thread generates and scores groups on its own copy of the policy and feeds a bounded
queue; the trainer takes `prompts_per_step` groups from it per step while the rollout thread goes on
sampling (AReaL, Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System
for Language Reasoning"; verl's fully-async mode). Pieces:

    WeightStore      the trainer publishes (version, weights) after each update; the producer pulls
                     the newest when it may (in-process: a locked slot; Ray: the object store)
    RolloutProducer  the generation loop: batch n (prompts_per_step prompts, the rows and seeds the
                     synchronous run draws at step n) is submitted only once the engine holds a policy
                     version v >= n - k; finished groups are scored and emitted one by one
    Ledger           which groups of which batch the trainer consumed, so a restarted producer (resume,
                     a Ray worker that died) regenerates exactly the unconsumed ones
    AsyncRollout     the trainer side: publish, take B groups, refuse samples older than k, metrics

Staleness of a sample used at trainer step s (the trainer's policy version = s optimizer steps) is
s − v, v = the version that sampled it; samples with s − v > k are refused (counted, never trained
on). The loss is the decoupled PPO objective (Hilton et al. 2021, "Batch size-invariance for policy
optimization"; AReaL eq. 5): the proximal policy π_prox is the trainer's policy at the start of the
update (recipes/rl/step.py sets old_logp = the first forward's log-probs), the clip acts on πθ/π_prox,
and each token's loss is weighted by min(π_prox/μ, tis_cap) with μ the behaviour log-probs the
engine recorded (pg_losses TIS). The off-policy gap KL(μ‖π_prox) is `consistency/kl_behaviour_trainer`.

With k = 0 the producer generates batch n from version n exactly: the run's samples and metrics are
those of the synchronous run with the same seed (tests/test_async_rl.py checks it).
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from posttrain.models.forward import unwrap
from posttrain.recipes.rl import phases as ph
from posttrain.recipes.rl.rollout import sampled_plan_inputs
from posttrain.rollout.backends import StepAdapter, build_backend
from posttrain.rollout.engine import Engine
from posttrain.rollout.trajectory import Trajectory
from posttrain.training.data_order import EpochSampler

ASYNC_TIS_CAP = 2.0  # default cap of the importance weight π_prox/μ when the run gives none


@dataclass(eq=False)
class GroupItem:
    """One prompt's G scored samples, as the producer emits them."""

    batch: int  # generation round n (the synchronous run's step n)
    index: int  # row j of the round
    version: int  # policy version that sampled it
    trajs: list[Trajectory]
    sampler_before: dict  # EpochSampler state before round n was drawn (resume point)
    sampler_after: dict
    interrupted: bool = False  # partial_rollouts=drop: a newer version arrived while it was in flight
    reward_metrics: dict = field(default_factory=dict)
    incarnation: str | None = None  # Ray: the rollout actor's life that produced it (a restarted one regenerates)


@dataclass
class Failure:
    """The producer died; the trainer re-raises."""

    error: BaseException


def weights_of(model) -> dict[str, torch.Tensor]:
    """A detached copy of the policy's weights (names of model.state_dict(), the engine's)."""
    return {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()}


class WeightStore:
    """The newest published (version, weights), with a wait for a newer one."""

    def __init__(self):
        self._cond = threading.Condition()
        self.version, self._weights = -1, None

    def publish(self, version: int, weights: dict) -> None:
        with self._cond:
            if version <= self.version:
                raise ValueError(f"weights version {version} published after version {self.version}")
            self.version, self._weights = version, weights
            self._cond.notify_all()

    def latest(self) -> tuple[int, dict | None]:
        with self._cond:
            return self.version, self._weights

    def wait_newer(self, than: int, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self.version > than, timeout)
            return self.version


# ---------------------------------------------------------------- the generation side


class RolloutProducer:
    """Generates rounds of `prompts_per_step` prompts x `group_size` samples, scores each group as it
    finishes and emits it (`emit(GroupItem)`). Round n is submitted when the engine's weights have
    version v >= n − k; with partial_rollouts=finish, new weights load only when the engine is idle
    (and no round is submitted while newer weights wait), so no sample mixes versions; with drop they
    load at once and the samples in flight are emitted as interrupted."""

    def __init__(self, engine, tok, rows, score, cfg, resume: dict | None = None):
        s = cfg.systems
        self.engine, self.tok, self.rows, self.score, self.cfg = engine, tok, rows, score, cfg
        self.k, self.partial = s.max_staleness, s.partial_rollouts
        self.sampler = EpochSampler(len(rows), cfg.seed)
        self.next_batch, self.skip = 0, set()
        if resume:
            self.load(resume)
        self.version = -1  # weights the engine holds
        self.pending: list[dict] = []  # submitted, unfinished requests
        self.idle_s, self.loads, self.interrupted = 0.0, 0, 0

    def load(self, resume: dict) -> None:
        """Start from a ledger's resume point: round `batch` from its data position, consumed groups skipped."""
        self.sampler.load(resume["sampler"])
        self.next_batch, self.skip = resume["batch"], {tuple(x) for x in resume["consumed"]}

    def run(self, emit, weights: WeightStore, stop: threading.Event) -> None:
        """The loop; any exception is emitted as a Failure (the trainer re-raises it)."""
        try:
            while not stop.is_set():
                self._maybe_load(weights)
                while self._may_submit(weights):
                    self._submit_round()
                if self.engine.has_work():
                    self.engine.step()
                    self._emit_finished(emit)
                else:
                    t = time.perf_counter()
                    weights.wait_newer(self.version, 0.05)
                    self.idle_s += time.perf_counter() - t
        except BaseException as e:  # noqa: B036 - the trainer thread must learn about any death
            emit(Failure(e))

    def _maybe_load(self, weights: WeightStore) -> None:
        version, state = weights.latest()
        if version <= self.version or (self.partial == "finish" and self.engine.has_work()):
            return
        self.engine.update_weights(state)
        self.version, self.loads = version, self.loads + 1
        if self.partial == "drop":
            for p in self.pending:
                p["interrupted"] = True

    def _may_submit(self, weights: WeightStore) -> bool:
        if self.version < 0 or self.next_batch - self.version > self.k:
            return False
        return not (self.partial == "finish" and weights.version > self.version)

    def _submit_round(self) -> None:
        """Round n: the rows and seeds of the synchronous step n; rows consumed before a restart are skipped."""
        cfg, n = self.cfg, self.next_batch
        before = self.sampler.state()
        rows = [self.rows[i] for i in self.sampler.take(cfg.prompts_per_step)]
        after = self.sampler.state()
        requests = ph.requests_for(self.tok, rows, cfg, ph.batch_seed(cfg.seed, n))
        todo = [j for j in range(len(rows)) if (n, j) not in self.skip]
        states = self.engine.submit([requests[j] for j in todo]) if todo else []
        for j, st in zip(todo, states):
            self.pending.append({"batch": n, "index": j, "row": rows[j], "state": st, "version": self.version,
                                 "before": before, "after": after, "interrupted": False})
        self.next_batch += 1

    def _emit_finished(self, emit) -> None:
        done = [p for p in self.pending if p["state"].remaining == 0]
        if not done:
            return
        self.pending = [p for p in self.pending if p["state"].remaining != 0]
        for p in done:
            trajs = ph.trajectories(p["state"].output, p["row"], self.tok, p["index"], p["version"])
            metrics = {}
            if not p["interrupted"]:  # a dropped group is not worth its reward call
                metrics = self.score(p["row"], trajs)
            self.interrupted += p["interrupted"]
            emit(GroupItem(p["batch"], p["index"], p["version"], trajs, p["before"], p["after"], p["interrupted"], metrics))


def local_scorer(reward_fn):
    """score(row, trajs) -> reward metrics, filling each trajectory's reward (in the calling thread)."""

    def score(row, trajs):
        ph.score(reward_fn, {trajs[0].group: row}, trajs)
        return {k: v for k, v in (reward_fn.last_metrics or {}).items() if isinstance(v, (int, float))}

    return score


# ---------------------------------------------------------------- the trainer side


class Ledger:
    """What the trainer consumed, per round, as the resume point of a restarted producer:
    {"batch": oldest round not fully consumed, "sampler": the sampler state before it,
     "consumed": [[round, row], ...] of the rounds from there on}."""

    def __init__(self, prompts_per_step: int, start: dict | None = None):
        self.B = prompts_per_step
        self.base, self.base_sampler = (start["batch"], start["sampler"]) if start else (0, {"epoch": 0, "index": 0})
        self.consumed: dict[int, set[int]] = {}
        self.after: dict[int, dict] = {}
        for n, j in (start or {}).get("consumed", []):
            self.consumed.setdefault(n, set()).add(j)

    def add(self, item: GroupItem) -> None:
        if item.batch < self.base or item.index in self.consumed.get(item.batch, set()):
            raise RuntimeError(f"group {item.index} of rollout round {item.batch} delivered twice")
        self.consumed.setdefault(item.batch, set()).add(item.index)
        self.after[item.batch] = item.sampler_after
        while len(self.consumed.get(self.base, ())) == self.B:  # the oldest round is complete: move on
            self.base_sampler = self.after.pop(self.base, self.base_sampler)
            del self.consumed[self.base]
            self.base += 1

    def state(self) -> dict:
        return {"batch": self.base, "sampler": self.base_sampler,
                "consumed": sorted([n, j] for n, js in self.consumed.items() for j in js)}


class AsyncRollout:
    """Trainer side of asynchronous RL: `collect(run, step)` replaces the synchronous collect phase."""

    def __init__(self, cfg, start_producer, resume: dict | None = None):
        """start_producer(emit, weights, stop, resume) starts generation (a thread here, a Ray actor there)."""
        self.cfg, self.k = cfg, cfg.systems.max_staleness
        self.queue: queue.Queue = queue.Queue(maxsize=cfg.systems.queue_bound(cfg.prompts_per_step))
        self.weights, self.stop = WeightStore(), threading.Event()
        self.ledger = Ledger(cfg.prompts_per_step, resume)
        self._start_producer, self._resume = start_producer, resume
        self.producer = None  # what start_producer returned (a thread, or the Ray driver)
        self.generator = None  # the in-process RolloutProducer (its engine may be wrapped before the first step)
        self.totals = {"trainer_idle_s": 0.0, "staleness": {}, "dropped_stale": 0, "dropped_interrupted": 0}
        self._seen = {"idle_s": 0.0, "loads": 0}

    def emit(self, item) -> None:
        """Called by the producer: blocks while the queue is full (counted as generator idle time)."""
        t = time.perf_counter()
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        if self.producer is not None and hasattr(self.producer, "idle_s"):
            self.producer.idle_s += time.perf_counter() - t

    def publish(self, model, version: int) -> None:
        if version > self.weights.version:
            self.weights.publish(version, weights_of(model))

    def collect(self, run, step: int) -> tuple[list[Trajectory], dict]:
        """B groups with staleness <= k from the queue (dynamic sampling drops groups without signal and
        keeps taking, at most (max_resample + 1) x B groups); group ids renumbered 0..B-1."""
        with run.timer("wait"):
            return self._collect(run, step)

    def _collect(self, run, step: int) -> tuple[list[Trajectory], dict]:
        self.publish(run.model, step)
        if self.producer is None:
            self.producer = self._start_producer(self.emit, self.weights, self.stop, self._resume)
        cfg, B = self.cfg, self.cfg.prompts_per_step
        depth, waited = self.queue.qsize(), 0.0
        kept, last, stale, interrupted, no_signal = [], [], 0, 0, 0
        while len(kept) < B and len(last) < (cfg.max_resample + 1) * B:
            t = time.perf_counter()
            item = self._get()
            waited += time.perf_counter() - t
            self.ledger.add(item)
            if item.interrupted:
                interrupted += 1
            elif step - item.version > self.k:  # too old: refused, never trained on
                stale += 1
            elif run.dynamic and not ph.informative_groups(item.trajs)[0]:
                no_signal += 1
                last.append(item)
            else:
                kept.append(item)
        kept = kept or last[-B:]
        for g, item in enumerate(kept):
            for t in item.trajs:
                t.group = g
        return [t for item in kept for t in item.trajs], self._metrics(run, step, kept, depth, waited, stale, interrupted, no_signal)

    def _get(self):
        while True:
            try:
                item = self.queue.get(timeout=1.0)
            except queue.Empty:
                if self.producer is not None and hasattr(self.producer, "is_alive") and not self.producer.is_alive():
                    raise RuntimeError("the rollout producer stopped without reporting an error") from None
                continue
            if isinstance(item, Failure):
                raise RuntimeError(f"the rollout producer failed: {item.error!r}") from item.error
            return item

    def _metrics(self, run, step, kept, depth, waited, stale, interrupted, no_signal) -> dict:
        ages = [step - item.version for item in kept for _ in item.trajs]
        hist = {f"async/staleness/{d}": sum(a == d for a in ages) for d in range(self.k + 1)}
        idle, loads = self._producer_counters()
        out = {"async/staleness/mean": sum(ages) / max(len(ages), 1), "async/staleness/max": max(ages, default=0), **hist,
               "async/queue_depth": depth, "async/trainer_idle_s": waited,
               "async/generator_idle_s": idle - self._seen["idle_s"], "async/weight_loads": loads - self._seen["loads"],
               "async/dropped_stale": stale, "async/dropped_interrupted": interrupted, "async/policy_version": step}
        self._seen = {"idle_s": idle, "loads": loads}
        if run.dynamic:
            out["dynamic/groups_dropped"] = no_signal
        out.update(reward_metrics(kept))
        t = self.totals
        t["trainer_idle_s"] += waited
        t["dropped_stale"] += stale
        t["dropped_interrupted"] += interrupted
        for a in ages:
            t["staleness"][a] = t["staleness"].get(a, 0) + 1
        return out

    def _producer_counters(self) -> tuple[float, int]:
        p = self.producer
        return (getattr(p, "idle_s", 0.0), getattr(p, "loads", 0)) if p is not None else (0.0, 0)

    def state(self) -> dict:
        return self.ledger.state()

    def load_state(self, checkpoint: dict, start: int) -> None:
        """Resume generation where the trainer's consumption stopped; a synchronous run's checkpoint has no
        ledger: round n = step n from its data position."""
        resume = checkpoint.get("rollout") or {"batch": start, "sampler": checkpoint["sampler"], "consumed": []}
        self.ledger, self._resume = Ledger(self.cfg.prompts_per_step, resume), resume
        if self.generator is not None:
            self.generator.load(resume)

    def sync_weights(self, run) -> None:
        """The producer pulls the new weights when the next step publishes them (collect); the trainer-side
        engine (evaluation) re-packs lazily."""
        run.engine.sync_weights()

    def plan_inputs(self, run) -> dict:
        return sampled_plan_inputs(run)

    def summary(self) -> dict:
        idle, _ = self._producer_counters()
        return {"async_trainer_idle_s": self.totals["trainer_idle_s"], "async_generator_idle_s": idle,
                "async_staleness_hist": dict(sorted(self.totals["staleness"].items())),
                "async_dropped_stale": self.totals["dropped_stale"],
                "async_dropped_interrupted": self.totals["dropped_interrupted"]}

    def close(self) -> None:
        self.stop.set()
        p = self.producer
        if p is not None and hasattr(p, "join"):
            p.join(timeout=60)


def reward_metrics(items: list[GroupItem]) -> dict:
    """rewards/<name>/… over the consumed groups: means weighted by samples, counts and seconds summed
    (per-group standard deviations do not combine without the values: left out)."""
    out: dict[str, float] = {}
    n = sum(len(i.trajs) for i in items) or 1
    for item in items:
        w = len(item.trajs)
        for k, v in item.reward_metrics.items():
            if k.endswith("/std"):
                continue
            out[k] = out.get(k, 0.0) + (v * w / n if k.endswith("/mean") else v)
    return out


# ---------------------------------------------------------------- wiring into the RL recipe (build.py)


class ProducerThread(threading.Thread):
    """The in-process producer: a daemon thread running RolloutProducer.run."""

    def __init__(self, producer: RolloutProducer, emit, weights, stop):
        super().__init__(name="posttrain-rollout", daemon=True)
        self.producer, self._args = producer, (emit, weights, stop)

    def run(self) -> None:
        self.producer.run(*self._args)

    @property
    def idle_s(self) -> float:
        return self.producer.idle_s

    @idle_s.setter
    def idle_s(self, value: float) -> None:
        self.producer.idle_s = value

    @property
    def loads(self) -> int:
        return self.producer.loads


class TrainerEngine:
    """Stands in for run.engine on the trainer side under async RL: `sync_weights()` after an update
    costs nothing; an engine over the trainer's weights is built (and synced) only when something
    samples from them (held-out evaluation)."""

    def __init__(self, model, tok, config, cfg=None):
        self.model, self.tok, self.config = model, tok, config
        # evaluation samples the trainer's own weights: vLLM holds a separate copy, so it is not used here
        self.backend = "auto" if cfg is None or cfg.backend == "vllm" else cfg.backend
        self._engine, self._stale = None, False

    def sync_weights(self) -> None:
        self._stale = True

    def generate(self, requests, **kw):
        if self._engine is None:
            self._engine, self._stale = build_backend(self.backend, unwrap(self.model), self.tok, self.config, echo=None), False
        if self._stale:
            self._engine.sync_weights()
            self._stale = False
        return self._engine.generate(requests, **kw)


def check_config(cfg) -> None:
    s = cfg.systems
    if cfg.tis_cap == 0 and s.max_staleness > 0:
        raise ValueError("async_rl with max_staleness > 0 needs the importance weight π_prox/μ: leave tis_cap unset (2.0) or > 0")


def prepare(run) -> None:
    """What every producer-pipeline run changes in a set-up synchronous run (thread or Ray)."""
    check_config(run.cfg)
    if not run.cfg.systems.async_rl:  # cluster=ray, synchronous: the same pipeline, round n from version n
        run.cfg.systems = run.cfg.systems.model_copy(update={"max_staleness": 0, "partial_rollouts": "finish"})
    if run.tis_cap is None:
        run.tis_cap = ASYNC_TIS_CAP
    alarms = run.alarms.settings
    if run.cfg.systems.max_staleness > 0 and "dlogp_mean_max" not in alarms.model_fields_set:
        # consistency/* now measure the off-policy gap (staleness on top of precision): expected to be
        # large, so the trainer-vs-sampler alarm is off unless the run sets its threshold
        run.alarms.settings = alarms.model_copy(update={"dlogp_mean_max": None})


def attach(run) -> AsyncRollout:
    """The in-process producer: a RolloutProducer on its own engine in a daemon thread (started by the first
    collect)."""
    engine = rollout_engine(run)
    producer = RolloutProducer(engine, run.tok, run.rows, local_scorer(run.reward_fn), run.cfg)

    def start(emit, weights, stop, _resume):
        thread = ProducerThread(producer, emit, weights, stop)
        thread.start()
        return thread

    rollout = AsyncRollout(run.cfg, start)
    rollout.generator = producer
    return rollout


def rollout_engine(run):
    """The producer's backend on its own copy of the policy; rows for (k + 1) rounds decode together.
    The built-in engine steps with the producer; hf and vllm (which load new weights by `update_weights`)
    run behind StepAdapter."""
    cfg = run.cfg
    # vLLM loads its own weights from cfg.model; the others sample from a private copy
    model = unwrap(run.model) if cfg.backend == "vllm" else copy.deepcopy(unwrap(run.model)).eval().requires_grad_(False)
    engine_cfg = run.engine.config
    if "max_num_seqs" not in cfg.engine.model_fields_set:
        rows = (cfg.systems.max_staleness + 1) * cfg.prompts_per_step * cfg.group_size
        engine_cfg = engine_cfg.model_copy(update={"max_num_seqs": min(256, rows)})
    extra = {"gpu_memory_utilization": cfg.systems.vllm_gpu_memory_utilization} if cfg.backend == "vllm" else {}
    backend = build_backend(cfg.backend, model, run.tok, engine_cfg, model_name=cfg.model, dtype=cfg.dtype, **extra)
    return backend if isinstance(backend, Engine) else StepAdapter(backend)
