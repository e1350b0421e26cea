"""`predict(...)`: one plan as a dict — the same object `posttrain plan --json` prints.

    from posttrain.plan import predict
    p = predict("llama-3-8b", "grpo", batch=256, group=16, seq_len=2000, hardware="h100")
    p["memory_bytes_total"], p["flops_per_step"], p["seconds_per_step"]

`model` (and `reward_model`, `teacher`) may be a name, an HF folder, a cached Hub id, a parameter count (8e9,
"8B"), a config dict, a transformers config object or the model itself (plan/resolve.py). A bare count gives
memory and FLOPs but no KV, LoRA or activations.

A plan never stops a run: what cannot be predicted is None, named with its reason in `unknown`, and how
things were counted where not exactly is said in `notes` (one warning line on stderr from `predict`).
Only input that is wrong — an unknown key or value, a model that names nothing — raises UserError.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from pydantic import ValidationError

from posttrain.errors import UserError
from posttrain.plan import arch as archmod
from posttrain.plan import cost, cpu, methods, timing
from posttrain.plan.config import PlanConfig
from posttrain.plan.resolve import ModelSpec, resolve_model

__all__ = ["ModelSpec", "predict", "predict_config", "resolve_model"]

ALL_LINEAR = ("all-linear", "all_linear", "all")


def predict(model: Any = "tiny-random", method: str = "sft", **keys) -> dict:
    """The plan of `method` on `model`; keys are those of `PlanConfig` (see `posttrain plan --help`).
    Raises UserError for wrong input only; a prediction that fails for any other reason comes back as a
    plan whose `notes` say why (and one warning line on stderr), so a recipe that plans its run goes on."""
    specs = {"model": model, **{k: keys.pop(k) for k in ("reward_model", "teacher") if k in keys}}
    as_text = {k: v for k, v in specs.items() if isinstance(v, (str, int, float)) or v is None}
    try:
        cfg = PlanConfig(method=method, **as_text, **keys)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "config"
        raise UserError(f"{where}: {err['msg']} (got {err.get('input')!r})") from None
    objects = {k: v for k, v in specs.items() if k not in as_text}
    try:
        plan = predict_config(cfg, **objects)
    except UserError:
        raise
    except Exception as e:  # a planner bug or an input it cannot digest must not stop the run that asked
        plan = failed_plan(cfg, e, _name_of(objects.get("model"), cfg.model))
    if plan["notes"]:
        print(f"posttrain plan: warning: {'; '.join(plan['notes'])}", file=sys.stderr)
    return plan


def _name_of(given: Any, default: str) -> str:
    """A model object's or config's name_or_path, else its class name; `default` when nothing was given."""
    if given is None:
        return default
    config = getattr(given, "config", given)
    return str(getattr(config, "name_or_path", "") or type(given).__name__)


def failed_plan(cfg: PlanConfig, error: BaseException, name: str | None = None) -> dict:
    """The plan of a prediction that raised: every number None but the step's shape, the reason in `notes` and `unknown`."""
    why = f"prediction failed: {type(error).__name__}: {' '.join(str(error).split())[:300]}"
    out: dict[str, Any] = {"model": {"name": name or cfg.model, "source": None, "architecture": None}, "method": cfg.method,
                           "models": [], "phases": [], "lora": None, "gradient_checkpointing": cfg.gradient_checkpointing,
                           "notes": [why], "unknown": {"*": why}}
    for key in ("params", "active_params", "trainable_params", "models_in_memory", "memory_bytes_total", "kv_bytes_per_token",
                "kv_bytes_step", "activation_bytes", "peak_bytes_estimate", "tokens_per_step", "flops_per_token",
                "flops_per_step", "seconds_per_step", "hardware", "run"):
        out[key] = None
    try:  # the shape of a step needs no model: keep it when it can be had
        method = methods.get(cfg.method)
        opt = methods.options(method, beta=cfg.beta, reward=cfg.reward, precompute_ref=cfg.precompute_ref,
                              value_model=cfg.value_model, distill=cfg.distill)
        group, _, tokens_per_seq, generated_per_seq = _step_shape(cfg, method, opt)
        sequences = cfg.batch * group * (2 if method.pairwise else 1)
        out.update(group=group, sequences_per_step=sequences, tokens_per_step=sequences * tokens_per_seq,
                   generated_tokens_per_step=sequences * generated_per_seq)
    except Exception:  # the plan already says the prediction failed
        pass
    return out


def _targets(text: str) -> tuple[str, ...] | None:
    """The LoRA target names, or None for all-linear (every nn.Linear but lm_head)."""
    if text.strip() in ALL_LINEAR:
        return None
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    if not targets:
        raise UserError("lora_targets: empty; use all-linear or a comma list such as q_proj,v_proj")
    return targets


def _total(values) -> float | None:
    """Sum, or None when any part is unknown."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def predict_config(cfg: PlanConfig, **objects) -> dict:
    """The plan for a validated config. `objects` may hold config objects or models for model / reward_model / teacher."""
    method = methods.get(cfg.method)
    opt = methods.options(method, beta=cfg.beta, reward=cfg.reward, precompute_ref=cfg.precompute_ref,
                          value_model=cfg.value_model, distill=cfg.distill)
    policy, sizes = _sizes(cfg, method, objects)
    notes = list(dict.fromkeys(n for s in {id(s): s for s in sizes.values()}.values() for n in s.notes))
    unknown: dict[str, str] = {}

    # ---- precision
    infer_bytes = cfg.infer_bytes_per_param or cost.dtype_bytes(cfg.dtype)
    act_bytes = cost.dtype_bytes(cfg.dtype)
    kv_value_bytes = cost.dtype_bytes(cfg.kv_dtype or cfg.dtype, "kv_dtype")

    # ---- shape of a step
    group, agent, tokens_per_seq, generated_per_seq = _step_shape(cfg, method, opt)
    sequences = cfg.batch * group * (2 if method.pairwise else 1)  # DPO/RM: chosen + rejected
    tokens_per_step = sequences * tokens_per_seq
    generated_per_step = sequences * generated_per_seq

    # ---- LoRA, models in memory, FLOPs of each phase
    lora = _lora(cfg, policy, notes)
    models = _models_in_memory(cfg, method, opt, sizes, lora, infer_bytes)
    by_role = {m["role"]: m for m in models}
    memory_total = _total(m["bytes"] for m in models)
    phases = _phases(method, opt, by_role, policy, group, tokens_per_step, cfg.gradient_checkpointing)
    flops_per_step = _total(p["flops_per_step"] for p in phases)
    flops_per_token = flops_per_step / tokens_per_step if flops_per_step is not None else None

    # ---- KV cache of the generating model, activations of the trained one, the peak
    memory = _transients(cfg, method, policy, sizes, phases, models, lora, sequences, tokens_per_seq,
                         act_bytes, kv_value_bytes)
    peak = memory_total + memory.pop("transient") + cfg.engine_bytes if memory_total is not None else None
    trained = by_role.get("policy", by_role.get("reward", {}))
    out: dict[str, Any] = {
        "model": {"name": policy.name, "source": policy.source, "architecture": policy.arch.to_dict() if policy.arch else None},
        "method": method.name,
        "options": {"beta": opt.beta if method.rl else None, "reward": None if opt.reward == "none" else opt.reward,
                    "precompute_ref": opt.precompute_ref if method.name == "dpo" else None,
                    "value_model": opt.value_model, "distill": opt.distill if method.name == "distill" else None},
        "params": policy.params,
        "active_params": policy.compute_params,
        "trainable_params": trained.get("trainable", 0),
        "lora": lora,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "models": models,
        "models_in_memory": len(models),
        "memory_bytes_total": memory_total,
        "engine_bytes": cfg.engine_bytes,
        **memory,
        "peak_bytes_estimate": peak,
        "group": group,
        "sequences_per_step": sequences,
        "tokens_per_step": tokens_per_step,
        "generated_tokens_per_step": generated_per_step,
        "flops_per_token": flops_per_token,
        "flops_per_token_over_params": flops_per_token / policy.compute_params
        if flops_per_token is not None and policy.compute_params else None,
        "flops_per_step": flops_per_step,
        "phases": phases,
    }
    if agent is not None:
        agent["flops_per_useful_token"] = flops_per_step / generated_per_step if flops_per_step is not None else None
        out["agent"] = agent
    if method.name == "distill":
        out["distill"] = _distill(cfg, opt.distill, sizes["teacher"])
    if method.name == "rs":
        out["bon_kl_nats"] = cost.bon_kl(group)
    shape = _time_shape(cfg, method, sizes, phases, sequences, tokens_per_seq, generated_per_seq, infer_bytes, kv_value_bytes)
    _add_hardware(out, cfg, flops_per_step, flops_per_token, memory_total, notes, shape)
    if cfg.eval_n:
        out["eval"] = {"n": cfg.eval_n, "p": cfg.eval_p, "ci95_half_width": cost.ci95_half_width(cfg.eval_p, cfg.eval_n)}
    _name_unknowns(out, policy, unknown)
    out["notes"], out["unknown"] = notes, unknown
    return out


def _name_unknowns(out: dict, policy: ModelSpec, unknown: dict[str, str]) -> None:
    """`unknown`: every top-level number left None, with the reason."""
    no_arch = "no architecture: the model is a bare parameter count or its config could not be read"
    for key in ("params", "memory_bytes_total", "peak_bytes_estimate", "flops_per_token", "flops_per_step",
                "kv_bytes_per_token", "activation_bytes", "seconds_per_step"):
        if out.get(key) is not None or key in unknown:
            continue
        if key in ("kv_bytes_per_token", "activation_bytes"):
            unknown[key] = no_arch
        elif key == "seconds_per_step" and out.get("flops_per_step") is not None:
            unknown[key] = "no hardware: give hardware=h100|cpu|... or peak_flops"
        elif policy.params is None:
            unknown[key] = "the model's parameters were not counted (see notes)"
        else:
            unknown[key] = "a model's parameters or the adapter's size were not counted (see notes)"
    if out.get("kv_bytes_step") is None and out.get("generated_tokens_per_step") and policy.arch is None:
        unknown["kv_bytes_step"] = no_arch


def _lora(cfg: PlanConfig, policy: ModelSpec, notes: list[str]) -> dict | None:
    """The adapter: r·(in + out) on every targeted nn.Linear (all-linear: all but lm_head), as PEFT builds it."""
    if not cfg.lora_r:
        _targets(cfg.lora_targets)  # still refuse an empty list
        return None
    targets = _targets(cfg.lora_targets)
    if policy.arch is None and policy.linears is None and policy.source == "parameter count":
        raise UserError("lora_r: LoRA size needs an architecture (a folder or known name), not a bare parameter count")
    linears = policy.linears if policy.linears is not None else (policy.arch.linears() if policy.arch else None)
    entry = {"r": cfg.lora_r, "targets": list(targets) if targets else "all-linear", "modules": None, "params": None,
             "fraction_of_base": None}
    if linears is None:
        notes.append(f"lora: the linear layers of {policy.name} are not known: the adapter's size is not predicted")
        return entry
    params, missing = archmod.lora_params(linears, cfg.lora_r, targets)
    names = list(dict.fromkeys(p.rsplit(".", 1)[-1] for p, _, _ in linears))
    if targets and len(missing) == len(targets):
        fused = " (phi3-style models fuse q/k/v into qkv_proj and gate/up into gate_up_proj)" \
            if policy.arch is not None and policy.arch.fused else ""
        raise UserError(f"lora_targets: {', '.join(missing)} match no linear layer of {policy.name}{fused}; "
                        f"choose from {', '.join(names)} or all-linear")
    if missing:
        notes.append(f"lora_targets: {', '.join(missing)} match no linear layer of {policy.name} (ignored, as PEFT does)")
    if policy.arch is not None and policy.arch.moe is not None:
        notes.append(f"lora on a mixture of experts ({policy.name}): counted on its nn.Linear layers; the experts are 3-D "
                     "parameters, not linear layers (PEFT's MoE conversion may adapt them and the router as well)")
    chosen = [p for p, _, _ in linears if targets is None or any(p == t or p.endswith("." + t) for t in targets)]
    entry.update(modules=len(chosen), params=params, fraction_of_base=params / policy.params if policy.params else None,
                 target_names=list(dict.fromkeys(p.rsplit(".", 1)[-1] for p in chosen)))
    return entry


def _sizes(cfg: PlanConfig, method: methods.Method, objects: dict) -> tuple[ModelSpec, dict[str, ModelSpec]]:
    """The policy and the model behind each size a role may name (reward model and teacher default to the policy)."""
    policy = resolve_model(objects.get("model", cfg.model), "model")
    sizes = {
        "model": policy,
        "reward_model": resolve_model(objects.get("reward_model", cfg.reward_model), "reward_model")
        if (cfg.reward_model is not None or "reward_model" in objects) else policy,
        "teacher": resolve_model(objects.get("teacher", cfg.teacher), "teacher")
        if (cfg.teacher is not None or "teacher" in objects) else policy,
    }
    if method.name != "distill" and (cfg.teacher is not None or "teacher" in objects):
        raise UserError(f"teacher: only method=distill has a teacher (method is {method.name})")
    return policy, sizes


def _step_shape(cfg: PlanConfig, method: methods.Method, opt: methods.Options) -> tuple[int, dict | None, int, int]:
    """(group, agent trajectory or None, tokens per sequence, generated tokens per sequence)."""
    if cfg.group is not None and not method.generates:
        raise UserError(f"group: method {method.name} does not sample (group applies to rs, ppo, grpo, rlvr, agent, distill)")
    if method.name == "distill" and opt.distill != "on_policy" and cfg.group is not None:
        raise UserError(f"group: distill={opt.distill} does not sample from the student")
    if method.name != "agent" and (cfg.turns != 1 or cfg.return_len != 0):
        raise UserError(f"turns: only method=agent has turns and return_len (method is {method.name})")
    group = cfg.group or (8 if method.name in ("grpo", "rlvr", "agent", "rs") else 1)
    agent = None
    if method.name == "agent":
        agent = cost.agent_trajectory(cfg.turns, cfg.seq_len, cfg.return_len, cfg.prompt_len)
        tokens_per_seq, generated_per_seq = agent["context_tokens"], agent["generated_tokens"]
    elif method.generates and not (method.name == "distill" and opt.distill == "logit"):
        tokens_per_seq, generated_per_seq = cfg.prompt_len + cfg.seq_len, cfg.seq_len
    else:  # training on given sequences: nothing generated during the step
        if cfg.prompt_len:
            raise UserError(f"prompt_len: method {method.name} trains on given sequences; put the whole length in seq_len")
        tokens_per_seq, generated_per_seq = cfg.seq_len, 0
    return group, agent, tokens_per_seq, generated_per_seq


def _models_in_memory(cfg: PlanConfig, method: methods.Method, opt: methods.Options, sizes: dict[str, ModelSpec],
                      lora: dict | None, infer_bytes: float) -> list[dict]:
    """One entry per model the method holds: its role, parameters (all, and active per token), trainable
    parameters and bytes (None where the parameters or the adapter are not known)."""
    models = []
    adapter_params = lora["params"] if lora else 0
    for role in methods.roles(method, opt):
        spec = sizes[role.size]
        n, active = spec.params, spec.compute_params
        entry = {"role": role.role, "name": spec.name, "params": n, "active_params": active, "trainable": 0, "bytes": 0.0}
        adapter = adapter_params if (role.trainable and role.size == "model") else 0
        if n is None or adapter is None:
            entry.update(params=n, trainable=None, bytes=None)
        elif role.trainable:
            entry["params"], entry["active_params"] = n + adapter, active + adapter
            entry["trainable"] = adapter or n
            entry["bytes"] = cost.model_bytes(entry["params"], entry["trainable"], cfg.train_bytes_per_param, infer_bytes)
        elif role.role == "reference" and lora:
            entry["shared_with"] = "policy"  # the base with the adapter disabled: no extra memory
        else:
            entry["bytes"] = cost.model_bytes(n, 0, infer_bytes=infer_bytes)
        models.append(entry)
    return models


def _phases(method: methods.Method, opt: methods.Options, by_role: dict[str, dict], policy: ModelSpec, group: int,
            tokens_per_step: int, checkpointing: bool = False) -> list[dict]:
    """FLOPs of each phase of a step: flops/param × active params of its model × tokens it touches. A training
    pass is 6 (forward 2 + backward 4; LoRA 4 + 2·trainable share), +2 with gradient checkpointing."""
    phases = []
    for ph in methods.phases(method, opt):
        # The model in memory (a policy with its adapter) or, for a precomputed DPO reference, the base.
        role = by_role.get(ph.role)
        n = role["active_params"] if role is not None else policy.compute_params
        per_param = ph.flops_per_param
        if ph.flops_per_param == 6 and role is not None:
            trainable, params = role["trainable"], role["params"]
            fraction = 1.0 if trainable is None or params is None or trainable >= params else trainable / n
            per_param = cost.train_flops_per_param(fraction, checkpointing)
        share = 1.0 / group if ph.share == "kept" else 1.0
        per_token = per_param * n * share if n is not None else None
        phases.append({"phase": ph.name, "role": ph.role, "flops_per_param": per_param, "flops_per_token": per_token,
                       "flops_per_step": per_token * tokens_per_step if per_token is not None else None})
    return phases


def _trained_tokens(cfg: PlanConfig, micro: int, tokens_per_seq: int) -> int:
    """Tokens of a micro-batch's forward: with a shared prefix each group's prompt runs once, (G − 1)·P fewer per group."""
    if cfg.shared_prefix and cfg.group > 1 and cfg.prompt_len:
        groups = max(micro // cfg.group, 1)
        return micro * tokens_per_seq - groups * (cfg.group - 1) * cfg.prompt_len
    return micro * tokens_per_seq


def _transients(cfg: PlanConfig, method: methods.Method, policy: ModelSpec, sizes: dict, phases: list[dict],
                models: list[dict], lora: dict | None, sequences: int, tokens_per_seq: int,
                act_bytes: float, kv_value_bytes: float) -> dict:
    """KV per token and for the step (sliding layers capped at their window), activations of a micro-batch
    (with or without gradient checkpointing), and the largest transient on top of the model states."""
    kv_per_token = kv_step = activations = None
    gen_phase = next((p for p in phases if p["phase"] == "generate"), None)
    if gen_phase is not None:
        gen_arch = sizes["teacher" if gen_phase["role"] == "teacher" else "model"].arch
        if gen_arch is not None:
            kv_step = sequences * gen_arch.kv_bytes_per_sequence(tokens_per_seq, kv_value_bytes)
    # Default micro-batch: every trained sequence of the step in one forward/backward (no accumulation).
    micro = cfg.micro_batch or (sequences if method.name != "rs" else cfg.batch)
    a = policy.arch
    if a is not None:
        kv_per_token = a.kv_bytes_per_token(kv_value_bytes)
        mean, largest = a.activation_values_per_token()
        activations = cost.activation_bytes(_trained_tokens(cfg, micro, tokens_per_seq), a.layers, a.hidden, a.intermediate,
                                            a.kv_heads * a.head_dim, a.vocab, act_bytes, cfg.logit_copies,
                                            checkpointing=cfg.gradient_checkpointing, layer_values=mean, layer_max=largest)
    if cfg.activation_bytes_per_token is not None:  # measured on the model itself (training.memprobe)
        activations = (cfg.activation_fixed_bytes or 0.0) + cfg.activation_bytes_per_token * _trained_tokens(cfg, micro, tokens_per_seq)
    trainable = _total(m["trainable"] for m in models)
    # The input embedding's backward builds a dense V×h gradient before adding it into .grad (full FT only, and
    # not where a tied embedding's rows go into the head's gradient). Measured activations already hold it.
    dense = a is not None and not lora and cfg.embedding_grad_buffer and cfg.activation_bytes_per_token is None
    emb_grad = a.vocab * a.hidden * act_bytes if dense else 0.0
    # Peak: states + the largest transient: activations of a micro-batch (+ that embedding gradient),
    # the KV cache of the rollout, or AdamW's sqrt(v) buffer during the optimizer step.
    optimizer = cost.optimizer_temp_bytes(trainable) if trainable is not None else 0.0
    transient = max((activations or 0.0) + emb_grad, kv_step or 0.0, optimizer)
    return {"kv_bytes_per_token": kv_per_token, "kv_bytes_step": kv_step, "activation_bytes": activations,
            "activation_source": "measured" if cfg.activation_bytes_per_token is not None else "formula",
            "micro_batch": micro, "transient": transient}


def _distill(cfg: PlanConfig, mode: str, teacher: ModelSpec) -> dict:
    """The distillation block: mode, logit bytes per token (full and top-k) and the teacher cache."""
    vocab = teacher.arch.vocab if teacher.arch else None
    return {"mode": mode, "top_k": cfg.top_k, "vocab": vocab,
            "logit_bytes_per_token_full": cost.logit_bytes_per_token(vocab) if vocab else None,
            "logit_bytes_per_token_topk": cost.logit_bytes_per_token(vocab or 0, cfg.top_k),
            **_distill_cache(cfg, mode, vocab, teacher.compute_params)}


def _distill_cache(cfg: PlanConfig, mode: str, vocab: int | None, teacher_params: int | None) -> dict:
    """The teacher cache of logit distillation (top-k + tail bucket): bytes per token and, given the data's
    loss tokens, its size and the teacher's one-time forward (2·N_T per token; the forward also runs over
    prompt tokens, which `data_tokens` does not count)."""
    if cfg.data_tokens is not None and mode != "logit":
        raise UserError(f"data_tokens: only distill=logit keeps a teacher cache (distill is {mode})")
    if mode != "logit":
        return {}
    per_token = cost.topk_cache_bytes_per_token(vocab or 0, cfg.top_k, cost.dtype_bytes("bf16"))
    out = {"cache_bytes_per_token": per_token}
    if cfg.data_tokens is not None:
        out.update(cache_tokens=cfg.data_tokens, cache_bytes=per_token * cfg.data_tokens,
                   teacher_flops_once=2 * teacher_params * cfg.data_tokens if teacher_params is not None else None)
    return out


def _peak_and_memory(cfg: PlanConfig, notes: list[str]) -> tuple[float | None, float | None]:
    """Peak FLOP/s and memory of one device: given, named, or this machine's CPU measured (plan/cpu.py)."""
    peak, device_memory = cfg.peak_flops, cfg.device_memory
    if cfg.hardware is not None and cfg.hardware.lower() == "cpu":
        compute = cfg.compute_dtype or cfg.dtype
        if peak is None:
            measured = cpu.measured_peak_flops(compute)
            if math.isfinite(measured) and measured > 0:
                peak = measured
            else:
                notes.append(f"hardware=cpu: the matmul peak measured {measured!r} FLOP/s: no time predicted")
        device_memory = device_memory or cpu.physical_memory()
    elif cfg.hardware is not None:
        if cfg.hardware.lower() not in cost.HARDWARE:
            raise UserError(f"hardware: unknown '{cfg.hardware}'; use one of {', '.join(cost.HARDWARE)}, cpu, or give peak_flops")
        named_peak, named_memory = cost.HARDWARE[cfg.hardware.lower()]
        peak, device_memory = peak or named_peak, device_memory or named_memory
    return peak, device_memory


def _time_shape(cfg: PlanConfig, method: methods.Method, sizes: dict, phases: list[dict], sequences: int,
                tokens_per_seq: int, generated_per_seq: int, infer_bytes: float, kv_value_bytes: float) -> dict:
    """What the time model (plan/timing.py) needs of a step: the trainer's tokens (a shared prefix runs each
    group's prompt once), the decode batch, prefill tokens (the engine forks a group from one prompt) and
    the generating model's weights and KV bytes per token."""
    gen = next((p for p in phases if p["phase"] == "generate"), None)
    spec = sizes["teacher" if gen is not None and gen["role"] == "teacher" else "model"]
    prompt = tokens_per_seq - generated_per_seq
    groups = cfg.batch if method.generates else sequences
    return {"tokens_per_step": sequences * tokens_per_seq,
            "executed_tokens": _trained_tokens(cfg, sequences, tokens_per_seq) if method.generates else sequences * tokens_per_seq,
            "sequences": sequences, "decode_batch": cfg.decode_batch or sequences, "generated_per_seq": generated_per_seq,
            "prompt_tokens_per_seq": prompt, "prefill_tokens": groups * cfg.prompt_len + sequences * (prompt - cfg.prompt_len),
            "gen_params": spec.compute_params if gen is not None else None,
            "gen_weight_bytes": spec.params * infer_bytes if gen is not None and spec.params else None,
            "gen_kv_bytes_per_token": spec.arch.kv_bytes_per_token(kv_value_bytes) if gen is not None and spec.arch else None}


def _rates(cfg: PlanConfig, peak: float, notes: list[str]) -> dict:
    """The rates of the time model: compute peak, decode peak (the engine samples in the weights' dtype), bandwidth."""
    rates = {"peak": peak, "decode_peak": peak, "bandwidth": cfg.memory_bandwidth, "mfu": cfg.mfu, "mbu": cfg.mbu}
    name = (cfg.hardware or "").lower()
    if name == "cpu":
        if cfg.peak_flops is None and (cfg.compute_dtype or cfg.dtype) != cfg.dtype:
            rates["decode_peak"] = cpu.measured_peak_flops(cfg.dtype)
        if rates["bandwidth"] is None:
            rates["bandwidth"] = cpu.measured_bandwidth()
    elif name in cost.BANDWIDTH and rates["bandwidth"] is None:
        rates["bandwidth"] = cost.BANDWIDTH[name]
    return rates


def _add_hardware(out: dict, cfg: PlanConfig, flops_per_step: float | None, flops_per_token: float | None,
                  memory: float | None, notes: list[str], shape: dict | None = None) -> None:
    peak, device_memory = _peak_and_memory(cfg, notes)
    if cfg.tokens is not None and cfg.steps is not None:
        raise UserError("tokens: give either tokens or steps for the run length, not both")
    run = None
    if cfg.tokens is not None:
        run = {"tokens": cfg.tokens, "steps": cfg.tokens / out["tokens_per_step"],
               "flops": flops_per_token * cfg.tokens if flops_per_token is not None else None}
    elif cfg.steps is not None:
        run = {"tokens": cfg.steps * out["tokens_per_step"], "steps": cfg.steps,
               "flops": flops_per_step * cfg.steps if flops_per_step is not None else None}
    out["hardware"] = None
    out["seconds_per_step"] = None
    if peak is not None:
        rates = _rates(cfg, peak, notes)
        out["hardware"] = {"name": cfg.hardware, "peak_flops": peak, "mfu": cfg.mfu, "devices": cfg.devices,
                           "device_memory": device_memory, "decode_peak_flops": rates["decode_peak"],
                           "memory_bandwidth": rates["bandwidth"], "mbu": cfg.mbu}
        if (cfg.hardware or "").lower() == "cpu":
            out["hardware"]["rates"] = {k: {f: e.get(f) for f in ("value", "source", "measured_at", "load", "cpu", "cores")}
                                        for k, e in cpu.rate_entries().items()}
        if flops_per_step is not None and shape is not None:
            times = timing.phase_seconds(out["phases"], rates, shape)
            for p, t in zip(out["phases"], times):
                p.update({k: v for k, v in t.items() if k != "phase"})
            one = _total(t["seconds"] for t in times)
            out["seconds_per_step"] = one / cfg.devices if one is not None else None
            out["flops_run_per_step"] = _total(t.get("flops_run") for t in times)
        elif flops_per_step is not None:
            out["seconds_per_step"] = cost.seconds(flops_per_step, peak, cfg.mfu, cfg.devices)
        if run is not None and run["flops"] is not None and out["seconds_per_step"] is not None:
            run["seconds"] = out["seconds_per_step"] * run["steps"]
            run["gpu_hours"] = run["seconds"] * cfg.devices / 3600  # device-hours at any device count
    elif device_memory is None and cfg.devices != 1:
        raise UserError("devices: needs peak_flops or hardware to turn FLOPs into time")
    if device_memory is not None:
        if out["hardware"] is None:
            out["hardware"] = {"name": cfg.hardware, "peak_flops": None, "mfu": cfg.mfu, "devices": cfg.devices,
                               "device_memory": device_memory}
        # Devices whose memory holds the model states (the seeds' "4 × 80 GB at least" for GRPO 8B);
        # KV and activations come on top and are sized by micro-batching, waves of rollouts, checkpointing.
        out["devices_for_memory"] = math.ceil(memory / device_memory) if memory is not None else None
    out["run"] = run
