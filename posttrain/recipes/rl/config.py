"""`posttrain rl`'s settings: every option with its default and help, and the checks that refuse a bad
combination before anything loads (the algorithm presets are in posttrain/algos/presets.py)."""

from __future__ import annotations

import inspect
from typing import Annotated

from pydantic import BeforeValidator, Field, model_validator

from posttrain.agentic.settings import AgentSettings
from posttrain.algos import advantages as adv_registry
from posttrain.algos import policy_losses, preference_losses
from posttrain.algos.aggregate import MODES as AGG_MODES
from posttrain.algos.kl import BETA_PRESETS, beta_value
from posttrain.algos.presets import RL_PRESETS, rl_preset, uses_critic
from posttrain.config import CommonConfig, Config, unused_key
from posttrain.eval.hook import EvalSettings
from posttrain.models.lora import LoraSettings
from posttrain.models.value import check_value_model
from posttrain.monitor.alarms import AlarmSettings
from posttrain.recipes.rl.options import check_rl_options
from posttrain.rollout.engine import EngineConfig
from posttrain.rollout.settings import SamplingSettings
from posttrain.training.curriculum import curriculum_args
from posttrain.training.optim import OptimSettings

BETA_NAMES = ", ".join(f"{k} {v:g}" for k, v in BETA_PRESETS.items())


class SystemsSettings(Config):
    async_rl: bool = Field(False, description="overlap rollout and training: a rollout thread (or Ray actor) feeds a bounded queue while the trainer updates")
    max_staleness: int = Field(1, ge=0, description="k: a sample drawn by policy version v is used at trainer step s only if s - v <= k (0 = on-policy, same samples as synchronous)")
    partial_rollouts: str = Field("finish", pattern="^(finish|drop)$",
                                  description="samples in flight when a newer policy is published: finish (under the version that started them; the new weights load when they are done) | drop (new weights load at once; those samples are discarded)")
    vllm_gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="backend=vllm: share of the GPU vLLM may take (the trainer shares the GPU)")
    queue_groups: int = Field(0, ge=0, description="bound of the rollout queue in groups (0 = (max_staleness + 2) x prompts_per_step)")
    cluster: str = Field("local", pattern="^(local|ray)$", description="local (one process) | ray (rollout, reward and trainer as Ray actors; pip install 'posttrain[ray]')")
    ray_address: str = Field("", description="cluster=ray: address of an existing Ray cluster ('' = start a local one with ray.init())")
    ray_num_cpus: int | None = Field(None, ge=1, description="cluster=ray, local cluster only: CPUs Ray may use (None = all)")
    trainer_cpus: float = Field(1.0, gt=0, description="cluster=ray: CPUs requested by the trainer actor")
    rollout_cpus: float = Field(0.5, gt=0, description="cluster=ray: CPUs requested by the rollout worker actor")
    reward_cpus: float = Field(0.5, gt=0, description="cluster=ray: CPUs requested by the reward worker actor")
    rollout_gpus: float = Field(0.0, ge=0, description="cluster=ray: GPUs requested by the rollout worker actor")

    @model_validator(mode="after")
    def _check(self):
        if self.cluster == "local" and self.ray_address:
            raise ValueError("systems.ray_address is set but cluster=local: add cluster=ray")
        return self

    @property
    def pipelined(self) -> bool:
        """Rollout through the producer pipeline (recipes/rl/async_rl.py): async RL, or any Ray run."""
        return self.async_rl or self.cluster == "ray"

    def queue_bound(self, prompts_per_step: int) -> int:
        return self.queue_groups or (self.max_staleness + 2) * prompts_per_step


def _critic(cfg) -> bool:
    return uses_critic(rl_preset(cfg.algo))


def _kl_penalty(cfg) -> bool:
    return cfg.algo != "online_dpo" and cfg.resolved_beta > 0


_PPO = (_critic, "algo=ppo (a value model and GAE)")
_ONLINE_DPO = (lambda cfg: cfg.algo == "online_dpo", "algo=online_dpo")
# keys only some runs read -> (whether this run reads it, which runs do): set away from its default where it is not
# read, a key is refused (posttrain.config.unused_key) instead of silently ignored
RUN_SPECIFIC_KEYS = {
    **dict.fromkeys(("value_model", "critic_lr", "critic_warmup", "vf_clip", "gamma", "lam", "whiten_advantages",
                     "bootstrap_truncated"), _PPO),
    **dict.fromkeys(("pref_loss", "pref_args", "ref_update_every"), _ONLINE_DPO),
    **dict.fromkeys(("kl_target", "kl_horizon"), (_kl_penalty, "a run with a KL penalty (beta > 0, not online_dpo)")),
}


class RLConfig(CommonConfig):
    """posttrain rl: online RL (PPO with a value model, the GRPO family, online DPO) with verifiable or learned rewards."""

    algo: str = Field("grpo", description=f"one of {', '.join(RL_PRESETS)} (presets: posttrain/algos/presets.py)")
    reward: str = Field("math", description="reward or weighted composition: 'math:1.0,format:0.2', 'my.py:fn:0.1'")
    reward_args: dict = Field(default_factory=dict, description="options per reward, e.g. {overlong: {max_len: 512, cache_len: 128}}")
    data: str = Field("arithmetic", description="prompt-only dataset (`prompt` + reward columns such as `answer`)")
    env: str = Field("", description="multi-turn environment (calculator, python_code, search_qa or path/to/file.py:Class); its reward replaces `reward` (docs/agentic.md)")
    env_args: dict = Field(default_factory=dict, description="keyword arguments of the environment class")
    agent: AgentSettings = Field(default_factory=AgentSettings, description="multi-turn rollout limits and tool format (with env)")
    output_dir: str = Field("runs/rl", description="run directory")
    max_steps: int = Field(20, ge=0, description="optimizer steps")
    dtype: str = Field("float32", description="weights dtype (the engine samples in it)")
    prompts_per_step: int = Field(8, ge=1, description="prompts per step (B)")
    group_size: int = Field(8, ge=1, description="samples per prompt (G); 1 only without a group baseline (algo=ppo, reinforce_pp)")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(kv_cache_mb=512),
                                 description="built-in engine (max_num_seqs defaults to B × G)")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="train a LoRA adapter on the policy; π_ref is the base (adapter off), the engine samples the adapted weights")
    beta: Annotated[float | None, BeforeValidator(beta_value)] = Field(
        None, ge=0, description=f"KL coefficient: a number or a paper's value by name ({BETA_NAMES}); None = the algo's preset; 0 loads no reference")
    kl_estimator: str = Field("k3", pattern="^(k1|k2|k3)$", description="KL in the loss: k3 (GRPO) | k2; k1 has zero expected gradient there")
    kl_target: float | None = Field(None, gt=0, description="adaptive β toward this KL per sequence (nats; Ziegler et al. 2019); None = fixed β")
    kl_horizon: int = Field(10000, ge=1, description="adaptive KL controller horizon (samples)")
    advantage: str | None = Field(None, description="override the algo's advantage estimator (registry name)")
    loss: str | None = Field(None, description="override the algo's policy loss (registry name)")
    loss_agg: str | None = Field(None, description="token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (default: the algo's)")
    loss_args: dict = Field(default_factory=dict, description="extra keyword arguments of the policy loss, e.g. {eps_high: 0.28}")
    advantage_args: dict = Field(default_factory=dict, description="keyword arguments of the advantage estimator, checked against it: "
                                 "{std_scale: batch} (grpo: group|batch|none), {pass_threshold: 0.5}, {whiten: sequence} "
                                 "(reinforce_pp: token|sequence), {weight: maxent, lam: 1.0} (learnability)")
    overlong_shaping: bool | None = Field(None, description="add DAPO's soft overlong punishment to the reward (Lmax = max_new_tokens, "
                                          "Lcache = Lmax / 5; reward_args={overlong: {...}} changes them); None = the algo's (dapo: on)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus: loss − c·H per loss token (H of the temperature-only distribution; 0 = off)")
    entropy_control: str = Field("none", pattern="^(none|adaptive)$", description="adaptive: Skywork-OR1's adaptive entropy control, "
                                 "c += entropy_delta when the step's entropy < entropy_target, −= when above (c >= 0, starts at entropy_coef); "
                                 "the bonus acts only while entropy <= target")
    entropy_target: float = Field(0.2, gt=0, description="entropy_control=adaptive: target entropy (nats per token; Skywork-OR1: 0.2)")
    entropy_delta: float = Field(0.005, gt=0, description="entropy_control=adaptive: step of the coefficient per optimizer step (Skywork-OR1: 0.005)")
    ref_reset_every: int = Field(0, ge=0, description="grpo family / ppo: reference <- current policy every N steps (ProRL's reference reset; "
                                 "0 = frozen reference); needs beta > 0")
    ref_reset_optimizer: bool = Field(False, description="with ref_reset_every: also clear the policy optimizer's state (AdamW moments) at each reset")
    tis_cap: float | None = Field(None, ge=0, description="truncated importance sampling cap on π_old/μ; None = 2.0 when trainer and sampler differ in precision, else off; 0 = off")
    dynamic_sampling: bool | None = Field(None, description="drop groups whose rewards are all equal and refill (default: the algo's)")
    max_resample: int = Field(3, ge=0, description="extra generation rounds to refill after dynamic sampling")
    curriculum: str = Field("none", pattern="^(none|band)$",
                            description="none (the data order, unchanged) | band: track each prompt's pass rate and draw prompts outside low < p < high less often (docs/rl.md)")
    curriculum_args: dict = Field(default_factory=dict, description="curriculum=band: {low: 0.2, high: 0.8, pass_threshold: 0.5, floor: 0.1, rate: 0.5} (posttrain/training/curriculum.py)")
    mask_truncated: bool = Field(False, description="leave samples cut at max_new_tokens out of the loss")
    ppo_epochs: int | None = Field(None, ge=1, description="passes over each batch of samples (None = the algo's preset: 2 for ppo, else 1 = strictly on-policy)")
    ppo_minibatches: int | None = Field(None, ge=1, description="optimizer steps per pass, the batch split in whole micro-batches (None = the preset: 2 for ppo, else 1)")
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: GAE discount γ")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE λ")
    value_model: str = Field("", description="PPO: '' = a copy of the policy with a zero scalar head; or a reward model folder (AutoModelForSequenceClassification)")
    critic_lr: float | None = Field(None, gt=0, description="PPO: value model learning rate (None = 10 × optim.lr)")
    critic_warmup: int = Field(0, ge=0, description="PPO: first steps train only the value model")
    vf_clip: float | None = Field(0.2, ge=0, description="PPO: value clipping range around the old values (None = unclipped)")
    pref_loss: str = Field("dpo", description="online_dpo: preference loss (registry posttrain.algos.preference_losses); `loss=ipo` says the same")
    pref_args: dict = Field(default_factory=dict, description="online_dpo: arguments of the preference loss, e.g. {beta: 0.1}")
    ref_update_every: int = Field(0, ge=0, description="online_dpo: copy the policy into the reference every N steps (0 = frozen)")
    whiten_advantages: bool = Field(True, description="PPO: normalise GAE advantages over the step's tokens")
    bootstrap_truncated: bool = Field(False, description="PPO: a sample cut at max_new_tokens continues from V after its last token (time-limit view) instead of ending there")
    kl_probe_every: int = Field(5, ge=0, description="β = 0: measure KL to the start policy on a fixed probe set every N steps "
                                "(logged as kl_start, kl_start/seq; 0 = off); see recipes/rl/drift.py")
    kl_probe_size: int = Field(16, ge=1, description="β = 0: samples of the first step kept as the KL-to-start probe set")
    micro_batch_tokens: int = Field(4096, ge=64, description="tokens per forward/backward (whole groups; the prompt counted once)")
    zero_advantage: str = Field("forward", pattern="^(forward|skip|train)$",
                                description="groups whose every sample has advantage 0 (their loss has no gradient when β = 0 "
                                "and no entropy bonus): forward = no-grad forward for the logged metrics, no backward (same update "
                                "and metrics, faster) | skip = not computed (metrics over the trained groups) | train = "
                                "backward as any group (docs/rl.md)")
    optim: OptimSettings = Field(default_factory=lambda: OptimSettings(lr=1e-6, warmup_ratio=0.0))
    alarms: AlarmSettings = Field(default_factory=AlarmSettings, description="health alarms (docs/alarms.md)")
    eval: EvalSettings = Field(default_factory=EvalSettings, description="held-out evaluation every eval.every steps (docs/eval.md)")
    systems: SystemsSettings = Field(default_factory=SystemsSettings, description="async RL, Ray placement (docs/scale.md)")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    samples_per_log: int = Field(2, ge=0, description="completions written to samples.jsonl each step")
    progress: bool = Field(True, description="show a progress bar")

    @model_validator(mode="before")
    @classmethod
    def _loss_names_the_preference_loss(cls, data):
        """algo=online_dpo: `loss=ipo` names the preference loss (as the issue tracker and TRL users write it)."""
        if isinstance(data, dict) and data.get("algo") == "online_dpo" and data.get("loss"):
            data = {**data, "pref_loss": data["loss"], "loss": None}
        return data

    @model_validator(mode="after")
    def _check_algorithm(self):
        preset = rl_preset(self.algo)
        if self.algo == "online_dpo":
            given = [k for k in ("advantage", "loss_agg", "loss_args", "advantage_args") if getattr(self, k)]
            if given:
                raise ValueError(f"{', '.join(given)}: not used by algo=online_dpo (it takes pref_loss and pref_args)")
            accepted = _keyword_args(preference_losses.get(self.pref_loss)) - {
                "policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps",
                "chosen_lengths", "rejected_lengths"}
            unknown = sorted(set(self.pref_args) - accepted)
            if unknown:
                raise ValueError(f"pref_args {unknown} are not arguments of preference loss '{self.pref_loss}' (it takes {sorted(accepted)})")
        else:
            accepted = _keyword_args(policy_losses.get(self.resolved_loss))
            unknown = sorted(set(self.loss_args) - accepted)
            if unknown:
                raise ValueError(f"loss_args {unknown} are not arguments of policy loss '{self.resolved_loss}' (it takes {sorted(accepted)})")
            adv_registry.get(self.resolved_advantage)
        check_rl_options(self)
        if self.kl_estimator == "k1" and self.resolved_beta > 0 and not uses_critic(preset):
            raise ValueError("kl_estimator=k1 in the loss has zero expected gradient on-policy (E_π[∇ log π] = 0): "
                             "use k3 (GRPO) or k2, or beta=0")
        if self.sampling.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 for RL (greedy samples have no log-prob to optimise)")
        if self.env and self.systems.pipelined:
            raise ValueError("env= (multi-turn episodes) runs synchronously for now: drop async_rl / cluster=ray")
        if self.lora.enabled and self.ref_update_every:
            raise ValueError("lora with ref_update_every: the LoRA reference is the base model (adapter off) and does not move")
        if self.lora.enabled and self.systems.pipelined:
            raise ValueError("lora with async_rl / cluster=ray: the rollout worker's copy takes full weights; train without lora or synchronously")
        return self

    @model_validator(mode="after")
    def _check_group_size(self):
        """One sample per prompt is PPO's and REINFORCE++'s setting (a critic or the batch is the baseline); a
        group baseline (GRPO, RLOO, ...) or online DPO's pairs need two or more."""
        if self.group_size == 1 and not uses_critic(rl_preset(self.algo)) and (
                self.algo == "online_dpo" or self.resolved_advantage != "reinforce_pp"):
            what = "online DPO pairs two samples of each prompt" if self.algo == "online_dpo" else (
                f"algo={self.algo}'s advantage '{self.resolved_advantage}' compares the samples of one prompt")
            raise ValueError(f"group_size=1: {what}; give group_size >= 2, or use algo=ppo or algo=reinforce_pp "
                             "for one sample per prompt")
        return self

    @model_validator(mode="after")
    def _check_unused(self):
        refused = unused_key(self, RUN_SPECIFIC_KEYS)
        if refused:
            raise ValueError(refused)
        if self.loss_agg is not None and self.loss_agg not in AGG_MODES:  # else found only after the first generation
            raise ValueError(f"loss_agg={self.loss_agg}: unknown aggregation (one of {', '.join(AGG_MODES)})")
        if self.value_model:
            check_value_model(self.value_model)
        return self

    @model_validator(mode="after")
    def _check_curriculum(self):
        if self.curriculum == "none":
            if self.curriculum_args:
                raise ValueError("curriculum_args is set but curriculum=none: add curriculum=band")
            return self
        curriculum_args(self.curriculum_args)  # bad keys, bounds
        if self.systems.pipelined:
            raise ValueError("curriculum=band with async_rl / cluster=ray: the producer draws prompts ahead of the "
                             "rewards the band needs; drop async_rl / cluster=ray or use curriculum=none")
        return self

    @property
    def needs_reference(self) -> bool:
        if self.algo == "online_dpo":
            return bool(preference_losses.meta(self.pref_loss).get("reference", True))
        return self.resolved_beta > 0

    @property
    def epochs(self) -> int:
        return rl_preset(self.algo).epochs if self.ppo_epochs is None else self.ppo_epochs

    @property
    def minibatches(self) -> int:
        return rl_preset(self.algo).minibatches if self.ppo_minibatches is None else self.ppo_minibatches

    @property
    def resolved_beta(self) -> float:
        """β: the config's, else the algorithm's preset (the one place β is derived from the config)."""
        return rl_preset(self.algo).beta if self.beta is None else self.beta

    @property
    def resolved_advantage(self) -> str | None:
        return self.advantage or rl_preset(self.algo).advantage

    @property
    def resolved_loss(self) -> str:
        """The policy loss's registry name; online DPO: the preference loss's."""
        return self.pref_loss if self.algo == "online_dpo" else self.loss or rl_preset(self.algo).loss

    @property
    def resolved_agg(self) -> str | None:
        return self.loss_agg or rl_preset(self.algo).agg

    @property
    def resolved_overlong(self) -> bool:
        """DAPO's overlong shaping: the config's, else the preset's; never with env= (the environment scores)."""
        on = rl_preset(self.algo).overlong if self.overlong_shaping is None else self.overlong_shaping
        return on and not self.env

    @property
    def resolved_reward(self) -> str:
        """The reward spec the run composes: `reward`, plus `overlong` when the shaping is on and not already named."""
        if self.resolved_overlong and "overlong" not in [p.strip().split(":")[0] for p in self.reward.split(",")]:
            return f"{self.reward},overlong"
        return self.reward

    @property
    def resolved_dynamic_sampling(self) -> bool:
        return rl_preset(self.algo).dynamic_sampling if self.dynamic_sampling is None else self.dynamic_sampling

    @property
    def resolved_tis_cap(self) -> float | None:
        """TIS (Yao et al. 2025) is on whenever the trainer computes in another precision than the sampler
        (the producer pipeline raises an unset cap to async_rl.ASYNC_TIS_CAP)."""
        if self.tis_cap is not None:
            return self.tis_cap or None
        return 2.0 if self.mixed_precision != "none" else None


def _keyword_args(fn) -> set[str]:
    skip = {"logp", "old_logp", "advantages", "mask", "behaviour_logp", "tis_cap"}
    return {n for n, p in inspect.signature(fn).parameters.items()
            if n not in skip and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
