"""The RL algorithm presets: the one place that says what `algo=grpo` means .

A preset picks a cell of the method table: advantage estimator, policy loss, loss aggregation,
default KL coefficient β and whether dynamic sampling is on. Recipes, the planner and the docs read
them from here; every field can be overridden from the config.

β defaults (see `BETA_PRESETS` in kl.py for the papers' values): GRPO keeps DeepSeekMath's 0.04; the
later members of the family drop the KL term (DAPO §3 "Removing KL divergence"; Dr. GRPO; GSPO and
CISPO report runs without it), so β = 0 and no reference model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.algos.kl import BETA_PRESETS


@dataclass(frozen=True)
class AlgoPreset:
    advantage: str | None  # registry name in posttrain.algos.advantages (None: not a policy-gradient method)
    loss: str | None  # registry name in posttrain.algos.policy_losses
    agg: str | None  # aggregation mode (posttrain.algos.aggregate)
    beta: float  # default KL coefficient (KL in the loss)
    dynamic_sampling: bool  # drop groups whose rewards are all equal and refill (DAPO)
    paper: str
    epochs: int = 1  # passes over each batch of samples (PPO: more than one, so the clipped ratio matters)
    minibatches: int = 1  # optimizer steps per pass


RL_PRESETS: dict[str, AlgoPreset] = {
    # PPO with a value model: token-level rewards (the KL folded in as k1), GAE, clipped value loss
    # 2 epochs x 2 minibatches: on SmolLM2 addition 0.157 -> 0.944 pass@1 in 40 steps (1 x 1: 0.727)
    "ppo": AlgoPreset("gae", "ppo", "token_mean", BETA_PRESETS["instructgpt"], False,
                      "Schulman et al. 2017; Ouyang et al. 2022, InstructGPT", epochs=2, minibatches=2),
    # online DPO: best vs worst of each group under the reward, a preference loss (pref_loss=dpo|ipo|…);
    # no advantage, policy loss or token aggregation (its own step: recipes/rl/online_dpo.py)
    "online_dpo": AlgoPreset(None, None, None, 0.0, False,
                             "Guo et al. 2024, Direct Language Model Alignment from Online AI Feedback"),
    "grpo": AlgoPreset("grpo", "ppo", "seq_mean_token_mean", BETA_PRESETS["deepseekmath"], False,
                       "Shao et al. 2024, DeepSeekMath"),
    "dr_grpo": AlgoPreset("dr_grpo", "ppo", "seq_mean_token_sum_norm", 0.0, False,
                          "Liu et al. 2025, Understanding R1-Zero-Like Training"),
    "dapo": AlgoPreset("grpo", "clip_higher", "token_mean", BETA_PRESETS["dapo"], True, "Yu et al. 2025, DAPO"),
    "gspo": AlgoPreset("grpo", "gspo", "seq_mean_token_mean", 0.0, False, "Zheng et al. 2025, GSPO"),
    "cispo": AlgoPreset("grpo", "cispo", "token_mean", 0.0, False, "MiniMax 2025, MiniMax-M1"),
    "rloo": AlgoPreset("rloo", "ppo", "token_mean", 0.0, False, "Ahmadian et al. 2024, Back to Basics"),
    "reinforce_pp": AlgoPreset("reinforce_pp", "ppo", "token_mean", 0.0, False, "Hu 2025, REINFORCE++"),
}


def uses_critic(preset: AlgoPreset) -> bool:
    """Token-level advantages from a value model (GAE) instead of a group baseline."""
    return preset.advantage == "gae"


def rl_preset(algo: str) -> AlgoPreset:
    if algo not in RL_PRESETS:
        raise ValueError(f"unknown algo '{algo}'; choose one of {', '.join(RL_PRESETS)}")
    return RL_PRESETS[algo]
