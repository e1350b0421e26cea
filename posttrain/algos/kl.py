"""Per-token KL estimators between the policy πθ and the reference πref, and the KL coefficient β.

From log-probs of the *sampled* tokens (tokens drawn from πθ), with log ratio ℓ = log πθ − log πref:

    k1 = ℓ                                 unbiased for KL(πθ‖πref), can be negative per token
                                           (PPO/InstructGPT: folded into the per-token reward)
    k2 = ½ ℓ²                              biased, low variance, ≥ 0
    k3 = ρ − 1 − log ρ,  ρ = πref/πθ = e^{−ℓ}
                                           unbiased, ≥ 0 (since e^x ≥ 1 + x); GRPO's KL in the loss
                                           (Schulman 2020, "Approximating KL divergence"; DeepSeekMath eq. 4)

All three are 0 when πθ = πref. Shapes: logp, ref_logp (B, T) (any shape works) -> (B, T).
No clamping is applied (verl clamps k3 to [-10, 10]); the caller masks padded positions.

`AdaptiveKLController` is Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
Preferences", §2.2) in the form used by lm-human-preferences / TRL:

    e = clip(KL / KL_target − 1, −0.2, 0.2)
    β ← β · (1 + e · n_steps / horizon)

(the paper writes β ← β(1 + K_β e) per batch; K_β = n_steps / horizon here).
"""

from __future__ import annotations

import torch

from posttrain.algos.registry import kl_estimators

# β presets from the papers. DAPO drops the KL term (β = 0: no reference model is loaded).
BETA_PRESETS: dict[str, float] = {
    "instructgpt": 0.02,  # Ouyang et al. 2022
    "llama2": 0.01,  # Touvron et al. 2023
    "deepseekmath": 0.04,  # Shao et al. 2024 (GRPO)
    "tulu3": 0.05,  # Lambert et al. 2024 (RLVR)
    "dapo": 0.0,  # Yu et al. 2025
}


def beta_value(value):
    """A β given as a number or as a preset's name (`beta=deepseekmath` -> 0.04); None stays None (the algo's
    default). An unknown name raises ValueError listing the names (the config turns it into a ConfigError)."""
    if isinstance(value, str):
        name = value.strip().lower()
        if name in BETA_PRESETS:
            return BETA_PRESETS[name]
        try:
            return float(name)
        except ValueError:
            names = ", ".join(f"{k} ({v:g})" for k, v in BETA_PRESETS.items())
            raise ValueError(f"beta must be a number >= 0 or a preset name: {names}; got {value!r}") from None
    return value


@kl_estimators.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log πθ − log πref  # (B, T)"""
    return logp - ref_logp


@kl_estimators.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log πθ − log πref)²  # (B, T)"""
    return 0.5 * (logp - ref_logp) ** 2


@kl_estimators.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = ρ − 1 − log ρ with log ρ = log πref − log πθ  # (B, T), ≥ 0.

    expm1 keeps precision when ρ ≈ 1 (ρ − 1 − log ρ ~ (log ρ)²/2 would otherwise cancel).
    """
    log_rho = ref_logp - logp
    return torch.expm1(log_rho) - log_rho


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate by name ("k1" | "k2" | "k3")  # (B, T)."""
    return kl_estimators.get(kind)(logp, ref_logp)


class AdaptiveKLController:
    """β adapted toward a target KL (Ziegler et al. 2019). `update` takes a Python float: the caller
    logs the step's KL once (`.item()` at the logger) and passes it here.

    target: KL budget in nats per sequence (lm-human-preferences used 6.0); horizon: 10000.
    """

    def __init__(self, init_beta: float, target: float, horizon: int = 10000):
        if target <= 0 or horizon <= 0:
            raise ValueError("adaptive KL needs target > 0 and horizon > 0")
        self.value = float(init_beta)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """One update after a batch of `n_steps` samples; returns the new β."""
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)  # clip((KL − target)/target, ±0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
        return self.value


class FixedKLController:
    """Constant β with the same interface as AdaptiveKLController."""

    def __init__(self, beta: float):
        self.value = float(beta)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value
