"""PPO's critic (Schulman et al. 2017; InstructGPT, Ouyang et al. 2022): the value model and everything
that only PPO does, behind one object the step calls when `run.critic` is set.

    advantages   π_old (for the KL in the reward, β > 0), V(s_t), token rewards r_t = −β·k1_t (+ the
                 outcome reward on the last loss token), GAE, whitening
    backward     the clipped value loss of a micro-batch, its share of the minibatch's token mean
    step         the value model's AdamW step (after each minibatch), `end_update` its schedule
    reward_kl    KL(π_old ‖ π_ref) measured from the reward's k1 terms (what the KL controller follows)
    extras/state/save   what checkpoints and final/value/ hold

The value model is a copy of the policy with a zero scalar head, or a reward model folder
(`value_model=`); under torchrun it is sharded like the policy and its values run on every rank.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.algos import gae, value_loss
from posttrain.models.value import value_model_from_policy, value_model_from_reward_model
from posttrain.recipes.rl.config import RLConfig
from posttrain.recipes.rl.phases import TokenMeans, policy_logps
from posttrain.rollout.trajectory import RLBatch
from posttrain.systems import fsdp
from posttrain.systems.dist import DistInfo
from posttrain.training.optim import build_optimizer, optimizer_step


class Critic:
    def __init__(self, model: torch.nn.Module, cfg: RLConfig, info: DistInfo):
        self.model, self.cfg, self.info = model, cfg, info
        lr = cfg.critic_lr or 10 * cfg.optim.lr
        self.optimizer, self.scheduler = build_optimizer(model, cfg.optim.model_copy(update={"lr": lr}), cfg.max_steps)

    @classmethod
    def build(cls, cfg: RLConfig, policy: torch.nn.Module, device: torch.device, info: DistInfo) -> Critic:
        """From a reward model folder, or from `policy` (unsharded: the initial weights); sharded under torchrun."""
        model = value_model_from_reward_model(cfg.value_model, device) if cfg.value_model else value_model_from_policy(policy)
        if info.world > 1:
            model = fsdp.shard_model(model, lm=model.lm)
        return cls(model, cfg, info)

    # ------------------------------------------------------------ before the update

    def advantages(self, run, batches: list[RLBatch]) -> dict:
        """π_old (for the KL in the reward), V(s_t), token rewards and GAE advantages on the batches."""
        cfg = self.cfg
        if run.beta > 0:
            old_logps(run.model, batches, cfg)
        critic_values(self.model, batches, cfg.mixed_precision)
        return ppo_advantages(batches, run.beta, cfg.gamma, cfg.lam, cfg.whiten_advantages, cfg.bootstrap_truncated)

    # ------------------------------------------------------------ the update

    def backward(self, b: RLBatch, norm_tokens: int, stats: TokenMeans, weight: float = 1.0) -> None:
        """PPO's clipped value loss on one micro-batch, its share of the minibatch's token mean; `weight` 0:
        a sharded run's padding copy (its loss counts 0, no statistics)."""
        loss, m = critic_loss(self.model, b, self.cfg.mixed_precision, self.cfg.vf_clip, norm_tokens)
        scale = getattr(self.model, "loss_scale", 1.0)  # sharded: FSDP averages gradients over ranks, W x is a sum
        (loss * (weight * scale)).backward()
        if weight:
            tokens = float(b.loss_mask.sum())
            stats.add({"vf/loss": loss.detach() * norm_tokens / max(tokens, 1), **m}, tokens)

    def step(self) -> None:
        optimizer_step(self.model, self.optimizer, self.cfg.optim.max_grad_norm)

    def end_update(self) -> None:
        self.scheduler.step()

    @staticmethod
    def reward_kl(batches: list[RLBatch]) -> tuple[float, float, int]:
        """KL(π_old ‖ π_ref) from the reward's k1 terms -> (per token, nats per sequence, sequences)."""
        k1 = torch.cat([(b.old_logp - b.ref_logp)[b.loss_mask] for b in batches])
        seqs = max(sum(int(b.valid.sum()) for b in batches), 1)
        return float(k1.mean()), float(k1.sum()) / seqs, seqs

    # ------------------------------------------------------------ checkpoints

    def extras(self) -> dict:
        """Checkpointed beside the policy: checkpoints/step-N/value/ (weights and optimizer)."""
        return {"value": (self.model, self.optimizer)}

    def state(self) -> dict:
        return {"critic_scheduler": self.scheduler.state_dict()}

    def load_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["critic_scheduler"])

    def save(self, path: Path, main: bool) -> None:
        """final/value/ (sequence-classification layout); a sharded value model is gathered first (every rank)."""
        if isinstance(self.model, fsdp.Sharded):
            state = fsdp.full_state(self.model.model)
            if main:
                self.model.model.save_pretrained(path, state=state)
        else:
            self.model.save_pretrained(path)


# ---------------------------------------------------------------- the pieces (pure over batches)


def values(critic, b: RLBatch, mixed_precision: str, index: torch.Tensor) -> torch.Tensor:
    """V at the flat positions `index` (a sharded value model: inside its FSDP root's forward)."""
    return fsdp.apply(critic, lambda m, *args: m.values(*args), b, mixed_precision, index)


@torch.no_grad()
def old_logps(model, batches: list[RLBatch], cfg: RLConfig) -> None:
    """log π_old of the loss tokens before any update (PPO needs them for the KL in the reward)."""
    for b in batches:
        b.old_logp, _ = fsdp.apply(model, policy_logps, b, cfg.sampling.temperature, cfg.mixed_precision, truncated=True)


@torch.no_grad()
def critic_values(critic, batches: list[RLBatch], mixed_precision: str) -> None:
    """V(s_t) at every loss token's state -> old_values (S, L); V after the last token -> bootstrap (S,)."""
    for b in batches:
        m = b.hidden_index.numel()
        v = values(critic, b, mixed_precision, torch.cat([b.hidden_index, b.last_index]))
        b.old_values, b.bootstrap = b.spread(v[:m]), v[m:]


def ppo_advantages(batches: list[RLBatch], beta: float, gamma: float, lam: float, whiten: bool = True,
                   bootstrap_truncated: bool = False) -> dict:
    """Token rewards r_t = −β·k1_t (+ the outcome reward on the last loss token), then GAE.

    k1_t = log π_old(a_t|s_t) − log π_ref(a_t|s_t) (InstructGPT: the KL penalty folded into the reward).
    A sample cut at the length limit: by default the cut is terminal (the reward scored the cut text,
    as in InstructGPT/TRL/OpenRLHF); with `bootstrap_truncated` the cut is a time limit (Pardo et al.
    2018) and GAE continues from V after the last token. Advantages are whitened over the step's
    loss tokens (mean 0, std 1)."""
    for b in batches:
        mask = b.loss_mask.float()  # (S, L)
        rewards = torch.zeros_like(mask)
        if beta > 0:
            rewards -= beta * (b.old_logp - b.ref_logp) * mask
        last = (b.mask.sum(-1) - 1).clamp(min=0)  # (S,) position of each sample's last loss token
        outcome = torch.tensor([t.reward or 0.0 for t in b.trajectories], device=mask.device)
        rewards[torch.arange(len(last)), last] += outcome * b.valid
        cut = torch.tensor([bootstrap_truncated and t.finish_reason == "length" for t in b.trajectories],
                           device=mask.device)
        b.advantages, b.returns = gae(rewards, b.old_values, mask, gamma=gamma, lam=lam, last_value=b.bootstrap * cut)
    flat = torch.cat([b.advantages[b.loss_mask] for b in batches])
    mean, std = flat.mean(), flat.std() if flat.numel() > 1 else torch.ones(())
    if whiten:
        for b in batches:
            b.advantages = (b.advantages - mean) / (std + 1e-8) * b.loss_mask
    rets = torch.cat([b.returns[b.loss_mask] for b in batches])
    return {"adv/mean": mean, "adv/std": std, "returns/mean": rets.mean(),
            "values/mean": torch.cat([b.old_values[b.loss_mask] for b in batches]).mean()}


def critic_loss(critic, b: RLBatch, mixed_precision: str, clip: float | None, norm_tokens: int):
    """Clipped value loss of one micro-batch, its exact share of the step's token mean."""
    v = b.spread(values(critic, b, mixed_precision, b.hidden_index))  # (S, L)
    tok, metrics = value_loss(v, b.old_values, b.returns, b.loss_mask, clip=clip)
    return tok.sum() / norm_tokens, metrics
