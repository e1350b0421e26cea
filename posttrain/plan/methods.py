"""Per-method registry for the planner: which models sit in memory and which passes a step runs.

Every method is policy + reward + reference (+ value). A method here is two functions of a
few options (β, where the reward comes from, precomputed reference, value model, distillation mode):
`roles` (the models held in memory, each trained or frozen) and `phases` (the passes of one step,
each a forward at 2 FLOPs per parameter per token or a training pass at 6 = forward 2 + backward 4).

FLOPs per token in units of N (policy parameters, all models the same size; forward 2N, backward
4N as in Kaplan et al. 2020, Scaling Laws for Neural Language Models; docs/planner.md):
    SFT, RM      train 6N                                                   = 6N
    DPO          reference forward 2N + policy train 6N                     = 8N
    GRPO         generate 2N + reference 2N + reward model 2N + train 6N   = 12N
                 (a verifier drops the reward model's 2N, β = 0 drops the reference's 2N)
    PPO          GRPO + value forward 2N + value train 6N                   = 20N
    RS (BoN)     generate 2N + reward model 2N on all G samples, SFT 6N on the kept 1/G
    distill      on-policy: student generates 2N_s + teacher scores 2N_T + student trains 6N_s
                 logit-level: teacher forward 2N_T + student 6N_s; sequence-level: teacher generates 2N_T + 6N_s
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.algos.kl import BETA_PRESETS
from posttrain.algos.presets import RL_PRESETS
from posttrain.errors import UserError


@dataclass(frozen=True)
class Role:
    role: str  # policy, value, reference, reward, teacher
    trainable: bool
    size: str = "model"  # whose parameter count: "model" (the planned model), "reward_model", "teacher"


@dataclass(frozen=True)
class Phase:
    name: str  # generate, reference, reward, value, teacher, train, value_train
    role: str  # the model that runs it
    flops_per_param: int  # 2 = forward (or decode), 6 = forward + backward
    share: str = "all"  # tokens it touches: "all" of the step, or "kept" (rejection sampling: 1 of G)


@dataclass(frozen=True)
class Options:
    beta: float  # KL coefficient; 0 loads no reference model
    reward: str  # "model" (a reward model in memory) or "verifier" (a program: no model, ~0 FLOPs)
    precompute_ref: bool  # DPO: reference log-probs computed once beforehand, reference not held
    value_model: bool  # a critic (GAE): always for PPO, optional for GRPO-family / RLVR / agents
    distill: str = "on_policy"  # on_policy | logit | sequence


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    reward_from: str  # the columns of the method table (`posttrain methods`)
    reference: str
    value: str
    generates: bool  # sampling is part of a step (KV cache matters)
    pairwise: bool  # a batch item is a (chosen, rejected) pair: 2 sequences
    default_beta: float = 0.0
    default_reward: str = "none"  # "model" / "verifier" where the choice exists, else "none"
    rl: bool = False  # accepts `value_model` (an optional critic)
    variants: tuple[tuple[str, dict], ...] = field(default_factory=tuple)  # (label, option overrides) for the table


REWARD_CHOICES = ("model", "verifier")
DISTILL_MODES = ("on_policy", "logit", "sequence")

METHODS: dict[str, Method] = {m.name: m for m in [
    Method("sft", "supervised fine-tuning", "implicit in labelled targets", "—", "—", False, False),
    Method("rm", "reward model (Bradley–Terry)", "pairwise labels → scalar", "—", "—", False, True),
    Method("rs", "rejection sampling: best of G → SFT", "RM / verifier picks best of N",
           "implicit (BoN KL ≤ log N − (N−1)/N)", "—", True, False, default_reward="model",
           variants=(("with verifier", {"reward": "verifier"}),)),
    Method("ppo", "PPO (RLHF)", "RM", "k1 KL per token in the reward", "yes (GAE)", True, False,
           default_beta=BETA_PRESETS["instructgpt"], default_reward="model", rl=True,
           variants=(("with verifier", {"reward": "verifier"}), ("with β=0", {"beta": 0.0}))),
    Method("grpo", "GRPO family", "RM or verifier", "k3 KL in the loss (β may be 0)", "no (group baseline)",
           True, False, default_beta=RL_PRESETS["grpo"].beta, default_reward="model", rl=True,
           variants=(("with verifier", {"reward": "verifier"}),
                     ("with verifier and β=0", {"reward": "verifier", "beta": 0.0}))),
    Method("dpo", "DPO family", "implicit: β·log(πθ/πref)", "the denominator of the loss", "—", False, True,
           variants=(("without precomputed reference log-probs", {"precompute_ref": False}),)),
    Method("rlvr", "RL with verifiable rewards", "verifier (math, code, format)", "weak or none (β → 0)",
           "optional", True, False, default_reward="verifier", rl=True,
           variants=(("with β>0", {"beta": 0.001}), ("with a value model", {"value_model": True}))),
    Method("agent", "agentic multi-turn RL", "environment state at episode end", "≈ none", "optional",
           True, False, default_reward="verifier", rl=True,
           variants=(("with β>0", {"beta": 0.001}), ("with a value model", {"value_model": True}))),
    Method("distill", "distillation (on-policy GKD, logit or sequence level)", "teacher distribution log p_T",
           "not needed", "—", True, False),
]}


def get(name: str) -> Method:
    if name not in METHODS:
        raise UserError(f"method: unknown method '{name}'; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def options(method: Method, beta: float | None = None, reward: str | None = None,
            precompute_ref: bool = True, value_model: bool | None = None, distill: str = "on_policy") -> Options:
    """Fill the method's defaults and check the choices (errors name the key)."""
    if beta is not None and beta < 0:
        raise UserError(f"beta: must be ≥ 0 (got {beta})")
    if reward is not None:
        if reward not in REWARD_CHOICES:
            raise UserError(f"reward: must be one of {', '.join(REWARD_CHOICES)} (got '{reward}')")
        if method.default_reward == "none":
            raise UserError(f"reward: method {method.name} has no reward source to choose")
    if value_model and not method.rl:
        raise UserError(f"value_model: method {method.name} has no value model")
    if value_model is False and method.name == "ppo":
        raise UserError("value_model: PPO always trains a value model (GAE); use method=grpo for none")
    if distill not in DISTILL_MODES:
        raise UserError(f"distill: must be one of {', '.join(DISTILL_MODES)} (got '{distill}')")
    return Options(
        beta=method.default_beta if beta is None else beta,
        reward=method.default_reward if reward is None else reward,
        precompute_ref=precompute_ref,
        value_model=(method.name == "ppo") if value_model is None else value_model,
        distill=distill,
    )


def roles(method: Method, opt: Options) -> list[Role]:
    """Models held in memory during a step, in the order the table prints them."""
    m = method.name
    if m == "sft":
        return [Role("policy", True)]
    if m == "rm":
        return [Role("reward", True)]
    if m == "dpo":
        return [Role("policy", True)] + ([] if opt.precompute_ref else [Role("reference", False)])
    if m == "distill":
        return [Role("policy", True), Role("teacher", False, "teacher")]
    out = [Role("policy", True)]
    if m != "rs":  # online RL: optional critic, reference when β > 0
        if opt.value_model:
            out.append(Role("value", True))
        if opt.beta > 0:
            out.append(Role("reference", False))
    if opt.reward == "model":
        out.append(Role("reward", False, "reward_model"))
    return out


def phases(method: Method, opt: Options) -> list[Phase]:
    """The passes of one step; FLOPs = Σ flops_per_param × params(role) × tokens(share)."""
    m = method.name
    if m in ("sft", "rm"):
        return [Phase("train", "reward" if m == "rm" else "policy", 6)]
    if m == "dpo":
        # The reference forward runs whether it happens during training or once beforehand.
        return [Phase("reference", "reference", 2), Phase("train", "policy", 6)]
    if m == "distill":
        return {
            "on_policy": [Phase("generate", "policy", 2), Phase("teacher", "teacher", 2), Phase("train", "policy", 6)],
            "logit": [Phase("teacher", "teacher", 2), Phase("train", "policy", 6)],
            "sequence": [Phase("generate", "teacher", 2), Phase("train", "policy", 6)],
        }[opt.distill]
    if m == "rs":
        out = [Phase("generate", "policy", 2)]
        if opt.reward == "model":
            out.append(Phase("reward", "reward", 2))
        return out + [Phase("train", "policy", 6, share="kept")]
    out = [Phase("generate", "policy", 2)]
    if opt.beta > 0:
        out.append(Phase("reference", "reference", 2))
    if opt.reward == "model":
        out.append(Phase("reward", "reward", 2))
    if opt.value_model:
        out.append(Phase("value", "value", 2))
    out.append(Phase("train", "policy", 6))
    if opt.value_model:
        out.append(Phase("value_train", "value", 6))
    return out


def models_in_memory(name: str, **overrides) -> int:
    method = get(name)
    return len(roles(method, options(method, **overrides)))


def method_table() -> list[dict]:
    """The method table (policy / reward / reference / value per method), computed from this registry (for
    `posttrain methods` and the docs)."""
    rows = []
    for method in METHODS.values():
        count = str(models_in_memory(method.name))
        extra = [f"{models_in_memory(method.name, **o)} {label}" for label, o in method.variants]
        if extra:
            count += f" ({', '.join(extra)})"
        rows.append({"method": method.name, "summary": method.summary, "reward comes from": method.reward_from,
                     "reference constrains by": method.reference, "value model": method.value,
                     "models in memory": count})
    return rows
