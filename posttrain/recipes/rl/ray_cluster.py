"""Ray placement (`posttrain rl cluster=ray`, optional extra `pip install 'posttrain[ray]'`): the trainer,
a rollout worker and a reward worker (the verifier pool) as Ray actors with resource requests, on a
local `ray.init()` or an existing cluster (`ray_address=...`).

    TrainerActor   runs the RL recipe's loop (loop.py: train) (the driver only waits for its summary)
    RolloutActor   the RolloutProducer of recipes/rl/async_rl.py on its own engine; emits scored groups into
                   a `ray.util.queue.Queue` (bounded); gets weights by version through the object store
                   (`ray.put` once per version, the actor resolves the reference; on GPUs the same call
                   site is where an NCCL broadcast goes)
    RewardActor    scores a group (the composed reward) for the rollout actor

Synchronous mode (async_rl=false) is the same pipeline with max_staleness = 0: round n is generated
from version n, so the run's samples and metrics are the single-process run's (tests/test_ray.py).

Fault tolerance: the rollout actor is created with max_restarts=-1. Each incarnation has an id; the
trainer notices a new one (on a queue timeout, or at the start of a step), restarts generation from
its ledger (recipes/rl/async_rl.py::Ledger: rounds fully consumed are skipped, partially consumed rounds
regenerate only their unconsumed groups) and drops queued groups of the dead incarnation, so no sample
is lost or counted twice.
"""

from __future__ import annotations

import threading
import time
import uuid

from posttrain.data import formats
from posttrain.errors import UserError
from posttrain.models.loading import load_model, load_tokenizer
from posttrain.recipes.rl.async_rl import (
    AsyncRollout,
    Failure,
    GroupItem,
    RolloutProducer,
    StepAdapter,
    WeightStore,
    local_scorer,
    weights_of,
)
from posttrain.rewards.build import build_reward
from posttrain.rollout.backends import build_backend
from posttrain.rollout.engine import Engine


def _ray():
    try:
        import ray
    except ImportError:
        raise UserError("cluster=ray needs Ray: pip install 'posttrain[ray]'") from None
    return ray


def connect(systems) -> None:
    """ray.init() once: the given cluster address, or a local cluster (ray_num_cpus CPUs)."""
    ray = _ray()
    if ray.is_initialized():
        return
    if systems.ray_address:
        ray.init(address=systems.ray_address)
    else:
        ray.init(num_cpus=systems.ray_num_cpus, include_dashboard=False)


# ---------------------------------------------------------------- actors (classes decorated lazily)


class RewardWorker:
    """score(row, trajs) -> (rewards, reward metrics) with the run's composed reward."""

    def __init__(self, cfg):
        rows, _ = formats.load(cfg.data, allowed=("prompt_only", "prompt_completion"), seed=cfg.seed)
        self.score_fn = local_scorer(build_reward(cfg.resolved_reward, cfg.reward_args, rows, cfg.sampling.max_new_tokens))

    def score(self, row, trajs):
        metrics = self.score_fn(row, trajs)
        return [t.reward for t in trajs], metrics


class RolloutWorker:
    """A RolloutProducer in a thread of this actor; `start(resume, version, weights)` (re)starts it."""

    def __init__(self, cfg, queue, reward):
        self.cfg, self.queue, self.reward = cfg, queue, reward
        self.incarnation = uuid.uuid4().hex
        self.tok = load_tokenizer(cfg.model, cfg.chat_template, cfg.chat_template_args)
        self.rows, _ = formats.load(cfg.data, allowed=("prompt_only", "prompt_completion"), seed=cfg.seed)
        model = load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed).eval().requires_grad_(False)
        rows = (cfg.systems.max_staleness + 1) * cfg.prompts_per_step * cfg.group_size
        engine_cfg = cfg.engine.model_copy(update={
            k: v for k, v in {"max_num_seqs": min(256, rows), "seed": cfg.seed}.items() if k not in cfg.engine.model_fields_set})
        backend = build_backend(cfg.backend, model, self.tok, engine_cfg, model_name=cfg.model, dtype=cfg.dtype)
        self.engine = backend if isinstance(backend, Engine) else StepAdapter(backend)
        self.producer, self.stop, self.thread = None, threading.Event(), None

    def start(self, resume: dict | None, version: int, weights: dict) -> str:
        self.store = WeightStore()
        self.store.publish(version, weights)
        self.producer = RolloutProducer(self.engine, self.tok, self.rows, self._score, self.cfg, resume)
        self.thread = threading.Thread(target=self.producer.run, args=(self._emit, self.store, self.stop), daemon=True)
        self.thread.start()
        return self.incarnation

    def _score(self, row, trajs):
        ray = _ray()
        rewards, metrics = ray.get(self.reward.score.remote(row, trajs))
        for t, r in zip(trajs, rewards):
            t.reward, t.valid = r, r is not None
        return metrics

    def _emit(self, item) -> None:
        if isinstance(item, Failure):  # exceptions of any type cross the process boundary as text
            item = Failure(RuntimeError(f"rollout worker: {item.error!r}"))
        elif isinstance(item, GroupItem):
            item.incarnation = self.incarnation
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return
            except Exception:  # ray.util.queue.Full
                if self.producer is not None:
                    self.producer.idle_s += 0.5

    def set_weights(self, version: int, weights: dict) -> None:
        self.store.publish(version, weights)

    def info(self) -> dict:
        p = self.producer
        return {"incarnation": self.incarnation, "idle_s": p.idle_s if p else 0.0, "loads": p.loads if p else 0,
                "alive": bool(self.thread and self.thread.is_alive())}

    def shutdown(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)


class TrainerWorker:
    def train(self, cfg, train_fn) -> dict:
        return train_fn(cfg)


# ---------------------------------------------------------------- the trainer side


class RayProducer:
    """What AsyncRollout calls `producer`: the rollout actor, restarted from the ledger when it died."""

    def __init__(self, rollout: "RayRollout"):
        ray, cfg, s = _ray(), rollout.cfg, rollout.cfg.systems
        self.rollout = rollout
        self.reward = ray.remote(num_cpus=s.reward_cpus)(RewardWorker).remote(cfg)
        self.actor = ray.remote(num_cpus=s.rollout_cpus, num_gpus=s.rollout_gpus, max_restarts=-1)(RolloutWorker).remote(
            cfg, rollout.queue, self.reward)
        self.incarnation, self.restarts = None, 0
        self._idle, self._loads = 0.0, 0  # counters of dead incarnations

    def ensure_started(self) -> None:
        """(Re)start generation when the actor is new (first call, or Ray restarted it)."""
        ray = _ray()
        info = self._info()
        if info["incarnation"] == self.incarnation:
            return
        if self.incarnation is not None:
            self.restarts += 1  # groups of the dead incarnation still queued are dropped by RayRollout._get
        version, ref = self.rollout.latest_ref
        self.incarnation = ray.get(self.actor.start.remote(self.rollout.ledger.state(), version, ref))

    def _info(self) -> dict:
        ray = _ray()
        for _ in range(600):  # a restarting actor answers once its constructor has run
            try:
                return ray.get(self.actor.info.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.5)
        raise RuntimeError("the rollout worker did not come back")

    def is_alive(self) -> bool:
        self.ensure_started()
        return True

    def counters(self) -> tuple[float, int]:
        info = self._info()
        return info["idle_s"], info["loads"]

    def close(self) -> None:
        ray = _ray()
        try:
            ray.get(self.actor.shutdown.remote(), timeout=60)
        except Exception:  # shutting down a dead actor
            pass
        ray.kill(self.actor, no_restart=True)
        ray.kill(self.reward, no_restart=True)


class RayRollout(AsyncRollout):
    """AsyncRollout whose producer is a Ray actor: the queue is a ray.util.queue.Queue, weights go
    through the object store, groups of a dead incarnation are dropped (regenerated from the ledger)."""

    def __init__(self, cfg):
        from ray.util.queue import Queue

        super().__init__(cfg, self._start)
        self.queue = Queue(maxsize=cfg.systems.queue_bound(cfg.prompts_per_step))
        self.latest_ref, self.restarts, self.final_counters = None, 0, (0.0, 0)

    def _start(self, emit, weights, stop, resume):
        producer = RayProducer(self)
        producer.ensure_started()
        return producer

    def publish(self, model, version: int) -> None:
        if self.latest_ref is not None and version <= self.latest_ref[0]:
            return
        ray = _ray()
        ref = ray.put(weights_of(model))  # one copy in the object store per version
        self.latest_ref = (version, ref)
        if self.producer is not None:
            self.producer.ensure_started()
            self.producer.actor.set_weights.remote(version, ref)

    def _get(self):
        while True:
            item = super()._get()
            if not isinstance(item, GroupItem) or item.incarnation == self.producer.incarnation:
                return item

    def _producer_counters(self) -> tuple[float, int]:
        return self.producer.counters() if self.producer is not None else self.final_counters

    def summary(self) -> dict:
        out = super().summary()
        out["ray_rollout_restarts"] = self.producer.restarts if self.producer is not None else self.restarts
        return out

    def close(self) -> None:
        self.stop.set()
        if self.producer is not None:
            self.final_counters = self.producer.counters()
            self.restarts = self.producer.restarts
            self.producer.close()
            self.producer = None


def attach_ray(run) -> RayRollout:
    connect(run.cfg.systems)
    return RayRollout(run.cfg)


def train(cfg, train_fn) -> dict:
    """`posttrain rl cluster=ray`: `train_fn(cfg)` (the RL recipe's loop) runs as an actor (GPU if one is
    visible), the driver waits."""
    import torch

    ray = _ray()
    connect(cfg.systems)
    gpus = 1 if torch.cuda.is_available() and cfg.device != "cpu" else 0
    trainer = ray.remote(num_cpus=cfg.systems.trainer_cpus, num_gpus=gpus)(TrainerWorker).remote()
    try:
        return ray.get(trainer.train.remote(cfg, train_fn))
    finally:
        ray.kill(trainer)
