"""What an RL step works on: `RLRun` (built once by build.py: setup) and `UpdateStats` (one update's statistics).

`RLRun` holds the trained policy and everything around it; the modes of a run are objects chosen once
in setup, never flags read inside the step:
    rollout   where the step's trajectories come from (posttrain/recipes/rl/rollout.py: the Rollout protocol)
    critic    PPO's value model (posttrain/recipes/rl/ppo.py), None for the group-baseline family
    ref       the frozen reference policy, None at β = 0 (no reference is loaded)
    info      torchrun's ranks (world size 1 without torchrun)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from posttrain.algos import AdaptiveKLController, FixedKLController
from posttrain.algos.entropy import AdaptiveEntropyCoef, FixedEntropyCoef
from posttrain.data.formats import Row
from posttrain.eval.hook import EvalHook
from posttrain.monitor.alarms import AlarmMonitor
from posttrain.monitor.metrics import MetricsWriter, PhaseTimer
from posttrain.plan.measure import Measured
from posttrain.recipes.rl.config import RLConfig
from posttrain.recipes.rl.drift import DriftProbe
from posttrain.recipes.rl.phases import TokenMeans
from posttrain.recipes.rl.ppo import Critic
from posttrain.rewards.registry import ComposedReward
from posttrain.rollout.signals import EngineWindow
from posttrain.rollout.trajectory import Trajectory
from posttrain.rollout.types import Request, RequestOutput
from posttrain.systems.dist import DistInfo
from posttrain.training.curriculum import BandSampler
from posttrain.training.data_order import EpochSampler
from posttrain.training.lifecycle import RunLifecycle


class Sampler(Protocol):
    """What samples from the policy (evaluation, synchronous sources): the built-in engine's interface."""

    def generate(self, requests: list[Request], **kwargs) -> list[RequestOutput]: ...

    def sync_weights(self) -> None:
        """The policy's weights changed in place: drop packed copies and cached KV."""


class Rollout(Protocol):
    """Where a step's trajectories come from (implementations and how to add one: rollout.py)."""

    def collect(self, run: RLRun, step: int) -> tuple[list[Trajectory], dict]:
        """B groups of G scored samples for step `step` -> (trajectories, metrics)."""

    def sync_weights(self, run: RLRun) -> None:
        """After an update: the sampler picks up the policy's new weights."""

    def plan_inputs(self, run: RLRun) -> dict:
        """The token shape of a step, for the planner (seq_len, prompt_len, or an agent's turns)."""

    def state(self) -> dict:
        """What a checkpoint keeps of the source ({}: nothing beyond the run's data position)."""

    def load_state(self, checkpoint: dict, start: int) -> None:
        """Resume from a checkpoint's state (the whole dict: `rollout` holds what `state()` returned; a
        checkpoint of another kind of source still has the data position `sampler`) before step `start`."""

    def summary(self) -> dict:
        """Totals for summary.json."""

    def close(self) -> None:
        """Stop background work (threads, actors)."""


@dataclass(eq=False)
class RLRun:
    """Everything a step needs, built once by `setup`."""

    cfg: RLConfig
    life: RunLifecycle
    tok: PreTrainedTokenizerBase
    rows: list[Row]
    reward_fn: ComposedReward | None  # None with env= (the environment scores its episodes)
    model: torch.nn.Module  # the trained policy (under torchrun: its FSDP root)
    ref: torch.nn.Module | None  # frozen π_ref; None when no reference is needed (β = 0)
    engine: Sampler  # rollout.engine.Engine over the policy's weights, or async_rl.TrainerEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: EpochSampler | BandSampler  # the data order (its position, or the curriculum's rates, checkpointed)
    kl_ctl: FixedKLController | AdaptiveKLController
    adv_fn: Callable | None  # outcome advantages (registry posttrain.algos.advantages); None for PPO (GAE)
    loss_fn: Callable | None  # policy loss (registry posttrain.algos.policy_losses); None for online DPO
    agg: str | None  # loss aggregation (posttrain.algos.aggregate); None for online DPO
    dynamic: bool  # dynamic sampling (DAPO): groups without signal are dropped and refilled
    tis_cap: float | None  # truncated importance sampling cap on π_old/μ (None: off)
    device: torch.device
    inert_loss: bool = False  # loss_fn's gradient is 0 at A = 0 (probed at setup): zero-advantage groups may skip backward
    info: DistInfo = field(default_factory=DistInfo)
    rollout: Rollout | None = None  # set by setup once the engine exists
    critic: Critic | None = None
    metrics: MetricsWriter | None = None
    measured: Measured = field(default_factory=Measured)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    alarms: AlarmMonitor = field(default_factory=AlarmMonitor)
    eval_hook: EvalHook | None = None
    drift: DriftProbe | None = None  # KL to the start policy when no reference is held (β = 0)
    curriculum: BandSampler | None = None  # curriculum=band: the sampler itself, fed each group's rewards
    engine_window: EngineWindow = field(default_factory=EngineWindow)  # the engine's counters at the last row
    entropy_ctl: FixedEntropyCoef | AdaptiveEntropyCoef = field(default_factory=FixedEntropyCoef)  # entropy bonus coefficient

    @property
    def beta(self) -> float:
        """The KL coefficient in use (adaptive or fixed); 0 without a reference."""
        return self.kl_ctl.value if self.ref is not None else 0.0

    def checkpoint_extras(self) -> dict | None:
        """Modules a checkpoint keeps beside the policy: PPO's value model (with its optimizer), and the reference
        once it follows the policy (online DPO's `ref_update_every`, ProRL's `ref_reset_every`: no longer the
        initial weights)."""
        extras = dict(self.critic.extras()) if self.critic is not None else {}
        moves = (self.cfg.algo == "online_dpo" and self.cfg.ref_update_every) or self.cfg.ref_reset_every
        if self.ref is not None and moves:
            extras["reference"] = (self.ref, None)
        return extras or None

    @property
    def loss_beta(self) -> float:
        """β of the β·KL term in the policy loss: PPO folds the KL into the token rewards instead."""
        return 0.0 if self.critic is not None else self.beta


@dataclass
class Consistency:
    """Trainer vs sampler on the sampled tokens, as sums over tokens: max |Δ log p|, Σ |Δ log p| and
    Σ (log μ − log π) ≈ KL(μ‖π) · tokens."""

    dlogp_max: float = 0.0
    dlogp_sum: float = 0.0
    kl_sum: float = 0.0
    tokens: int = 0

    def add(self, other: Consistency) -> None:
        self.dlogp_max = max(self.dlogp_max, other.dlogp_max)
        self.dlogp_sum += other.dlogp_sum
        self.kl_sum += other.kl_sum
        self.tokens += other.tokens


@dataclass
class UpdateStats:
    """What one update measured, summed over its micro-batches (and, under torchrun, over the ranks)."""

    losses: TokenMeans = field(default_factory=TokenMeans)  # the policy loss's metrics, token-weighted
    critic: TokenMeans = field(default_factory=TokenMeans)  # PPO's value loss metrics
    loss: float = 0.0  # the policy loss, averaged over epochs
    entropy: float = 0.0  # Σ entropy over the first epoch's loss tokens
    cons: Consistency = field(default_factory=Consistency)
    grad_norm: torch.Tensor | None = None  # the first optimizer step's norm before clipping (None: no policy step)

    def merge(self, other: UpdateStats) -> None:
        """Fold in another rank's statistics (the gradient norm is global already: kept)."""
        self.losses.merge(other.losses.sums, other.losses.weight)
        self.critic.merge(other.critic.sums, other.critic.weight)
        self.loss += other.loss
        self.entropy += other.entropy
        self.cons.add(other.cons)

    def metrics(self) -> dict:
        """entropy and consistency/* per token, and the loss and norm when the policy stepped."""
        if self.grad_norm is None:
            return {}
        n = max(self.cons.tokens, 1)
        return {"loss": self.loss, "grad_norm": self.grad_norm, "entropy": self.entropy / n,
                "consistency/dlogp_max": self.cons.dlogp_max, "consistency/dlogp_mean": self.cons.dlogp_sum / n,
                "consistency/kl_behaviour_trainer": self.cons.kl_sum / n}
