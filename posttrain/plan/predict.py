"""`predict(...)`: one plan as a dict — the same object `posttrain plan --json` prints.

    from posttrain.plan import predict
    p = predict("llama-3-8b", "grpo", batch=256, group=16, seq_len=2000, hardware="h100")
    p["memory_bytes_total"], p["flops_per_step"], p["seconds_per_step"]

`model` (and `reward_model`, `teacher`) may be a name, an HF folder, a parameter count (8e9, "8B"), a config
dict or a transformers config object. A bare count gives memory and FLOPs but no KV, LoRA or activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from posttrain.errors import UserError
from posttrain.models.builtin import REAL_MODELS, TINY_CONFIGS, real_model_dir, tiny_config
from posttrain.plan import arch as archmod
from posttrain.plan import cost, cpu, methods
from posttrain.plan.arch import Arch
from posttrain.plan.config import PlanConfig


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: int
    arch: Arch | None  # None for a bare parameter count
    source: str  # "architecture", "folder", "built-in", "config", "count"


def resolve_model(spec: Any, key: str = "model") -> ModelSpec:
    """A model given any way a user can give one -> its parameter count and, when known, architecture."""
    if isinstance(spec, bool):
        raise UserError(f"{key}: expected a model, got {spec!r}")
    if isinstance(spec, (int, float)):
        return _count(str(spec), key)
    if isinstance(spec, dict) or hasattr(spec, "to_dict"):
        a = archmod.from_config(spec, name=getattr(spec, "name_or_path", "") or "config")
        return ModelSpec(a.name, a.params(), a, "config")
    text = str(spec).strip()
    if not text:
        raise UserError(f"{key}: empty")

    if text in TINY_CONFIGS:  # the same config `posttrain.models.builtin.build_tiny` instantiates
        a = archmod.from_config(tiny_config(text, vocab_size=1024), name=text)
        return ModelSpec(text, a.params(), a, "built-in")
    if text in REAL_MODELS and (real_model_dir(text) / "config.json").is_file():
        a = archmod.load_folder(real_model_dir(text))
        return ModelSpec(text, a.params(), a, "built-in")
    known = archmod.load_known(text)  # committed configs; also smollm2-135m-instruct when not fetched
    if known is not None:
        return ModelSpec(known.name, known.params(), known, "architecture")
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{key}: {path} has no config.json (not a Hugging Face model folder)")
        a = archmod.load_folder(path)
        return ModelSpec(str(path), a.params(), a, "folder")
    return _count(text, key)


def _count(text: str, key: str) -> ModelSpec:
    n = archmod.parse_count(text)
    if n is None:
        names = ", ".join([*archmod.known_architectures(), "tiny-random", "smollm2-135m-instruct"])
        raise UserError(f"{key}: '{text}' is not a folder, a known architecture ({names}) or a parameter count (8e9, 8B)")
    if n < 1:
        raise UserError(f"{key}: parameter count must be positive (got {text})")
    return ModelSpec(f"{n:.4g}", int(round(n)), None, "parameter count")


def predict(model: Any = "tiny-random", method: str = "sft", **keys) -> dict:
    """The plan of `method` on `model`; keys are those of `PlanConfig` (see `posttrain plan --help`)."""
    specs = {"model": model, **{k: keys.pop(k) for k in ("reward_model", "teacher") if k in keys}}
    as_text = {k: v for k, v in specs.items() if isinstance(v, (str, int, float)) or v is None}
    try:
        cfg = PlanConfig(method=method, **as_text, **keys)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "config"
        raise UserError(f"{where}: {err['msg']} (got {err.get('input')!r})") from None
    objects = {k: v for k, v in specs.items() if k not in as_text}
    return predict_config(cfg, **objects)


def _targets(text: str) -> tuple[str, ...]:
    if text.strip() in ("all-linear", "all_linear", "all"):
        return archmod.ALL_LINEAR
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    if not targets:
        raise UserError("lora_targets: empty; use all-linear or a comma list such as q_proj,v_proj")
    return targets


def predict_config(cfg: PlanConfig, **objects) -> dict:
    """The plan for a validated config. `objects` may hold config objects for model / reward_model / teacher."""
    method = methods.get(cfg.method)
    opt = methods.options(method, beta=cfg.beta, reward=cfg.reward, precompute_ref=cfg.precompute_ref,
                          value_model=cfg.value_model, distill=cfg.distill)
    policy, sizes = _sizes(cfg, method, objects)

    # ---- precision
    infer_bytes = cfg.infer_bytes_per_param or cost.dtype_bytes(cfg.dtype)
    act_bytes = cost.dtype_bytes(cfg.dtype)
    kv_value_bytes = cost.dtype_bytes(cfg.kv_dtype or cfg.dtype, "kv_dtype")

    # ---- shape of a step
    group, agent, tokens_per_seq, generated_per_seq = _step_shape(cfg, method, opt)
    sequences = cfg.batch * group * (2 if method.pairwise else 1)  # DPO/RM: chosen + rejected
    tokens_per_step = sequences * tokens_per_seq
    generated_per_step = sequences * generated_per_seq

    # ---- LoRA
    targets = _targets(cfg.lora_targets)
    if cfg.lora_r and policy.arch is None:
        raise UserError("lora_r: LoRA size needs an architecture (a folder or known name), not a bare parameter count")
    lora = policy.arch.lora_params(cfg.lora_r, targets) if cfg.lora_r else 0

    # ---- models in memory
    models = _models_in_memory(cfg, method, opt, sizes, lora, infer_bytes)
    by_role = {m["role"]: m for m in models}
    memory_total = sum(m["bytes"] for m in models)

    # ---- FLOPs: each phase = flops/param × params of its model × tokens it touches
    phases = _phases(method, opt, by_role, policy, group, tokens_per_step)
    flops_per_step = sum(p["flops_per_step"] for p in phases)
    flops_per_token = flops_per_step / tokens_per_step

    # ---- KV cache of the generating model, activations of the trained one
    kv_per_token = kv_step = None
    gen_phase = next((p for p in phases if p["phase"] == "generate"), None)
    if gen_phase is not None:
        gen_arch = sizes["teacher" if gen_phase["role"] == "teacher" else "model"].arch
        if gen_arch is not None:
            kv_step = cost.kv_bytes(gen_arch.kv_bytes_per_token(kv_value_bytes), sequences, tokens_per_seq)
    if policy.arch is not None:
        kv_per_token = policy.arch.kv_bytes_per_token(kv_value_bytes)
    activations = None
    # Default micro-batch: every trained sequence of the step in one forward/backward (no accumulation).
    micro = cfg.micro_batch or (sequences if method.name != "rs" else cfg.batch)
    if policy.arch is not None:
        a = policy.arch
        activations = cost.activation_bytes(micro * tokens_per_seq, a.layers, a.hidden, a.intermediate,
                                            a.kv_heads * a.head_dim, a.vocab, act_bytes, cfg.logit_copies)
    trainable = sum(m["trainable"] for m in models)
    # The input embedding's backward builds a dense V×h gradient before adding it into .grad (full FT only).
    emb_grad = policy.arch.vocab * policy.arch.hidden * act_bytes if policy.arch is not None and not lora else 0.0
    # Peak: states + the largest transient: activations of a micro-batch (+ that embedding gradient),
    # the KV cache of the rollout, or AdamW's sqrt(v) buffer during the optimizer step.
    transient = max((activations or 0.0) + emb_grad, kv_step or 0.0, cost.optimizer_temp_bytes(trainable))
    out: dict[str, Any] = {
        "model": {"name": policy.name, "source": policy.source, "architecture": policy.arch.to_dict() if policy.arch else None},
        "method": method.name,
        "options": {"beta": opt.beta if method.rl else None, "reward": None if opt.reward == "none" else opt.reward,
                    "precompute_ref": opt.precompute_ref if method.name == "dpo" else None,
                    "value_model": opt.value_model, "distill": opt.distill if method.name == "distill" else None},
        "params": policy.params,
        "trainable_params": by_role.get("policy", by_role.get("reward", {})).get("trainable", 0),
        "lora": {"r": cfg.lora_r, "targets": list(targets), "params": lora, "fraction_of_base": lora / policy.params}
        if cfg.lora_r else None,
        "models": models,
        "models_in_memory": len(models),
        "memory_bytes_total": memory_total,
        "kv_bytes_per_token": kv_per_token,
        "kv_bytes_step": kv_step,
        "activation_bytes": activations,
        "micro_batch": micro,
        "peak_bytes_estimate": memory_total + transient,
        "group": group,
        "sequences_per_step": sequences,
        "tokens_per_step": tokens_per_step,
        "generated_tokens_per_step": generated_per_step,
        "flops_per_token": flops_per_token,
        "flops_per_token_over_params": flops_per_token / policy.params,
        "flops_per_step": flops_per_step,
        "phases": phases,
    }
    if agent is not None:
        agent["flops_per_useful_token"] = flops_per_step / generated_per_step
        out["agent"] = agent
    if method.name == "distill":
        out["distill"] = _distill(cfg, opt.distill, sizes["teacher"])
    if method.name == "rs":
        out["bon_kl_nats"] = cost.bon_kl(group)
    _add_hardware(out, cfg, flops_per_step, flops_per_token, memory_total)
    if cfg.eval_n:
        out["eval"] = {"n": cfg.eval_n, "p": cfg.eval_p, "ci95_half_width": cost.ci95_half_width(cfg.eval_p, cfg.eval_n)}
    return out


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
                      lora: int, infer_bytes: float) -> list[dict]:
    """One entry per model the method holds: its role, parameters, trainable parameters and bytes."""
    models = []
    for role in methods.roles(method, opt):
        spec = sizes[role.size]
        entry = {"role": role.role, "name": spec.name, "params": spec.params, "trainable": 0, "bytes": 0.0}
        if role.trainable:
            adapter = lora if role.size == "model" else 0
            entry["params"] = spec.params + adapter
            entry["trainable"] = adapter or spec.params
            entry["bytes"] = cost.model_bytes(entry["params"], entry["trainable"], cfg.train_bytes_per_param, infer_bytes)
        elif role.role == "reference" and lora:
            entry["shared_with"] = "policy"  # the base with the adapter disabled: no extra memory
        else:
            entry["bytes"] = cost.model_bytes(spec.params, 0, infer_bytes=infer_bytes)
        models.append(entry)
    return models


def _phases(method: methods.Method, opt: methods.Options, by_role: dict[str, dict], policy: ModelSpec, group: int,
            tokens_per_step: int) -> list[dict]:
    """FLOPs of each phase of a step: flops/param × params of its model × tokens it touches."""
    phases = []
    for ph in methods.phases(method, opt):
        # The model in memory (a policy with its adapter) or, for a precomputed DPO reference, the base.
        n = by_role[ph.role]["params"] if ph.role in by_role else policy.params
        per_param = ph.flops_per_param
        if ph.flops_per_param == 6 and ph.role in by_role and by_role[ph.role]["trainable"] < n:
            per_param = cost.train_flops_per_param(by_role[ph.role]["trainable"] / n)  # LoRA
        share = 1.0 / group if ph.share == "kept" else 1.0
        phases.append({"phase": ph.name, "role": ph.role, "flops_per_token": per_param * n * share,
                       "flops_per_step": per_param * n * share * tokens_per_step})
    return phases


def _distill(cfg: PlanConfig, mode: str, teacher: ModelSpec) -> dict:
    """The distillation block: mode, logit bytes per token (full and top-k) and the teacher cache."""
    vocab = teacher.arch.vocab if teacher.arch else None
    return {"mode": mode, "top_k": cfg.top_k, "vocab": vocab,
            "logit_bytes_per_token_full": cost.logit_bytes_per_token(vocab) if vocab else None,
            "logit_bytes_per_token_topk": cost.logit_bytes_per_token(vocab or 0, cfg.top_k),
            **_distill_cache(cfg, mode, vocab, teacher.params)}


def _distill_cache(cfg: PlanConfig, mode: str, vocab: int | None, teacher_params: int) -> dict:
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
                   teacher_flops_once=2 * teacher_params * cfg.data_tokens)
    return out


def _add_hardware(out: dict, cfg: PlanConfig, flops_per_step: float, flops_per_token: float, memory: float) -> None:
    peak, device_memory = cfg.peak_flops, cfg.device_memory
    if cfg.hardware is not None and cfg.hardware.lower() == "cpu":  # this machine, measured (plan/cpu.py)
        compute = cfg.compute_dtype or cfg.dtype
        peak = peak or cpu.measured_peak_flops(compute)
        device_memory = device_memory or cpu.physical_memory()
    elif cfg.hardware is not None:
        if cfg.hardware.lower() not in cost.HARDWARE:
            raise UserError(f"hardware: unknown '{cfg.hardware}'; use one of {', '.join(cost.HARDWARE)}, cpu, or give peak_flops")
        named_peak, named_memory = cost.HARDWARE[cfg.hardware.lower()]
        peak, device_memory = peak or named_peak, device_memory or named_memory
    if cfg.tokens is not None and cfg.steps is not None:
        raise UserError("tokens: give either tokens or steps for the run length, not both")
    run = None
    if cfg.tokens is not None:
        run = {"tokens": cfg.tokens, "steps": cfg.tokens / out["tokens_per_step"], "flops": flops_per_token * cfg.tokens}
    elif cfg.steps is not None:
        run = {"tokens": cfg.steps * out["tokens_per_step"], "steps": cfg.steps, "flops": flops_per_step * cfg.steps}
    out["hardware"] = None
    out["seconds_per_step"] = None
    if peak is not None:
        out["hardware"] = {"name": cfg.hardware, "peak_flops": peak, "mfu": cfg.mfu, "devices": cfg.devices,
                           "device_memory": device_memory}
        out["seconds_per_step"] = cost.seconds(flops_per_step, peak, cfg.mfu, cfg.devices)
        if run is not None:
            run["seconds"] = cost.seconds(run["flops"], peak, cfg.mfu, cfg.devices)
            run["gpu_hours"] = cost.seconds(run["flops"], peak, cfg.mfu) / 3600  # device-hours at any device count
    elif device_memory is None and cfg.devices != 1:
        raise UserError("devices: needs peak_flops or hardware to turn FLOPs into time")
    if device_memory is not None:
        if out["hardware"] is None:
            out["hardware"] = {"name": cfg.hardware, "peak_flops": None, "mfu": cfg.mfu, "devices": cfg.devices,
                               "device_memory": device_memory}
        # Devices whose memory holds the model states (the seeds' "4 × 80 GB at least" for GRPO 8B);
        # KV and activations come on top and are sized by micro-batching, waves of rollouts, checkpointing.
        out["devices_for_memory"] = math.ceil(memory / device_memory)
    out["run"] = run
