"""Online RL with a group baseline: GRPO, Dr. GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++.

One step reads top to bottom (the phase names are the timer and metric prefixes):
    1. generate   G samples for each of `prompts_per_step` prompts (engine; behaviour log-probs kept)
    2. reward     score every completion (reward registry; None -> the sample is left out of the loss)
    3. filter     dynamic sampling: drop groups with equal rewards, refill (DAPO), capped retries
    4. advantage  outcome advantages from the registry, broadcast over each completion's tokens
    5. reference  log π_ref on the completions when β > 0 (no reference model at β = 0)
    6. update     policy loss from the registry (+ β·KL), aggregated over the global batch, AdamW
    7. log        rewards, KL, lengths, clip fractions, entropy, train–inference Δlogp, time split

Only generated tokens carry loss (prompt tokens have mask 0).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import Field

from posttrain.algos import advantages as adv_registry
from posttrain.algos import aggregate, dynamic_sampling, kl_estimate, policy_losses
from posttrain.config import CommonConfig, parse_args
from posttrain.data import formats
from posttrain.data.packing import IGNORE, collate
from posttrain.data.templates import Tokenized, render_prompt
from posttrain.errors import UserError
from posttrain.models.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from posttrain.models.forward import backbone_and_head, hidden_states, unwrap
from posttrain.models.loading import load_model, load_tokenizer
from posttrain.monitor.metrics import MetricsWriter, PhaseTimer
from posttrain.monitor.report import write_report
from posttrain.ops.logprobs import chunked_logprobs
from posttrain.ops.sampling import process_logits
from posttrain.plan import predict
from posttrain.plan.measure import Measured, write_measured, write_plan
from posttrain.recipes.common import EpochSampler, OptimSettings, build_optimizer, progress, seed_everything, setup_run
from posttrain.rewards.registry import compose

# algo -> (advantage estimator, policy loss, aggregation, default β, dynamic sampling)
ALGOS: dict[str, dict] = {
    "grpo": dict(advantage="grpo", loss="ppo", agg="seq_mean_token_mean", beta=0.04, dynamic=False),
    "dr_grpo": dict(advantage="dr_grpo", loss="ppo", agg="seq_mean_token_sum_norm", beta=0.0, dynamic=False),
    "dapo": dict(advantage="grpo", loss="clip_higher", agg="token_mean", beta=0.0, dynamic=True),
    "gspo": dict(advantage="grpo", loss="gspo", agg="seq_mean_token_mean", beta=0.0, dynamic=False),
    "cispo": dict(advantage="grpo", loss="cispo", agg="token_mean", beta=0.0, dynamic=False),
    "rloo": dict(advantage="rloo", loss="ppo", agg="token_mean", beta=0.0, dynamic=False),
    "reinforce_pp": dict(advantage="reinforce_pp", loss="ppo", agg="token_mean", beta=0.0, dynamic=False),
}


class RLConfig(CommonConfig):
    """posttrain rl: online RL with a group baseline (GRPO family) and verifiable or learned rewards."""

    algo: str = Field("grpo", description=f"one of {', '.join(ALGOS)} (ppo with a value model: not yet)")
    reward: str = Field("math", description="reward or weighted composition, e.g. 'math:1.0,format:0.2'")
    data: str = Field("arithmetic", description="prompt-only dataset (`prompt` + reward columns such as `answer`)")
    output_dir: str = Field("runs/rl", description="run directory")
    max_steps: int = Field(20, ge=0, description="optimizer steps")
    dtype: str = Field("float32", description="training dtype")
    prompts_per_step: int = Field(8, ge=1, description="prompts per step (B)")
    group_size: int = Field(8, ge=2, description="samples per prompt (G)")
    max_new_tokens: int = Field(128, ge=1, description="generation limit per sample")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (the trainer scores with the same)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (behaviour log-probs are of the truncated distribution)")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    beta: float | None = Field(None, ge=0, description="KL coefficient; None = the algo's default (grpo 0.04, others 0); 0 loads no reference")
    kl_estimator: str = Field("k3", description="k1 | k2 | k3 (KL in the loss)")
    advantage: str | None = Field(None, description="override the algo's advantage estimator (registry name)")
    loss: str | None = Field(None, description="override the algo's policy loss (registry name)")
    loss_agg: str | None = Field(None, description="token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (default: the algo's)")
    loss_args: dict = Field(default_factory=dict, description="extra hyperparameters of the policy loss, e.g. {eps_high: 0.28}")
    dynamic_sampling: bool | None = Field(None, description="drop groups whose rewards are all equal and refill (default: dapo only)")
    max_resample: int = Field(3, ge=0, description="extra generation rounds to refill after dynamic sampling")
    ignore_eos: bool = Field(False, description="always generate max_new_tokens (benchmarks and planner checks)")
    mask_truncated: bool = Field(False, description="leave samples cut at max_new_tokens out of the loss")
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch of samples (1 = strictly on-policy)")
    micro_batch_size: int = Field(16, ge=1, description="sequences per forward/backward")
    optim: OptimSettings = Field(default_factory=lambda: OptimSettings(lr=1e-6, warmup_ratio=0.0))
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    samples_per_log: int = Field(2, ge=0, description="completions written to samples.jsonl each step")
    kv_cache_mb: float = Field(512, gt=0, description="engine KV cache size (MiB)")
    progress: bool = Field(True, description="show a progress bar")


@dataclass
class Rollout:
    """One sample: prompt + completion ids, behaviour log-probs, reward and group."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logp: list[float]
    finish_reason: str
    text: str
    group: int
    reward: float | None = None
    valid: bool = True  # False: left out of the loss (reward None, or truncated with mask_truncated)
    advantage: float = 0.0


# ---------------------------------------------------------------- phases


def generate(engine, tok, rows: list[formats.Row], first_group: int, cfg: RLConfig, seed: int) -> list[Rollout]:
    from posttrain.rollout.types import Request, SamplingParams

    params = dict(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                  max_new_tokens=cfg.max_new_tokens, ignore_eos=cfg.ignore_eos)
    requests = [Request(render_prompt(tok, r.data["prompt"]), SamplingParams(**params, seed=seed + i), request_id=i)
                for i, r in enumerate(rows)]
    out = []
    for i, res in enumerate(engine.generate(requests)):
        if res.error:
            raise rows[i].error("prompt", f"generation refused: {res.error}")
        for c in res.samples:
            text = c.text if c.text is not None else tok.decode(c.token_ids, skip_special_tokens=True)
            out.append(Rollout(res.prompt_token_ids, c.token_ids, c.logprobs, c.finish_reason, text, first_group + i))
    return out


def score(reward_fn, rows_by_group: dict[int, formats.Row], rollouts: list[Rollout]) -> None:
    """Fill `reward` of every rollout; dataset columns are passed per sample (TRL convention)."""
    rows = [rows_by_group[r.group] for r in rollouts]
    extra = {k for row in rows for k in row.data if k not in ("prompt", "messages")}
    columns = {k: [row.data.get(k) for row in rows] for k in extra}
    values = reward_fn([row.data["prompt"] for row in rows], [r.text for r in rollouts], **columns)
    for r, v in zip(rollouts, values):
        r.reward = v


def make_batches(rollouts: list[Rollout], pad_id: int, size: int):
    """Padded micro-batches of prompt+completion; targets only on completion tokens. Returns (batch, rollouts)."""
    out = []
    for i in range(0, len(rollouts), size):
        chunk = rollouts[i : i + size]
        samples = [Tokenized(r.prompt_ids + r.completion_ids, [0] * len(r.prompt_ids) + [1] * len(r.completion_ids))
                   for r in chunk]
        out.append((collate([[s] for s in samples], pad_id, packed=False), chunk))
    return out


def token_logps(model, batch, cfg: RLConfig, with_entropy: bool = False):
    """log π(a_t|s_t) under the sampling distribution (temperature, top-k/top-p) -> (B, T) tensors."""
    sel = batch.targets != IGNORE  # (B, T)
    h = hidden_states(model, batch, cfg.mixed_precision)[sel]  # (M, H); fp32 under mixed precision
    _, head = backbone_and_head(model)
    if cfg.top_k or cfg.top_p < 1:  # truncated distribution: needs full logits at the selected rows
        logits = h @ head.weight.t() + (head.bias if head.bias is not None else 0)
        lp_all = process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        logp = lp_all.gather(1, batch.targets[sel][:, None]).squeeze(1)
        ent = None
        if with_entropy:
            p = lp_all.exp()
            ent = -(p * torch.where(p > 0, lp_all, torch.zeros_like(lp_all))).sum(-1).detach()
    else:
        logp, ent = chunked_logprobs(h, head.weight, batch.targets[sel], bias=head.bias,
                                     temperature=cfg.temperature, with_entropy=with_entropy)
    full = torch.zeros(sel.shape, dtype=logp.dtype)
    full = full.masked_scatter(sel, logp)
    ent_full = torch.zeros(sel.shape, dtype=logp.dtype).masked_scatter(sel, ent) if ent is not None else None
    return full, sel, ent_full


def padded(values: list[list[float]], like: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """Per-sample lists laid out on the selected positions of a (B, T) batch."""
    flat = torch.tensor([v for vs in values for v in vs], dtype=like.dtype)
    return torch.zeros_like(like).masked_scatter(sel, flat)


# ---------------------------------------------------------------- training


def train(cfg: RLConfig) -> dict:
    if cfg.algo not in ALGOS:
        raise UserError(f"unknown algo '{cfg.algo}'; choose one of {', '.join(ALGOS)}")
    preset = ALGOS[cfg.algo]
    beta = preset["beta"] if cfg.beta is None else cfg.beta
    adv_fn = adv_registry.get(cfg.advantage or preset["advantage"])
    loss_fn = policy_losses.get(cfg.loss or preset["loss"])
    agg_mode = cfg.loss_agg or preset["agg"]
    dynamic = preset["dynamic"] if cfg.dynamic_sampling is None else cfg.dynamic_sampling

    existing = list_checkpoints(Path(cfg.output_dir)) if cfg.resume else []
    resume_from = existing[-1] if existing else None
    out = setup_run(cfg, resume=cfg.resume)
    seed_everything(cfg.seed)
    tok = load_tokenizer(cfg.model)
    rows, _ = formats.load(cfg.data, allowed=("prompt_only", "prompt_completion"))
    reward_fn = compose(cfg.reward)
    missing = {c for cols in reward_fn.columns.values() for c in cols if isinstance(c, str) and c not in rows[0].data}
    if missing:
        raise rows[0].error(sorted(missing)[0], f"reward '{cfg.reward}' needs this column")

    measured = Measured()
    model = load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed)
    model.train()
    ref = load_reference(model) if beta > 0 else None  # β = 0 must not load a reference model
    from posttrain.rollout.engine import Engine, EngineConfig

    engine = Engine(model, tok, EngineConfig(max_num_seqs=min(256, cfg.prompts_per_step * cfg.group_size),
                                             kv_cache_mb=cfg.kv_cache_mb, seed=cfg.seed))
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    sampler = EpochSampler(len(rows), cfg.seed)
    start = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, scheduler)
        sampler.load(state["sampler"])
        start = state["step"]
    write_plan(out, plan_run(cfg, model, beta, tok, rows))
    metrics = MetricsWriter(out / "metrics.jsonl", resume_step=start if resume_from else None)
    samples_path = out / "samples.jsonl"
    if resume_from is None:
        samples_path.write_text("")

    timer = PhaseTimer()
    bar = progress(cfg.max_steps, start, f"rl/{cfg.algo}", cfg.progress)
    G = cfg.group_size
    for step in range(start, cfg.max_steps):
        t0 = time.perf_counter()
        row_metrics: dict = {}
        # 1-3. generate, reward, filter (dynamic sampling refills up to max_resample rounds)
        kept: list[Rollout] = []
        rows_by_group: dict[int, formats.Row] = {}
        rounds, groups_seen, groups_dropped = 0, 0, 0
        while True:
            need = cfg.prompts_per_step - len(kept) // G
            batch_rows = [rows[i] for i in sampler.take(need)]
            for j, r in enumerate(batch_rows):
                rows_by_group[groups_seen + j] = r
            with timer("generate"):
                new = generate(engine, tok, batch_rows, groups_seen, cfg, seed=cfg.seed * 7919 + step * 1009 + rounds * 97)
            with timer("reward"):
                score(reward_fn, rows_by_group, new)
            groups_seen += need
            if rounds == 0:
                row_metrics.update({k: v for k, v in reward_fn.last_metrics.items()})
                first_round = new
            if dynamic:
                r = torch.tensor([x.reward if x.reward is not None else math.nan for x in new])
                g = torch.tensor([x.group for x in new])
                res = dynamic_sampling(torch.nan_to_num(r, nan=0.0), g)
                keep_idx = set(res.indices.tolist())
                groups_dropped += res.num_groups - res.num_kept
                new = [x for i, x in enumerate(new) if i in keep_idx]
            kept += new
            rounds += 1
            if not dynamic or len(kept) // G >= cfg.prompts_per_step or rounds > cfg.max_resample:
                break
        if not kept:  # every group was uninformative even after refills: nothing to learn this step
            kept = first_round
        # 4. advantages (outcome level), broadcast over tokens
        with timer("advantage"):
            rewards = torch.tensor([x.reward if x.reward is not None else 0.0 for x in kept])
            valid = torch.tensor([x.reward is not None for x in kept])
            if cfg.mask_truncated:
                valid &= torch.tensor([x.finish_reason != "length" for x in kept])
            groups = torch.tensor([x.group for x in kept])
            adv, adv_metrics = adv_fn(rewards, groups)
        # 5-6. reference + update
        batches = make_batches(kept, tok.pad_token_id, cfg.micro_batch_size)
        for x, v, a in zip(kept, valid.tolist(), adv.tolist()):
            x.valid, x.advantage = v, a
        norm_tokens = sum(len(x.completion_ids) for x in kept if x.valid)
        num_seqs = int(valid.sum())
        ref_logps = []
        if ref is not None:
            with timer("reference"), torch.no_grad():
                ref_logps = [token_logps(ref, b, cfg)[0] for b, _ in batches]
        old_logps: list[torch.Tensor] = []
        agg = {"loss": 0.0, "kl": 0.0, "entropy_sum": 0.0, "clip_low": 0.0, "clip_high": 0.0, "dlogp_max": 0.0,
               "dlogp_sum": 0.0, "behaviour_kl_sum": 0.0, "tokens": 0}
        with timer("update"):
            max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
            lr = scheduler.get_last_lr()[0]
            for epoch in range(cfg.ppo_epochs):  # each epoch is one optimizer step over the whole batch
                for k, (b, chunk) in enumerate(batches):
                    logp, sel, ent = token_logps(model, b, cfg, with_entropy=(epoch == 0))
                    mask = sel & torch.tensor([[x.valid] for x in chunk])
                    if epoch == 0:  # on-policy: the old policy is the current one (no recomputation)
                        old = logp.detach()
                        old_logps.append(old)
                        behaviour = padded([x.behaviour_logp for x in chunk], logp, sel)
                        d = (old - behaviour).abs() * sel
                        agg["dlogp_max"] = max(agg["dlogp_max"], float(d.max()))
                        agg["dlogp_sum"] += float(d.sum())
                        agg["behaviour_kl_sum"] += float(((behaviour - old) * sel).sum())  # KL(μ‖π) ≈ E_μ[log μ − log π]
                        agg["entropy_sum"] += float((ent * sel).sum())
                        agg["tokens"] += int(sel.sum())
                    else:
                        old = old_logps[k]
                    a = torch.tensor([x.advantage for x in chunk])[:, None].expand_as(logp)
                    tok_loss, lm = loss_fn(logp, old, a, mask, **cfg.loss_args)
                    if ref is not None:
                        kl_tok = kl_estimate(logp, ref_logps[k], cfg.kl_estimator)
                        tok_loss = tok_loss + beta * kl_tok
                        agg["kl"] += float((kl_tok.detach() * mask).sum()) / max(norm_tokens, 1) / cfg.ppo_epochs
                    loss = aggregate(tok_loss, mask, agg_mode, norm_tokens=max(norm_tokens, 1),
                                     max_len=cfg.max_new_tokens, num_sequences=max(num_seqs, 1))
                    loss.backward()
                    agg["loss"] += float(loss.detach()) / cfg.ppo_epochs
                    n_tok = float(mask.sum())
                    agg["clip_low"] += float(lm.get("clip_frac/low", 0.0)) * n_tok
                    agg["clip_high"] += float(lm.get("clip_frac/high", 0.0)) * n_tok
                norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
                if epoch == 0:
                    grad_norm = norm  # logged: the norm of the first (fully on-policy) update
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            engine.sync_weights()  # the engine shares the weights; its packed copies and cached KV are now stale
        # 7. log
        lengths = torch.tensor([len(x.completion_ids) for x in kept], dtype=torch.float32)
        all_tokens = sum(len(x.prompt_ids) + len(x.completion_ids) for x in kept)
        gen_tokens = int(lengths.sum())
        measured.add_step(all_tokens, gen_tokens)
        dt = time.perf_counter() - t0
        n_upd = max(norm_tokens * cfg.ppo_epochs, 1)
        row = {
            "loss": agg["loss"], "lr": lr, "grad_norm": grad_norm,
            "reward/mean": rewards[valid].mean() if valid.any() else math.nan,
            "reward/std": rewards[valid].std() if int(valid.sum()) > 1 else math.nan,
            "kl": agg["kl"], "beta": beta,
            "response_length/mean": lengths.mean(), "response_length/max": lengths.max(),
            "response_length/clipped_frac": sum(x.finish_reason == "length" for x in kept) / len(kept),
            "clip_frac/low": agg["clip_low"] / n_upd, "clip_frac/high": agg["clip_high"] / n_upd,
            "entropy": agg["entropy_sum"] / max(agg["tokens"], 1),
            "consistency/dlogp_max": agg["dlogp_max"], "consistency/dlogp_mean": agg["dlogp_sum"] / max(agg["tokens"], 1),
            "consistency/kl_behaviour_trainer": agg["behaviour_kl_sum"] / max(agg["tokens"], 1),
            "dynamic/rounds": rounds, "dynamic/groups_dropped": groups_dropped,
            "samples": len(kept), "tokens": all_tokens, "generated_tokens": gen_tokens,
            "tokens_per_s": all_tokens / dt, **{k: v for k, v in adv_metrics.items()},
            **{k: v for k, v in row_metrics.items() if k.endswith(("/mean", "/errors", "/none"))},
            **timer.pop(),
        }
        done = step + 1
        logged = metrics.write(done, row)
        with samples_path.open("a") as f:
            for x in kept[: cfg.samples_per_log]:
                f.write(json.dumps({"step": done, "prompt": tok.decode(x.prompt_ids), "completion": x.text,
                                    "reward": x.reward, "finish_reason": x.finish_reason}) + "\n")
        bar.update(1)
        bar.set_postfix(reward=f"{logged['reward/mean']:.3f}" if logged["reward/mean"] is not None else "nan")
        if cfg.save_every and done % cfg.save_every == 0 and done != cfg.max_steps:
            save_checkpoint(out, done, model, optimizer, scheduler, {"sampler": sampler.state()}, keep=cfg.keep_checkpoints)
    bar.close()
    if cfg.max_steps > start:
        save_checkpoint(out, cfg.max_steps, model, optimizer, scheduler, {"sampler": sampler.state()}, keep=cfg.keep_checkpoints)
    final = out / "final"
    final.mkdir(exist_ok=True)
    unwrap(model).save_pretrained(final)
    tok.save_pretrained(final)
    plan = json.loads(write_measured(out, measured).read_text())
    history = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l]
    summary = {
        "algo": cfg.algo, "advantage": cfg.advantage or preset["advantage"], "loss": cfg.loss or preset["loss"],
        "loss_agg": agg_mode, "beta": beta, "steps": cfg.max_steps,
        "first_reward": history[0]["reward/mean"] if history else math.nan,
        "last_reward": history[-1]["reward/mean"] if history else math.nan,
        "tokens predicted (plan)": plan["predicted"]["tokens_per_step"] * (cfg.max_steps - start),
        "tokens counted": plan["measured"]["tokens"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_report(out, f"RL ({cfg.algo}) — {cfg.model}", {"summary": summary, "plan vs measured": plan.get("comparison", {}),
                                                         "config": cfg.model_dump(mode="json")})
    return summary


def load_reference(model):
    """The frozen reference policy: a copy of the initial weights (π_ref = π_θ at step 0)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def plan_run(cfg: RLConfig, model, beta: float, tok, rows) -> dict:
    """Planner prediction for the run; tokens assume every sample runs to max_new_tokens."""
    prompt_len = round(sum(len(render_prompt(tok, r.data["prompt"])) for r in rows) / len(rows))
    return predict(unwrap(model).config, "grpo", batch=cfg.prompts_per_step, group=cfg.group_size,
                   seq_len=cfg.max_new_tokens, prompt_len=prompt_len, beta=beta, reward="verifier",
                   micro_batch=cfg.micro_batch_size, dtype="fp32" if cfg.dtype in ("float32", "fp32") else "bf16",
                   steps=max(cfg.max_steps, 1), logit_copies=0)


def main(argv: list[str]) -> None:
    cfg = parse_args(RLConfig, argv, prog="posttrain rl")
    summary = train(cfg)
    print(f"reward {summary['first_reward']:.3f} -> {summary['last_reward']:.3f}; run directory: {cfg.output_dir}")
