"""The RL algorithm presets: the one place that says what `algo=grpo` means .

A preset picks a cell of the method table: advantage estimator, policy loss, loss aggregation,
default KL coefficient β, whether dynamic sampling and DAPO's overlong shaping are on, and where it
departs from its paper (`describe_preset`, printed by `posttrain rl algo=X --show-preset`). Recipes, the planner and the docs read
them from here; every field can be overridden from the config.

β defaults (see `BETA_PRESETS` in kl.py for the papers' values): GRPO keeps DeepSeekMath's 0.04; the
later members of the family drop the KL term (DAPO §3 "Removing KL divergence"; Dr. GRPO; GSPO and
CISPO report runs without it), so β = 0 and no reference model is loaded.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from posttrain.algos.kl import BETA_PRESETS
from posttrain.algos.registry import advantages, policy_losses


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
    overlong: bool = False  # add DAPO's soft overlong punishment to the reward (Lmax = max_new_tokens, Lcache = Lmax / 5)
    deviations: tuple[str, ...] = ()  # where the preset differs from the paper's settings, and why


RL_PRESETS: dict[str, AlgoPreset] = {
    # PPO with a value model: token-level rewards (the KL folded in as k1), GAE, clipped value loss
    # 2 epochs x 2 minibatches: on SmolLM2 addition 0.157 -> 0.944 pass@1 in 40 steps (1 x 1: 0.727)
    "ppo": AlgoPreset("gae", "ppo", "token_mean", BETA_PRESETS["instructgpt"], False,
                      "Schulman et al. 2017; Ouyang et al. 2022, InstructGPT", epochs=2, minibatches=2, deviations=(
                          "epochs x minibatches 2 x 2 is ours (measured on SmolLM2 addition: 0.944 pass@1 vs 0.727 "
                          "with 1 x 1); InstructGPT's batch and epoch counts are for a 175B model",)),
    # online DPO: best vs worst of each group under the reward, a preference loss (pref_loss=dpo|ipo|…);
    # no advantage, policy loss or token aggregation (its own step: recipes/rl/online_dpo.py)
    "online_dpo": AlgoPreset(None, None, None, 0.0, False,
                             "Guo et al. 2024, Direct Language Model Alignment from Online AI Feedback", deviations=(
                                 "pairs are the best and worst of group_size samples under the run's reward; the paper "
                                 "samples 2 responses and asks an LLM annotator which is better",)),
    "grpo": AlgoPreset("grpo", "ppo", "seq_mean_token_mean", BETA_PRESETS["deepseekmath"], False,
                       "Shao et al. 2024, DeepSeekMath", deviations=(
                           "group_size defaults to 8 (the paper: 64 samples per question, 1024 per batch); "
                           "std + 1e-6 in the denominator (verl; the paper writes none)",)),
    "dr_grpo": AlgoPreset("dr_grpo", "ppo", "seq_mean_token_sum_norm", 0.0, False,
                          "Liu et al. 2025, Understanding R1-Zero-Like Training", deviations=(
                              "the constant length normaliser is max_new_tokens (the paper's released code: the "
                              "generation budget)",)),
    "dapo": AlgoPreset("grpo", "clip_higher", "token_mean", BETA_PRESETS["dapo"], True, "Yu et al. 2025, DAPO",
                       overlong=True, deviations=(
                           "overlong shaping is scaled to the run: Lmax = max_new_tokens, Lcache = Lmax / 5 (the paper: "
                           "Lmax 20480 with Lcache 4096, the same 1/5)",
                           "the paper's verifier reward is +1/-1 and the overlong penalty reaches -1; with a 0/1 verifier "
                           "(reward=math) the penalty weighs twice as much relative to correctness (reward=math:2,overlong "
                           "restores the paper's ratio)",
                           "no overlong filtering: the released recipe (verl recipe/dapo) uses the soft punishment alone; "
                           "mask_truncated=true adds the filter of the paper's Table 1",
                           "one optimizer step per rollout batch (the paper: 512 prompts x 16 samples in 16 mini-batches; "
                           "ppo_minibatches= sets it)")),
    "gspo": AlgoPreset("grpo", "gspo", "seq_mean_token_mean", 0.0, False, "Zheng et al. 2025, GSPO"),
    "cispo": AlgoPreset("grpo", "cispo", "token_mean", 0.0, False, "MiniMax 2025, MiniMax-M1", deviations=(
        "eps_high 0.28: the paper tunes the IS-weight bound and does not publish it (no lower bound, as the paper)",
        "the preset is the CISPO objective (§3.1) alone, not the rest of MiniMax-M1's training recipe")),
    "rloo": AlgoPreset("rloo", "ppo", "token_mean", 0.0, False, "Ahmadian et al. 2024, Back to Basics", deviations=(
        "β = 0: the paper folds a fixed KL penalty into the sequence reward; beta= adds a KL to the loss instead (k3)",
        "token_mean instead of a per-sequence sum of log-probs: the same gradient direction, another constant scale")),
    "reinforce_pp": AlgoPreset("reinforce_pp", "ppo", "token_mean", 0.0, False, "Hu 2025, REINFORCE++", deviations=(
        "β = 0: the paper subtracts a per-token k1 KL from the reward (A_t = r − β Σ_{s≥t} KL_s); beta= adds a KL to "
        "the loss instead",)),
}


def uses_critic(preset: AlgoPreset) -> bool:
    """Token-level advantages from a value model (GAE) instead of a group baseline."""
    return preset.advantage == "gae"


def rl_preset(algo: str) -> AlgoPreset:
    if algo not in RL_PRESETS:
        raise ValueError(f"unknown algo '{algo}'; choose one of {', '.join(RL_PRESETS)}")
    return RL_PRESETS[algo]


def _defaults(fn, skip: set[str]) -> str:
    """'name=default, …' of a registry function's keyword options (what the preset uses unless *_args says otherwise)."""
    params = inspect.signature(fn).parameters.values()
    return ", ".join(f"{p.name}={p.default!r}" for p in params
                     if p.default is not inspect.Parameter.empty and p.name not in skip)


def describe_preset(algo: str) -> str:
    """What `algo=NAME` sets, with the options of its estimator and loss, the paper and the deviations from it
    (`posttrain rl algo=NAME --show-preset`; no model is loaded)."""
    p = rl_preset(algo)
    lines = [f"algo={algo}: {p.paper}"]
    if p.advantage is None:
        lines.append("  advantage        none (best vs worst of each group -> pref_loss, default dpo; pref_args=)")
    else:
        adv = advantages.get(p.advantage)
        opts = _defaults(adv, {"last_value", "lengths"})
        lines.append(f"  advantage        {p.advantage}" + (f" ({opts})" if opts else "")
                     + ("  [gamma=, lam=, whiten_advantages=]" if uses_critic(p) else "  [advantage_args=]"))
    if p.loss is not None:
        opts = _defaults(policy_losses.get(p.loss), {"behaviour_logp", "tis_cap"})
        lines.append(f"  policy loss      {p.loss} ({opts})  [loss=, loss_args=]")
        lines.append(f"  aggregation      {p.agg}  [loss_agg=]")
    if p.advantage is None:  # online DPO: β is the preference loss's own, the reference its initial policy
        lines.append("  beta             the preference loss's own (dpo: 0.1)  [pref_args={beta: ...}]; reference = "
                     "the initial policy  [ref_update_every=]")
    else:
        kl = "k1 in the token reward" if uses_critic(p) else ("k3 in the loss" if p.beta > 0 else "none (no reference model)")
        lines.append(f"  beta             {p.beta:g}, KL {kl}  [beta=, kl_estimator=, kl_target=]")
    lines.append(f"  dynamic sampling {'on' if p.dynamic_sampling else 'off'}  [dynamic_sampling=]")
    shaping = "on: reward + overlong (Lmax = max_new_tokens, Lcache = Lmax / 5)" if p.overlong else "off"
    lines.append(f"  overlong shaping {shaping}  [overlong_shaping=]")
    lines.append(f"  epochs x minibatches per batch  {p.epochs} x {p.minibatches}  [ppo_epochs=, ppo_minibatches=]")
    lines.append("  deviations from the paper:" if p.deviations else "  deviations from the paper: none")
    lines += [f"    - {d}" for d in p.deviations]
    return "\n".join(lines)
