"""The checks of `posttrain rl`'s algorithm options beyond the presets, run when the config is read (before any
model loads): `advantage_args` against the estimator, the entropy bonus and its control, the reference reset,
DAPO's overlong shaping. Each refusal names the key and what to do; pydantic turns the ValueError into a
ConfigError."""

from __future__ import annotations

import inspect

import torch

from posttrain.algos import advantages as adv_registry
from posttrain.algos.adv_estimators import takes_lengths
from posttrain.algos.presets import rl_preset, uses_critic

# the estimator's inputs the recipe passes itself (not options)
ESTIMATOR_INPUTS = {"rewards", "group_ids", "lengths"}


def check_rl_options(cfg) -> None:
    """Refuse a misused option of an RLConfig (ValueError naming the key)."""
    check_advantage_args(cfg)
    check_entropy(cfg)
    check_ref_reset(cfg)
    if cfg.overlong_shaping and cfg.env:
        raise ValueError("overlong_shaping=true with env=: the environment scores its episodes, the overlong shaping "
                         "applies to reward= only; drop overlong_shaping")


def estimator_options(fn) -> set[str]:
    """Keyword options of an outcome estimator (what advantage_args may set)."""
    return {n for n, p in inspect.signature(fn).parameters.items()
            if n not in ESTIMATOR_INPUTS and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def check_advantage_args(cfg) -> None:
    """advantage_args: keys against the estimator's signature, values by one call on a 4-sample toy batch."""
    args = cfg.advantage_args
    if not args or cfg.algo == "online_dpo":  # online DPO refuses advantage_args in the config itself
        return
    if uses_critic(rl_preset(cfg.algo)) and cfg.advantage is None:
        raise ValueError("advantage_args: algo=ppo's advantages are GAE from its value model; set gamma=, lam= and "
                         "whiten_advantages= instead")
    name = cfg.resolved_advantage
    fn = adv_registry.get(name)
    accepted = estimator_options(fn)
    unknown = sorted(set(args) - accepted)
    if unknown:
        raise ValueError(f"advantage_args {unknown} are not arguments of advantage estimator '{name}' "
                         f"(it takes {sorted(accepted)})")
    if adv_registry.meta(name).get("level") != "outcome":
        return
    rewards, groups = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0, 1, 1])
    extra = {"lengths": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)} if takes_lengths(fn) else {}
    try:
        fn(rewards, groups, **extra, **args)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"advantage_args {args}: {e} (advantage estimator '{name}')") from None


def check_entropy(cfg) -> None:
    """entropy_coef / entropy_control: a per-token entropy bonus in the policy-gradient loss."""
    set_keys = {"entropy_target", "entropy_delta"} & cfg.model_fields_set
    if cfg.entropy_control == "none" and set_keys:
        raise ValueError(f"{', '.join(sorted(set_keys))}: used only by entropy_control=adaptive; add it or drop them")
    if cfg.entropy_coef == 0 and cfg.entropy_control == "none":
        return
    if cfg.algo == "online_dpo":
        raise ValueError("entropy_coef / entropy_control with algo=online_dpo: its preference loss is over whole "
                         "sequences, with no per-token entropy term; drop them or use a policy-gradient algo")
    if cfg.sampling.truncated:
        raise ValueError("entropy_coef / entropy_control with top_k / top_p sampling: the entropy bonus's gradient is "
                         "computed on the temperature-only distribution; sample with top_k=0 top_p=1, or drop the bonus")


def check_ref_reset(cfg) -> None:
    """ref_reset_every (ProRL): the reference follows the policy every N steps."""
    if cfg.ref_reset_optimizer and not cfg.ref_reset_every:
        raise ValueError("ref_reset_optimizer=true without ref_reset_every: the optimizer is reset at reference resets; "
                         "set ref_reset_every=N")
    if not cfg.ref_reset_every:
        return
    if cfg.algo == "online_dpo":
        raise ValueError("ref_reset_every with algo=online_dpo: its reference follows the policy with ref_update_every=N")
    if cfg.resolved_beta == 0:
        raise ValueError(f"ref_reset_every with beta=0 (algo={cfg.algo}'s default or given): there is no reference to "
                         "reset; set beta > 0 (e.g. beta=deepseekmath) or drop ref_reset_every")
    if cfg.lora.enabled:
        raise ValueError("ref_reset_every with lora: the LoRA reference is the base model (adapter off) and cannot "
                         "follow the policy; train without lora or drop ref_reset_every")
