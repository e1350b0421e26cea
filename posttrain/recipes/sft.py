"""Supervised fine-tuning: assistant-only loss, packing, LoRA, exact resume.

Per optimizer step:
    1. data     take `batch_size` rows (packed rows or single samples), cut into micro-batches
    2. forward  log p(target) at loss positions only (chunked lm_head)
    3. loss     −Σ log p / (loss tokens in the whole step)  -> accumulation == one large batch
    4. update   clip grad norm, AdamW step, schedule step
    5. log      metrics.jsonl (+ eval loss, held-out pass@1 with `eval_tasks`, samples, checkpoints at their intervals)

Under `torchrun --nproc-per-node W -m posttrain sft …` the model is sharded with FSDP2 and each rank runs
its share of the step's micro-batches (accumulate_gradients: same loss and update as one process on
the same global batch); checkpoints are distributed (DCP) and resume at any world size.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import Field

from posttrain.config import CommonConfig, parse_args
from posttrain.data import formats
from posttrain.data.packing import Batch, collate, pack_groups
from posttrain.data.templates import TemplateError, Tokenized, check_template, render_row, render_text
from posttrain.errors import UserError
from posttrain.eval.hook import EvalHook, EvalSettings
from posttrain.models.device import resolve_device, synchronize
from posttrain.models.forward import token_logprobs
from posttrain.models.loading import load_model, load_tokenizer
from posttrain.models.lora import LoraSettings, memory_savers, trainable_fraction
from posttrain.monitor.metrics import PhaseTimer
from posttrain.outputs import to_json
from posttrain.plan.measure import Measured, write_plan
from posttrain.rollout.backends import build_backend
from posttrain.rollout.engine import EngineConfig
from posttrain.systems import dist, fsdp
from posttrain.training import run as training_run
from posttrain.training.data_order import EpochSampler
from posttrain.training.epochs import resolve_max_steps
from posttrain.training.lifecycle import RunLifecycle
from posttrain.training.loop import CheckpointArgs, run_loop
from posttrain.training.optim import OptimSettings, build_optimizer, optimizer_step
from posttrain.training.plan import measured_plan, planned_tokens, predict_run
from posttrain.training.run import seed_everything

SFT_FORMATS = ("conversation", "prompt_completion", "text")
PROBE_TEXT = Path(__file__).resolve().parent.parent / "assets" / "probe.txt"


class SFTConfig(CommonConfig):
    """posttrain sft: supervised fine-tuning with assistant-only loss."""

    data: str = Field("arithmetic", description="dataset (messages | prompt+completion | text), file, folder or task")
    output_dir: str = Field("runs/sft", description="run directory")
    max_steps: int = Field(50, ge=0, description="optimizer steps (or give epochs)")
    epochs: float | None = Field(None, gt=0, description="passes over the training rows (packed rows when packing): sets "
                                                         "max_steps = ceil(epochs x rows / batch_size); give one of the two")
    dtype: str = Field("float32", description="training dtype: float32 | bfloat16")
    max_length: int = Field(1024, ge=8, description="maximum tokens per sample, and per packed row")
    too_long: str = Field("error", pattern="^(error|drop)$", description="a sample over max_length: error (refuse) | drop")
    packing: bool = Field(True, description="pack samples into rows of max_length (attention never crosses samples)")
    batch_size: int = Field(8, ge=1, description="rows per optimizer step (packed rows when packing, else samples)")
    micro_batch_size: int = Field(2, ge=1, description="rows per forward/backward (gradient accumulation = batch/micro)")
    optim: OptimSettings = Field(default_factory=OptimSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    eval_data: str = Field("", description="held-out data file; empty: split eval_fraction off the training data")
    eval_fraction: float = Field(0.05, ge=0, lt=1, description="share of rows held out for eval loss when eval_data is empty")
    eval_every: int = Field(25, ge=0, description="eval loss every N steps (0: only at the end)")
    eval_max_rows: int = Field(64, ge=1, description="at most this many eval samples per evaluation")
    eval_tasks: EvalSettings = Field(default_factory=EvalSettings,
                                     description="held-out problems sampled and verified every eval_every steps (eval/pass@1 with its interval)")
    forgetting_probe: bool = Field(True, description="loss on an unrelated held-out text before and after training")
    sample_every: int = Field(25, ge=0, description="write a few greedy generations to samples.jsonl every N steps (0: off)")
    sample_count: int = Field(2, ge=0, description="generations per sampling")
    sample_max_tokens: int = Field(48, ge=1, description="new tokens per generation in samples.jsonl")
    save_every: int = Field(50, ge=0, description="checkpoint every N steps (0: only the final model)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    pad_to_multiple_of: int = Field(64, ge=1, description="round each micro-batch's row width up to this (few shapes: oneDNN reuses its bf16 kernels)")
    logit_chunk: int = Field(1024, ge=1, description="rows of lm_head computed at once")
    progress: bool = Field(True, description="show a progress bar")


# ---------------------------------------------------------------- data


def tokenize_rows(tok, rows: list[formats.Row], fmt: str, cfg: SFTConfig) -> list[Tokenized]:
    """Render every row; refuse (or drop) samples over max_length, naming the row."""
    out = []
    for row in rows:
        try:
            sample = render_row(tok, row.data, fmt)
        except TemplateError as e:
            raise row.error("messages" if fmt == "conversation" else None, str(e)) from None
        if sum(sample.loss_mask[1:]) == 0:
            raise row.error(None, "nothing to train on after rendering (no completion tokens)")
        if len(sample) > cfg.max_length:
            if cfg.too_long == "drop":
                continue
            raise row.error(None, f"{len(sample)} tokens > max_length={cfg.max_length} (raise max_length or set too_long=drop)")
        out.append(sample)
    return out


def make_units(samples: list[Tokenized], cfg: SFTConfig) -> list[list[Tokenized]]:
    """The things the sampler draws: packed rows (lists of samples) or single samples."""
    if not cfg.packing:
        return [[s] for s in samples]
    groups = pack_groups([len(s) for s in samples], cfg.max_length)
    return [[samples[i] for i in g] for g in groups]


def micro_batches(units: list[list[Tokenized]], size: int, pad_id: int, packed: bool, multiple: int = 1,
                  device: str | torch.device = "cpu") -> list[Batch]:
    return [collate(units[i : i + size], pad_id, packed, multiple).to(device) for i in range(0, len(units), size)]


def load_data(tok, cfg: SFTConfig) -> tuple[list[Tokenized], list[Tokenized], list[dict]]:
    """(train samples, eval samples, eval conversations for sampling)."""
    rows, fmt = formats.load(cfg.data, allowed=SFT_FORMATS, seed=cfg.seed)
    check_template(tok, rows)
    if cfg.eval_data:
        eval_rows, eval_fmt = formats.load(cfg.eval_data, allowed=SFT_FORMATS, seed=cfg.seed)
        check_template(tok, eval_rows)
    else:
        g = torch.Generator().manual_seed(cfg.seed + 7)
        order = torch.randperm(len(rows), generator=g).tolist()
        n_eval = int(len(rows) * cfg.eval_fraction)
        eval_rows, eval_fmt = [rows[i] for i in order[:n_eval]], fmt
        rows = [rows[i] for i in sorted(order[n_eval:])]
    train = tokenize_rows(tok, rows, fmt, cfg)
    if rows and not train:  # too_long=drop dropped every sample
        raise UserError(f"{cfg.data}: every one of its {len(rows)} training samples is longer than max_length="
                        f"{cfg.max_length} tokens and too_long=drop dropped them all: raise max_length")
    evals = tokenize_rows(tok, eval_rows, eval_fmt, cfg)[: cfg.eval_max_rows]
    convs = [c for c in (conversation_of(r.data, eval_fmt) for r in eval_rows) if c][: cfg.sample_count]
    return train, evals, convs


def conversation_of(data: dict, fmt: str) -> list[dict] | None:
    """The conversation of a row for samples.jsonl: `messages`, or a conversational prompt + completion."""
    if fmt == "conversation":
        return data["messages"]
    if fmt == "prompt_completion" and isinstance(data["prompt"], list) and isinstance(data["completion"], list):
        return data["prompt"] + data["completion"]
    return None


# ---------------------------------------------------------------- evaluation helpers


@torch.no_grad()
def mean_nll(model, samples: list[Tokenized], pad_id: int, cfg: SFTConfig, info: dist.DistInfo | None = None) -> float:
    """Mean negative log-likelihood per loss token over `samples` (a sharded model: every rank calls it)."""
    if not samples:
        return float("nan")
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    batches = micro_batches([[s] for s in samples], cfg.micro_batch_size, pad_id, packed=False, device=device)
    info = info or dist.DistInfo()
    for b, w in dist.rank_share(batches, info):  # one process: every batch, weight 1
        logp, _ = fsdp.apply(model, token_logprobs, b, chunk=cfg.logit_chunk, mixed_precision=cfg.mixed_precision)
        total, count = total - w * float(logp.sum()), count + w * logp.numel()
    total, count = dist.global_sum([total, count], info)  # every rank ran the same number of forwards
    model.train()
    return total / max(count, 1)


def task_eval(hook: EvalHook, model, tok, cfg: SFTConfig, step: int) -> dict:
    """Held-out pass@1 (and pass@k) from samples of the current weights (posttrain.eval.hook).
    The backend (cfg.backend) is built on first use and samples the current weights (LoRA: adapter applied)."""
    if hook.backend is None:
        seqs = min(64, len(hook.rows) * hook.settings.n)
        hook.backend = build_backend(cfg.backend, model, tok, EngineConfig(max_num_seqs=seqs, kv_cache_mb=256, seed=cfg.seed),
                                     model_name=cfg.model, dtype=cfg.dtype)
    model.eval()
    try:
        return hook.maybe(hook.backend, step, last=True)
    finally:
        model.train()


def probe_samples(tok) -> list[Tokenized]:
    return [render_text(tok, p.strip()) for p in PROBE_TEXT.read_text().split("\n") if p.strip()]


@torch.no_grad()
def write_samples(model, tok, convs: list[list[dict]], step: int, path: Path, max_tokens: int) -> None:
    model.eval()
    with path.open("a") as f:
        for conv in convs:
            prompt = conv[: max(i for i, m in enumerate(conv) if m["role"] == "assistant")]
            ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            enc = tok(ids, add_special_tokens=False, return_tensors="pt").to(next(model.parameters()).device)
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            completion = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            f.write(to_json({"step": step, "prompt": ids, "completion": completion, "reference": conv[len(prompt)]["content"]}) + "\n")
    model.train()


# ---------------------------------------------------------------- training


def accumulate_gradients(model, batches: list[Batch], chunk: int = 1024, mixed_precision: str = "none",
                         info: dist.DistInfo | None = None) -> float:
    """Backward of −Σ log p / N over all micro-batches, N = loss tokens of the whole step.

    Dividing by the step's token count (not each micro-batch's) makes accumulation over any split
    give exactly the gradient of one large batch. Under torchrun each rank backpropagates its share of
    the micro-batches (`rank_share`: one process gets every one with weight 1; weight-0 padding keeps the
    ranks in step) and N is summed over the ranks once, so W ranks take the step one process takes.
    Returns the step loss (summed over ranks)."""
    info = info or dist.DistInfo()
    local = dist.rank_share(batches, info)
    (n_loss,) = dist.global_sum([sum(b.num_loss_tokens for b, w in local if w)], info)  # the one reduction
    scale = getattr(model, "loss_scale", 1.0)  # sharded: FSDP averages gradients over ranks, W x is a sum
    total = torch.zeros((), device=batches[0].input_ids.device)
    for b, w in local:
        logp, _ = fsdp.apply(model, token_logprobs, b, chunk=chunk, mixed_precision=mixed_precision)
        loss = -logp.sum() / n_loss * w
        (loss * scale).backward()
        total += loss.detach()
    (loss_sum,) = dist.global_sum([float(total)], info)  # for the log only
    return loss_sum


def sft_update(model, optimizer, scheduler, batches: list[Batch], cfg: SFTConfig, info: dist.DistInfo,
               timer: PhaseTimer) -> tuple[float, torch.Tensor]:
    """Steps 2-4: forward + backward normalised over the whole step (this rank's share under torchrun),
    clip, AdamW, schedule."""
    with timer("forward_backward"):
        loss_sum = accumulate_gradients(model, batches, cfg.logit_chunk, cfg.mixed_precision, info)
    with timer("update"):
        grad_norm = optimizer_step(model, optimizer, cfg.optim.max_grad_norm, scheduler)
        synchronize(batches[0].input_ids.device)  # CUDA runs asynchronously: the step's kernels finish inside its timing
    return loss_sum, grad_norm


def init_ranks(cfg: SFTConfig) -> dist.DistInfo:
    """torchrun's ranks (world size 1 without it); refuses what a sharded run cannot do yet."""
    return training_run.init_ranks([(cfg.lora.enabled, "lora"), (bool(cfg.eval_tasks.data), "eval_tasks")],
                                   hint="run it in one process")


@dataclass(eq=False)
class SFTRun:
    """Everything a step needs, built once by `setup`."""

    cfg: SFTConfig
    life: RunLifecycle
    tok: object
    train: list[Tokenized]
    evals: list[Tokenized]
    sample_convs: list[list[dict]]
    eval_hook: EvalHook
    units: list[list[Tokenized]]
    no_eval: str  # why there is no eval loss ("" when there is one)
    model: torch.nn.Module  # the trained model (under torchrun: its FSDP root)
    optimizer: object
    scheduler: object
    sampler: EpochSampler
    device: torch.device
    info: dist.DistInfo
    trainable: int
    total: int
    summary: dict = field(default_factory=dict)  # probe losses (checkpointed), then the run's summary
    metrics: object = None
    measured: Measured = field(default_factory=Measured)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    tokens_seen: int = 0  # this session
    t_run: float = 0.0


def setup(cfg: SFTConfig) -> SFTRun:
    """Data checked and tokenized before the model loads; then the model, optimizer, resume and the plan."""
    device = resolve_device(cfg.device)  # refuse an unusable device before any work
    info = init_ranks(cfg)
    device = dist.rank_device(device, info)
    life = RunLifecycle(cfg, info)
    seed_everything(cfg.seed)
    tok = load_tokenizer(cfg.model, cfg.chat_template, cfg.chat_template_args)
    train_samples, eval_samples, sample_convs = load_data(tok, cfg)  # refuses bad data before any model work
    eval_hook = EvalHook(cfg.eval_tasks, tok, eval_every=cfg.eval_every)  # held-out problems: checked now too
    units = make_units(train_samples, cfg)
    steps_note = resolve_max_steps(cfg, len(units), cfg.batch_size, "packed rows" if cfg.packing else "samples", life)
    no_eval = no_eval_reason(cfg, len(train_samples)) if not eval_samples else ""
    if life.main:  # (eval_fraction=0 without eval_data is a choice, rs's for one: nothing to say)
        for line in (steps_note, no_eval and (cfg.eval_data or cfg.eval_fraction) and f"eval: none will run, {no_eval}"):
            if line:
                print(line, flush=True)

    measured = Measured()  # RSS baseline before the model exists
    model = load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed, device=device)
    model = memory_savers(model, cfg.lora, cfg.gradient_checkpointing)
    model.train()
    trainable, total = trainable_fraction(model)
    inner, model = model, (fsdp.shard_model(model) if info.world > 1 else model)  # inner: the HF model
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    run = SFTRun(cfg, life, tok, train_samples, eval_samples, sample_convs, eval_hook, units, no_eval, model, optimizer,
                 scheduler, EpochSampler(len(units), cfg.seed), device, info, trainable, total, measured=measured)

    state = life.restore(model, optimizer, scheduler)
    run.summary = state.get("summary", {})
    if state:
        run.sampler.load(state["sampler"], cfg.data)
    elif cfg.forgetting_probe:
        run.summary["probe_loss_before"] = mean_nll(model, probe_samples(tok), tok.pad_token_id, cfg, info)
    if life.main:
        write_plan(life.out, plan_run(cfg, inner, units, run.sampler, cfg.max_steps - life.start, measure=info.world == 1))
    run.metrics = life.metrics()
    life.fresh_file("samples.jsonl")
    return run


def sft_step(run: SFTRun, step: int) -> dict:
    """One optimizer step (0-based `step`); returns the metrics row it logged."""
    cfg, timer, pad_id = run.cfg, run.timer, run.tok.pad_token_id
    t0 = time.perf_counter()
    # 1. data
    with timer("data"):
        step_units = [run.units[i] for i in run.sampler.take(cfg.batch_size)]
        batches = micro_batches(step_units, cfg.micro_batch_size, pad_id, cfg.packing, cfg.pad_to_multiple_of, run.device)
        n_loss = sum(b.num_loss_tokens for b in batches)
    # 2-4. forward + loss normalised over the whole step, update
    lr = run.scheduler.get_last_lr()[0]
    loss_sum, grad_norm = sft_update(run.model, run.optimizer, run.scheduler, batches, cfg, run.info, timer)
    # 5. log
    n_tok = sum(b.num_tokens for b in batches)
    n_pad = sum(b.num_padding for b in batches)
    run.tokens_seen += n_tok
    run.measured.add_step(n_tok)
    dt = time.perf_counter() - t0
    row = {
        "loss": loss_sum, "lr": lr, "grad_norm": grad_norm, "tokens": n_tok, "loss_tokens": n_loss,
        "padding_tokens": n_pad, "padding_fraction": n_pad / (n_tok + n_pad), "tokens_per_s": n_tok / dt, "epoch": run.sampler.epoch,
        **timer.pop(),
    }
    run.measured.add_phases(row)  # plan.json's phase_seconds (the time/* keys)
    done = step + 1
    if run.evals and (done == cfg.max_steps or (cfg.eval_every and done % cfg.eval_every == 0)):
        row["eval/loss"] = mean_nll(run.model, run.evals, pad_id, cfg, run.info)
    if run.eval_hook.due(done, last=done == cfg.max_steps):
        row.update(task_eval(run.eval_hook, run.model, run.tok, cfg, done))
    if cfg.sample_every and run.sample_convs and run.info.world == 1 and (done % cfg.sample_every == 0 or done == cfg.max_steps):
        write_samples(run.model, run.tok, run.sample_convs, done, run.life.out / "samples.jsonl", cfg.sample_max_tokens)
    return run.metrics.write(done, row)


def checkpoint_args(run: SFTRun) -> CheckpointArgs:
    return CheckpointArgs(run.model, run.optimizer, run.scheduler, {"sampler": run.sampler.state(), "summary": run.summary},
                          tok=run.tok)


def train(cfg: SFTConfig) -> dict:
    """Run SFT; returns the summary written to the report (rank 0; other ranks of a sharded run: {})."""
    run = setup(cfg)
    run.t_run = time.perf_counter()
    run_loop(run.life, cfg, lambda step: sft_step(run, step), lambda: checkpoint_args(run), desc="sft",
             postfix=lambda row: {"loss": f"{row['loss']:.4f}", "lr": f"{row['lr']:.2e}"})
    return finish(run)


def finish(run: SFTRun) -> dict:
    """The forgetting probe after training, final/, summary.json and the report."""
    cfg, life, summary = run.cfg, run.life, run.summary
    if cfg.forgetting_probe:
        summary["probe_loss_after"] = mean_nll(run.model, probe_samples(run.tok), run.tok.pad_token_id, cfg, run.info)
        if "probe_loss_before" in summary:
            summary["probe_loss_delta"] = summary["probe_loss_after"] - summary["probe_loss_before"]
    life.save_final(run.model, run.tok, lora=cfg.lora.enabled)
    if not life.main:
        return {}
    rows = life.history()
    summary.update({
        "steps": cfg.max_steps,
        "trainable_params": run.trainable,
        "total_params": run.total,
        "trainable_fraction": run.trainable / run.total,
        "train_samples": len(run.train),
        "train_rows": len(run.units),
        "eval_samples": len(run.evals),
        "first_loss": rows[0]["loss"] if rows else math.nan,
        "last_loss": rows[-1]["loss"] if rows else math.nan,
        "final_eval_loss": rows[-1].get("eval/loss") if rows and run.evals else None,
        "eval": run.no_eval or f"eval loss on {len(run.evals)} held-out samples",
        "padding_fraction": sum(r["padding_tokens"] for r in rows) / max(1, sum(r["tokens"] + r["padding_tokens"] for r in rows)),
        "wall_seconds_this_session": time.perf_counter() - run.t_run,
        "tokens_this_session": run.tokens_seen,
        "world_size": run.info.world,
    })
    plan = measured_plan(life.out, run.measured)
    life.finish(summary, f"SFT — {cfg.model}", {"summary": summary, "plan vs measured": plan_comparison(plan)})
    summary["plan_vs_measured"] = plan_comparison(plan)
    return summary


def no_eval_reason(cfg: SFTConfig, train_samples: int) -> str:
    """Why a run has no eval rows, and what gives it some."""
    if cfg.eval_data:
        return f"eval_data={cfg.eval_data} gave no samples within max_length={cfg.max_length}"
    if cfg.eval_fraction == 0:
        return "eval_fraction=0 (set eval_data=FILE or eval_fraction>0 for an eval loss)"
    if train_samples < 2:  # one row cannot be split: eval_fraction < 1
        return f"the data is too small: {train_samples} row cannot be split (set eval_data=FILE for an eval loss)"
    return (f"the data is too small: eval_fraction={cfg.eval_fraction:g} of {train_samples} rows rounds down to none "
            f"(set eval_data=FILE, or an eval_fraction of at least {1 / train_samples:.2g})")


def plan_run(cfg: SFTConfig, model, units: list[list[Tokenized]], sampler: EpochSampler, steps: int,
             measure: bool = False) -> dict:
    """The planner's prediction for this run, plus the exact token count of the data plan.

    The sampler is deterministic, so the rows of every remaining step are known before training:
    `data_plan.tokens` is what the trainer will count, to the token.
    """
    pred = predict_run(cfg, model, "sft", steps=steps, batch=cfg.batch_size, seq_len=cfg.max_length,
                       micro_batch=cfg.micro_batch_size, measure_activations=measure)
    per_step = planned_tokens(sampler, steps, cfg.batch_size, [sum(len(s) for s in u) for u in units])
    pred["data_plan"] = {"steps": steps, "tokens": sum(per_step), "tokens_per_step_mean": sum(per_step) / max(steps, 1)}
    return pred


def plan_comparison(plan: dict) -> dict:
    pred, meas = plan["predicted"], plan["measured"]
    return {
        "tokens predicted (data plan)": pred["data_plan"]["tokens"],
        "tokens counted": meas["tokens"],
        "flops predicted": None if pred.get("flops_per_token") is None else pred["flops_per_token"] * pred["data_plan"]["tokens"],
        "peak memory predicted (bytes)": pred["peak_bytes_estimate"],
        "peak RSS growth measured (bytes)": meas["peak_rss_growth_bytes"],
        "seconds measured": meas["seconds"],
        "achieved FLOP/s": meas.get("achieved_flops_per_second"),
    }


def main(argv: list[str]) -> None:
    cfg = parse_args(SFTConfig, argv, prog="posttrain sft")
    summary = train(cfg)
    if not summary:  # ranks > 0 of a torchrun run
        return
    keys = ("first_loss", "last_loss", "final_eval_loss", "probe_loss_delta", "padding_fraction")
    print("  ".join(f"{k}={summary[k]:.4f}" for k in keys if isinstance(summary.get(k), (int, float))))
    if summary["eval_samples"] == 0:
        print(f"no eval was run: {summary['eval']}")
    print(f"run directory: {cfg.output_dir} (report.html, metrics.jsonl, final/)")
