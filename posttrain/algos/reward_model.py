"""Bradley–Terry reward-model loss (docs/algorithms.md, "Preference losses").

    L = −log σ(r_w − r_l − m)  +  c · (r_w + r_l)²

P(y_w ≻ y_l) = σ(r_w − r_l) (Bradley & Terry 1952; InstructGPT, Ouyang et al. 2022 eq. 1).
m: optional per-pair margin from the preference strength (Llama 2, Touvron et al. 2023 eq. 2).
c: optional centering penalty that keeps rewards near zero mean (Eisenstein et al. 2023, "Helping
or Herding?"; TRL `center_rewards_coefficient`, suggested 0.01). Default c = 0 (off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, *,
                       margin: torch.Tensor | float | None = None, center_coef: float = 0.0):
    """chosen_rewards, rejected_rewards (B,) scalar rewards -> (loss (B,), metrics).

    Metrics: rm/accuracy (r_w > r_l), rm/margin (mean r_w − r_l), rm/chosen, rm/rejected,
    rm/reward_mean (mean of all rewards, what the centering term pushes to 0)."""
    diff = chosen_rewards - rejected_rewards  # (B,)
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (chosen_rewards + rejected_rewards) ** 2
    cw, cl = chosen_rewards.detach(), rejected_rewards.detach()
    metrics = {
        "rm/accuracy": (cw > cl).float().mean(),
        "rm/margin": (cw - cl).mean(),
        "rm/chosen": cw.mean(),
        "rm/rejected": cl.mean(),
        "rm/reward_mean": torch.cat([cw, cl]).mean(),
    }
    return loss, metrics
