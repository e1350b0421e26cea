"""Everything before an RL run's first step, in the order a failure should surface: config and data,
environment or reward checked before any model loads; then the policy, the reference (β > 0 only),
the engine, optimizer, KL controller, PPO's critic; a resumed checkpoint; and last the rollout source,
chosen once (`make_rollout`), and the planner's prediction."""

from __future__ import annotations

import copy
import functools

import torch

from posttrain.agentic.episodes import AgentRun, setup_agent
from posttrain.algos import AdaptiveKLController, FixedKLController, policy_losses
from posttrain.algos import advantages as adv_registry
from posttrain.algos.entropy import AdaptiveEntropyCoef, FixedEntropyCoef
from posttrain.algos.pg_losses import vanishes_at_zero_advantage
from posttrain.algos.presets import rl_preset, uses_critic
from posttrain.data import formats
from posttrain.data.templates import check_template
from posttrain.eval.hook import EvalHook
from posttrain.models.device import resolve_device
from posttrain.models.forward import unwrap
from posttrain.models.loading import load_model, load_tokenizer
from posttrain.models.lora import AdapterOff, memory_savers
from posttrain.monitor.alarms import AlarmMonitor
from posttrain.plan import predict
from posttrain.plan.cpu import run_hardware
from posttrain.plan.measure import Measured, write_plan
from posttrain.recipes.rl import agentic, async_rl, ray_cluster
from posttrain.recipes.rl import phases as ph
from posttrain.recipes.rl import step as policy_gradient
from posttrain.recipes.rl.config import RLConfig
from posttrain.recipes.rl.drift import DriftProbe
from posttrain.recipes.rl.online_dpo import online_dpo_step
from posttrain.recipes.rl.ppo import Critic
from posttrain.recipes.rl.rollout import SyncRollout
from posttrain.recipes.rl.run import RLRun, Rollout
from posttrain.recipes.rl.sharded import ShardedRollout
from posttrain.rewards.build import build_reward
from posttrain.rollout.backends import build_backend
from posttrain.rollout.trajectory import Trajectory, make_batches
from posttrain.systems import fsdp
from posttrain.systems.dist import rank_device
from posttrain.training.curriculum import BandSampler, make_sampler, prompt_of, restore_sampler
from posttrain.training.lifecycle import RunLifecycle
from posttrain.training.memprobe import activation_fit
from posttrain.training.optim import build_optimizer
from posttrain.training.plan import memory_saver_keys
from posttrain.training.run import init_ranks, seed_everything


def step_function(cfg: RLConfig):
    """The step an algorithm runs: online DPO has its own, every other algorithm the policy-gradient step."""
    return online_dpo_step if cfg.algo == "online_dpo" else policy_gradient.rl_step


def setup(cfg: RLConfig) -> RLRun:
    """Everything before the first step: data and reward checked before any model loads."""
    info = init_ranks(refusals_under_torchrun(cfg), hint="PPO and the GRPO family are")
    life = RunLifecycle(cfg, info)
    seed_everything(cfg.seed)
    device = rank_device(resolve_device(cfg.device), info)
    tok = load_tokenizer(cfg.model, cfg.chat_template, cfg.chat_template_args)
    rows, _ = formats.load(cfg.data, allowed=("prompt_only", "prompt_completion"), seed=cfg.seed)
    check_template(tok, rows)
    agent = setup_agent(cfg, tok, rows) if cfg.env else None  # the environment's reward replaces `reward`
    reward_fn = None if agent is not None else reward_of(cfg, rows)
    eval_hook = EvalHook(cfg.eval, tok, recipe_reward=reward_fn, default_sampling=cfg.sampling)  # data checked now
    measured = Measured()  # RSS baseline before any model exists (the plan's peak counts the weights too)
    model = load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed).to(device)
    model.train()
    # π_ref (β > 0 only; β = 0 loads none): a frozen copy, or with LoRA the policy's base (adapter off)
    ref = frozen_copy(model) if cfg.needs_reference and not cfg.lora.enabled else None
    inner = policy_copy = None
    if info.world > 1:  # the engine samples from a full copy; the trainer's weights are sharded
        inner, policy_copy = model, frozen_copy(model)
        model = fsdp.shard_model(model)
    # PPO's critic: from the initial weights, before LoRA wraps the policy's modules (it trains in full)
    critic = Critic.build(cfg, policy_copy if policy_copy is not None else model, device, info) if uses_critic(rl_preset(cfg.algo)) else None
    model = memory_savers(model, cfg.lora, cfg.gradient_checkpointing)
    if cfg.needs_reference and cfg.lora.enabled:
        ref = AdapterOff(model)
    engine = make_engine(cfg, model if policy_copy is None else policy_copy, tok)
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    beta = cfg.resolved_beta
    kl_ctl = AdaptiveKLController(beta, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target and beta > 0 else FixedKLController(beta)
    sampler = make_sampler(cfg.curriculum, cfg.curriculum_args, [prompt_of(r.data) for r in rows], cfg.seed)
    run = RLRun(cfg, life, tok, rows, reward_fn, model, ref, engine, optimizer, scheduler, sampler,
                kl_ctl, advantage_fn(cfg, critic), None if cfg.algo == "online_dpo" else policy_losses.get(cfg.resolved_loss),
                cfg.resolved_agg,
                cfg.resolved_dynamic_sampling, cfg.resolved_tis_cap,
                device, info=info, critic=critic, measured=measured, eval_hook=eval_hook,
                alarms=AlarmMonitor(cfg.alarms, echo=None if info.main else lambda text: None,
                                    verifiers=verifier_weights(reward_fn)))
    run.curriculum = sampler if isinstance(sampler, BandSampler) else None
    run.inert_loss = run.loss_fn is not None and vanishes_at_zero_advantage(run.loss_fn, run.tis_cap, **cfg.loss_args)
    run.entropy_ctl = entropy_controller(cfg)
    if run.ref is None and info.world == 1 and cfg.kl_probe_every and cfg.algo != "online_dpo":
        run.drift = DriftProbe(cfg.kl_probe_every, cfg.kl_probe_size)
    state = life.restore(model, optimizer, scheduler, extras=run.checkpoint_extras())
    if state:
        restore_sampler(run.sampler, state["sampler"])
        kl_ctl.value = state.get("beta", kl_ctl.value)
        run.alarms.load(state.get("alarms", {}))
        if run.drift is not None:
            run.drift.load(state.get("drift", {}))
        if critic is not None:
            critic.load_state(state)
        run.entropy_ctl.load(state.get("entropy", {}))
    run.rollout = make_rollout(run, agent, inner, policy_copy, state)
    if state:
        run.rollout.sync_weights(run)
    if life.main:
        write_plan(life.out, plan_run(run, inner if inner is not None else model))
    run.metrics = life.metrics()
    life.fresh_file("samples.jsonl")
    return run


def advantage_fn(cfg: RLConfig, critic: Critic | None):
    """Outcome advantages from the registry; none for PPO (GAE from the critic) and online DPO (pairs)."""
    if critic is not None or cfg.algo == "online_dpo":
        return None
    fn = adv_registry.get(cfg.resolved_advantage)
    return functools.partial(fn, **cfg.advantage_args) if cfg.advantage_args else fn  # options checked in the config


def entropy_controller(cfg: RLConfig):
    """The entropy bonus's coefficient: fixed `entropy_coef`, or Skywork-OR1's adaptive control toward `entropy_target`."""
    if cfg.entropy_control == "adaptive":
        return AdaptiveEntropyCoef(cfg.entropy_coef, cfg.entropy_target, cfg.entropy_delta)
    return FixedEntropyCoef(cfg.entropy_coef)


def make_rollout(run: RLRun, agent: AgentRun | None, inner, policy_copy, state: dict) -> Rollout:
    """The run's one rollout source: the producer pipeline (async RL, or any Ray run), multi-turn episodes,
    ranks sharing generation under torchrun, or plain synchronous generation."""
    systems = run.cfg.systems
    if systems.pipelined:
        async_rl.prepare(run)
        source = ray_cluster.attach_ray(run) if systems.cluster == "ray" else async_rl.attach(run)
    elif agent is not None:
        source = agentic.AgentRollout(agent, run.life)
    elif run.info.world > 1:
        source = ShardedRollout(inner, policy_copy)
    else:
        source = SyncRollout()
    if state:
        source.load_state(state, run.life.start)
    return source


def make_engine(cfg: RLConfig, model: torch.nn.Module, tok):
    """The built-in engine over `model`'s weights (max_num_seqs B × G unless set); with the producer
    pipeline the rollout worker samples on its own copy and this engine serves evaluation only."""
    engine_cfg = cfg.engine.model_copy(update={
        k: v for k, v in {"max_num_seqs": min(256, cfg.prompts_per_step * cfg.group_size), "seed": cfg.seed,
                          "dtype": sampler_dtype(cfg, model)}.items()
        if k not in cfg.engine.model_fields_set})
    if cfg.systems.pipelined:
        return async_rl.TrainerEngine(model, tok, engine_cfg, cfg)
    return build_backend(cfg.backend, model, tok, engine_cfg, model_name=cfg.model, dtype=cfg.dtype,
                         echo=print if cfg.backend == "auto" else None)


def sampler_dtype(cfg: RLConfig, model: torch.nn.Module) -> str:
    """The built-in engine computes in the trainer's precision: under mixed_precision=bf16 a bf16 cast of the
    fp32 master weights (what autocast multiplies; TRL's generate runs under the same autocast), at half the
    bytes per decode step; otherwise the weights' own dtype. `engine.dtype=float32` keeps an fp32 sampler."""
    fp32 = next(model.parameters()).dtype == torch.float32
    return "bfloat16" if cfg.mixed_precision == "bf16" and fp32 else "auto"


def refusals_under_torchrun(cfg: RLConfig) -> list[tuple[bool, str]]:
    """What a sharded run cannot do yet."""
    return [(cfg.algo == "online_dpo", "algo=online_dpo"), (bool(cfg.env), "env= (multi-turn episodes)"),
            (cfg.systems.pipelined, "async_rl / cluster=ray"), (cfg.lora.enabled, "lora"),
            (bool(cfg.ref_reset_every), "ref_reset_every (the reference is an unsharded copy)")]


def reward_of(cfg: RLConfig, rows: list[formats.Row]):
    return build_reward(cfg.resolved_reward, cfg.reward_args, rows, cfg.sampling.max_new_tokens)  # + overlong (dapo)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the initial weights: the reference policy (π_ref = π_θ at step 0), or the plain
    copy a sharded run's engine samples from."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def plan_run(run: RLRun, model: torch.nn.Module) -> dict:
    """Planner prediction for the run; the rollout source says how many tokens a step holds (every sample
    runs to max_new_tokens; with an env, every episode to max_turns)."""
    cfg = run.cfg
    method = "ppo" if run.critic is not None else "grpo"
    extra = {"value_model": True} if method == "ppo" else {}
    inputs = run.rollout.plan_inputs(run)
    method = inputs.pop("method", method)
    probe = activation_probe(run, model) if run.info.world == 1 else None
    measured = {"activation_fixed_bytes": probe["fixed"], "activation_bytes_per_token": probe["per_token"]} if probe else {}
    return predict(unwrap(model), method, **extra, **inputs, **measured, batch=cfg.prompts_per_step, group=cfg.group_size,
                   beta=cfg.resolved_beta, reward="verifier", **memory_saver_keys(cfg), shared_prefix=True,
                   engine_bytes=getattr(run.engine, "memory_bytes", lambda: 0)(),
                   micro_batch=cfg.prompts_per_step * cfg.group_size, dtype="fp32" if cfg.dtype in ("float32", "fp32") else "bf16",
                   steps=max(cfg.max_steps, 1), logit_copies=0, **run_hardware(model, cfg.dtype, cfg.mixed_precision))


def activation_probe(run: RLRun, model: torch.nn.Module) -> dict | None:
    """Activation bytes of the policy's update forward/backward, measured (training.memprobe): one group of
    `group_size` synthetic samples, prompt and completions of equal length, through the trainer's own
    log-prob path (shared-prefix layout, chunked head, entropy); tokens are fixed ids, no RNG is drawn."""
    cfg, G = run.cfg, max(run.cfg.group_size, 1)
    vocab = unwrap(model).config.get_text_config().vocab_size

    def make_step(n: int):
        length = max(n // (G + 1), 2)
        ids = [(7 * j + 3) % vocab for j in range(length)]
        trajs = [Trajectory(ids, ids, torch.zeros(length), group=0) for _ in range(G)]
        batch = make_batches(trajs, run.tok.pad_token_id or 0, 1 << 30, device=run.device)[0]

        def step():
            logp, _ = ph.policy_logps(model, batch, cfg.sampling.temperature, cfg.mixed_precision, truncated=True,
                                      with_entropy=True)
            return (logp * batch.loss_mask).sum()
        return int(batch.input_ids.numel()), step

    return activation_fit(model, make_step)


def verifier_weights(reward_fn) -> dict[str, float]:
    """name -> weight of the reward's parts that check a ground truth (the alarms' trusted share)."""
    names = set(getattr(reward_fn, "verifiers", []))
    return {n: w for n, w in getattr(reward_fn, "parts", []) if n in names}
