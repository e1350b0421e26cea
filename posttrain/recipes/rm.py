"""Reward models: `posttrain rm` trains a scalar head on a causal LM with the Bradley–Terry loss;
`posttrain rm probe` checks a trained one before RL trusts it (rm_probe.py).

Per optimizer step (the phase names are the timer names):
    1. data      `batch_size` pairs
    2. forward_backward   one packed forward per micro-batch: each prompt once, chosen and rejected
                 after it (shared-prefix attention); each sequence is the chat template's whole rendering
                 (as TRL's RewardTrainer tokenizes it: data/preference.py scored_ids), and
                 r = head(h at its last non-pad token), the token transformers' sequence classifier reads;
                 L = −log σ(r_w − r_l − m) + c (r_w + r_l)²  (algos.reward_model.bradley_terry_loss:
                 m the row's `margin` column when present, c = center_coef), Σ L / (pairs in the step)
    3. update    clip, AdamW, schedule
    4. log       loss, rm/accuracy, rm/margin, rm/chosen|rejected|reward_mean; at eval steps the
                 held-out pairwise accuracy and margin, the same accuracy on as many training pairs,
                 and their gap (train − eval: memorisation shows here first)

`final/` loads with `AutoModelForSequenceClassification.from_pretrained` (num_labels=1, pad_token_id set)
and is a reward anywhere a reward is taken: `reward=rm:runs/rm/final` (rewards/reward_model.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from pydantic import Field

from posttrain.algos.reward_model import bradley_terry_loss
from posttrain.config import CommonConfig, parse_args
from posttrain.data.preference import TokenizedPair, load_split
from posttrain.data.prefix_batch import micro_batches
from posttrain.models.device import resolve_device, synchronize
from posttrain.models.loading import load_tokenizer
from posttrain.models.lora import LoraSettings, memory_savers
from posttrain.models.reward_head import load_reward_model, sequence_rewards
from posttrain.monitor.metrics import PhaseTimer
from posttrain.plan.measure import Measured, write_plan
from posttrain.recipes import rm_probe
from posttrain.training.data_order import EpochSampler
from posttrain.training.epochs import resolve_max_steps
from posttrain.training.lifecycle import RunLifecycle
from posttrain.training.loop import CheckpointArgs, run_loop
from posttrain.training.optim import OptimSettings, build_optimizer, optimizer_step
from posttrain.training.plan import measured_plan, predict_run
from posttrain.training.run import seed_everything


class RMConfig(CommonConfig):
    """posttrain rm: a Bradley–Terry reward model (scalar head on a causal LM). `posttrain rm probe --help`: its probes."""

    data: str = Field("", description="preference data {prompt, chosen, rejected} (or implicit prompt), optional `margin` column")
    output_dir: str = Field("runs/rm", description="run directory")
    max_steps: int | None = Field(None, ge=0, description="optimizer steps (default: `epochs` over the training pairs)")
    epochs: float | None = Field(1.0, gt=0, description="passes over the training pairs: max_steps = ceil(epochs x pairs / "
                                                        "batch_size) unless max_steps is given (one epoch: the usual RM recipe)")
    dtype: str = Field("float32", description="training dtype: float32 | bfloat16")
    batch_size: int = Field(16, ge=1, description="pairs per optimizer step")
    micro_batch_tokens: int = Field(4096, ge=64, description="tokens per forward/backward (whole pairs; each prompt counted once)")
    max_length: int = Field(1024, ge=8, description="maximum tokens of prompt + completion")
    too_long: str = Field("error", pattern="^(error|drop)$", description="a pair over max_length: error (refuse) | drop")
    optim: OptimSettings = Field(default_factory=lambda: OptimSettings(lr=1e-5))
    center_coef: float = Field(0.0, ge=0, description="centering penalty c·(r_w + r_l)² keeping rewards near 0 (TRL center_rewards_coefficient; 0.01 suggested)")
    use_margin: bool = Field(True, description="subtract the data's `margin` column (Llama 2) when it has one")
    eval_data: str = Field("", description="held-out preference data; empty: split eval_fraction off the training data")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="share of pairs held out when eval_data is empty")
    eval_every: int = Field(25, ge=0, description="held-out pairwise accuracy every N steps (0: start and end only)")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    pad_to_multiple_of: int = Field(64, ge=1, description="round each packed row up to this many tokens")
    progress: bool = Field(True, description="show a progress bar")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="train a LoRA adapter (and the score head in full)")


@dataclass(eq=False)
class RMRun:
    cfg: RMConfig
    life: RunLifecycle
    tok: object
    train: list[TokenizedPair]
    evals: list[TokenizedPair]
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    sampler: EpochSampler
    device: torch.device
    initial_eval: dict = field(default_factory=dict)
    metrics: object = None
    measured: Measured = field(default_factory=Measured)
    timer: PhaseTimer = field(default_factory=PhaseTimer)


def pair_loss(run: RMRun, batch, examples: list[TokenizedPair]):
    """(loss (B,), metrics) of one micro-batch of pairs (sequences alternate chosen, rejected)."""
    r = sequence_rewards(run.model, batch, run.cfg.mixed_precision)  # (2B,)
    margin = None
    if run.cfg.use_margin and any(e.margin is not None for e in examples):
        margin = torch.tensor([e.margin or 0.0 for e in examples], dtype=r.dtype, device=r.device)  # (B,)
    return bradley_terry_loss(r[0::2], r[1::2], margin=margin, center_coef=run.cfg.center_coef)


def rm_step(run: RMRun, step: int) -> dict:
    cfg, timer = run.cfg, run.timer
    t0 = time.perf_counter()
    # 1. data
    with timer("data"):
        ids = run.sampler.take(cfg.batch_size)
        examples = [run.train[i] for i in ids]
    # 2. forward + loss + backward
    with timer("forward_backward"):
        total, sums, tokens, seq_tokens = 0.0, {}, 0, 0
        for batch, idx in micro_batches([(e.prompt_ids, e.continuations) for e in examples], run.tok.pad_token_id,
                                        cfg.micro_batch_tokens, cfg.pad_to_multiple_of, run.device):
            loss, m = pair_loss(run, batch, [examples[j] for j in idx])
            loss = loss.sum() / len(ids)
            loss.backward()
            total += float(loss.detach())
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v) * len(idx) / len(ids)
            tokens += batch.num_tokens
            seq_tokens += sum(2 * len(examples[j].prompt_ids) + sum(map(len, examples[j].continuations)) for j in idx)
    # 3. update
    with timer("update"):
        lr = run.scheduler.get_last_lr()[0]
        grad_norm = optimizer_step(run.model, run.optimizer, cfg.optim.max_grad_norm, run.scheduler)
        synchronize(run.device)
    # 4. log
    dt = time.perf_counter() - t0
    run.measured.add_step(seq_tokens)
    row = {"loss": total, "lr": lr, "grad_norm": grad_norm, "pairs": len(ids), "tokens": tokens,
           "pairs_per_s": len(ids) / dt, "tokens_per_s": tokens / dt, **sums, **timer.pop()}
    done = step + 1
    if done == cfg.max_steps or (cfg.eval_every and done % cfg.eval_every == 0):
        row.update(evaluate(run))
    return run.metrics.write(done, row)


@torch.no_grad()
def pairwise(run: RMRun, examples: list[TokenizedPair]) -> dict:
    """Loss, accuracy (r_w > r_l) and mean margin over `examples`."""
    if not examples:
        return {}
    cfg, sums = run.cfg, {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
    run.model.eval()
    for batch, idx in micro_batches([(e.prompt_ids, e.continuations) for e in examples], run.tok.pad_token_id,
                                    cfg.micro_batch_tokens, cfg.pad_to_multiple_of, run.device):
        loss, m = pair_loss(run, batch, [examples[j] for j in idx])
        sums["loss"] += float(loss.sum())
        sums["accuracy"] += float(m["rm/accuracy"]) * len(idx)
        sums["margin"] += float(m["rm/margin"]) * len(idx)
    run.model.train()
    return {k: v / len(examples) for k, v in sums.items()}


def evaluate(run: RMRun) -> dict:
    """Held-out accuracy and margin; training accuracy on as many (fixed) training pairs; their gap."""
    out = {f"eval/{k}": v for k, v in pairwise(run, run.evals).items()}
    seen = pairwise(run, run.train[: max(len(run.evals), 1) if run.evals else 64])
    out.update({f"train_eval/{k}": v for k, v in seen.items()})
    if "eval/accuracy" in out:
        out["accuracy_gap"] = out["train_eval/accuracy"] - out["eval/accuracy"]
    return out


def setup(cfg: RMConfig) -> RMRun:
    """Data checked and tokenized before the model loads."""
    device = resolve_device(cfg.device)
    life = RunLifecycle(cfg)
    seed_everything(cfg.seed)
    tok = load_tokenizer(cfg.model, cfg.chat_template, cfg.chat_template_args)
    train, evals = load_split(tok, cfg.data, cfg.eval_data, cfg.eval_fraction, cfg.seed, cfg.max_length, cfg.too_long,
                              scored=True)
    note = resolve_max_steps(cfg, len(train), cfg.batch_size, "pairs", life)
    if note:
        print(note, flush=True)
    measured = Measured()
    model = load_reward_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed, device=device, pad_token_id=tok.pad_token_id)
    model = memory_savers(model, cfg.lora, cfg.gradient_checkpointing, task_type="SEQ_CLS")
    model.train()
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    run = RMRun(cfg, life, tok, train, evals, model, optimizer, scheduler, EpochSampler(len(train), cfg.seed), device,
                measured=measured)
    state = life.restore(model, optimizer, scheduler)
    if state:
        run.sampler.load(state["sampler"], cfg.data)
        run.initial_eval = state.get("initial_eval", {})
    else:
        run.initial_eval = evaluate(run)
    write_plan(life.out, plan_run(cfg, model, train))
    run.metrics = life.metrics()
    return run


def plan_run(cfg: RMConfig, model, train: list[TokenizedPair]) -> dict:
    seqs = [len(e.prompt_ids) + len(c) for e in train for c in e.continuations]
    per_pair = max(1, round(sum(len(e) for e in train) / len(train)))
    return predict_run(cfg, model, "rm", steps=cfg.max_steps, batch=cfg.batch_size, seq_len=max(1, round(sum(seqs) / len(seqs))),
                       micro_batch=max(1, min(2 * cfg.batch_size, 2 * (cfg.micro_batch_tokens // per_pair))))


def checkpoint_args(run: RMRun) -> CheckpointArgs:
    return CheckpointArgs(run.model, run.optimizer, run.scheduler, {"sampler": run.sampler.state(), "initial_eval": run.initial_eval},
                          tok=run.tok)


def finish(run: RMRun) -> dict:
    cfg, life = run.cfg, run.life
    life.save_final(run.model, run.tok, lora=cfg.lora.enabled)
    plan = measured_plan(life.out, run.measured)
    history = life.history()
    last_eval = next((r for r in reversed(history) if "train_eval/accuracy" in r), {})
    summary = {
        "steps": cfg.max_steps, "train_pairs": len(run.train), "eval_pairs": len(run.evals),
        "first_loss": history[0]["loss"] if history else math.nan, "last_loss": history[-1]["loss"] if history else math.nan,
        **{f"{k}_before": v for k, v in run.initial_eval.items()},
        **{f"{k}_after": v for k, v in last_eval.items() if k.startswith(("eval/", "train_eval/", "accuracy_gap"))},
        "tokens predicted (plan)": plan["predicted"]["tokens_per_step"] * (cfg.max_steps - life.start),
        "sequence tokens counted": plan["measured"]["tokens"],
    }
    life.finish(summary, f"Reward model — {cfg.model}", {"summary": summary, "plan vs measured": plan.get("comparison", {})})
    return summary


def train(cfg: RMConfig) -> dict:
    run = setup(cfg)
    run_loop(run.life, cfg, lambda step: rm_step(run, step), lambda: checkpoint_args(run), desc="rm",
             postfix=lambda row: {"loss": f"{row['loss']:.4f}", "acc": f"{row['rm/accuracy']:.2f}"})
    return finish(run)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "probe":
        return rm_probe.main(argv[1:])
    cfg = parse_args(RMConfig, argv, prog="posttrain rm")
    summary = train(cfg)
    acc = [(k, summary[k]) for k in ("eval/accuracy_before", "eval/accuracy_after", "accuracy_gap_after") if k in summary]
    print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}" + "".join(f"; {k} {v:.3f}" for k, v in acc)
          + f"; reward model: {cfg.output_dir}/final (reward=rm:{cfg.output_dir}/final)")
