"""Offline preference optimisation: `posttrain dpo loss=<name>` for every loss of
`posttrain.algos.preference_losses` (dpo, robust_dpo, ipo, kto, orpo, simpo, rpo, dpo_norm = LN-DPO).

Before the first step, once:
    reference   log π_ref of every training and held-out sequence (and of KTO's mismatched pairs),
                computed with the policy itself before it is updated (full fine-tuning) or with its
                LoRA adapter disabled; cached in `reference.json` (counter: once per sequence, no second
                model). orpo and simpo have no reference: nothing is computed.
Per optimizer step (`dpo_step`; the phase names are the timer names):
    1. data       `batch_size` pairs (KTO: unpaired examples; paired data is unpaired as TRL does)
    2. kl         KTO only: the reference point z0 = max(0, mean log π_θ(y_j|x_i) − log π_ref(y_j|x_i))
                  over mismatched pairs of the batch (x_i with the previous example's completion),
                  detached (Ethayarajh et al. 2024 §4.1)
    3. forward_backward   one packed forward per micro-batch: each prompt once, chosen and rejected
                  after it (shared-prefix attention) -> summed completion log-probs; loss from the
                  registry; Σ loss / (pairs in the step), so any micro-batch split is the same gradient
    4. update     clip, AdamW, schedule
    5. log        rewards/chosen|rejected|margins|accuracies, logps/*, kl (implicit KL estimate),
                  logratio/*; at eval steps the held-out preference accuracy and the length probe;
                  alarms: likelihood displacement, length growth (monitor/preference_alarms.py)

Under `torchrun --nproc-per-node W -m posttrain dpo …` the policy is sharded with FSDP2
(posttrain/systems/fsdp.py): each rank runs its share of the step's micro-batches (Σ loss / pairs of the
whole step, so W ranks give one process's update), the no-grad passes (reference, held-out evaluation,
KTO's z0) run on every rank alike, and checkpoints are distributed (DCP) and resume at any world size.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import time
from dataclasses import dataclass, field

import torch
from pydantic import Field, model_validator

from posttrain.algos import preference_losses
from posttrain.config import CommonConfig, parse_args
from posttrain.data.preference import TokenizedPair, load_split
from posttrain.data.prefix_batch import micro_batches
from posttrain.data.special_tokens import mask_special, special_token_ids
from posttrain.errors import UserError
from posttrain.models.device import resolve_device, synchronize
from posttrain.models.loading import load_model, load_tokenizer
from posttrain.models.lora import LoraSettings, memory_savers, trainable_fraction
from posttrain.monitor.metrics import PhaseTimer
from posttrain.monitor.preference_alarms import PreferenceAlarms
from posttrain.plan.measure import Measured, write_plan
from posttrain.recipes.length_probe import LengthProbe, LengthProbeSettings
from posttrain.recipes.reference_cache import ReferenceCache, fingerprint, reference_mode, sequence_logps
from posttrain.systems import dist as ranks  # `dist` is torch.distributed in Meter.reduce
from posttrain.systems import fsdp
from posttrain.training import run as training_run
from posttrain.training.data_order import EpochSampler
from posttrain.training.epochs import resolve_max_steps
from posttrain.training.lifecycle import RunLifecycle
from posttrain.training.loop import CheckpointArgs, run_loop
from posttrain.training.optim import OptimSettings, build_optimizer, optimizer_step
from posttrain.training.plan import measured_plan, predict_run
from posttrain.training.run import seed_everything

FILLED_BY_RECIPE = ("chosen_lengths", "rejected_lengths", "kl")  # loss arguments the recipe passes itself


def loss_keywords(name: str) -> set[str]:
    fn = preference_losses.get(name)
    return {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


class DPOConfig(CommonConfig):
    """posttrain dpo: offline preference optimisation (DPO, IPO, robust DPO, KTO, ORPO, SimPO, RPO, LN-DPO)."""

    data: str = Field("", description="preference data {prompt, chosen, rejected} (or implicit prompt {chosen, rejected}); kto also {prompt, completion, label}")
    output_dir: str = Field("runs/dpo", description="run directory")
    loss: str = Field("dpo", description=f"preference loss: {', '.join(preference_losses.names())}")
    beta: float | None = Field(None, gt=0, description="β of the loss (None: the loss's default; orpo's weight is loss_args.lam)")
    loss_args: dict = Field(default_factory=dict, description="other keyword arguments of the loss, e.g. {label_smoothing: 0.1}, {gamma: 0.5}")
    max_steps: int = Field(100, ge=0, description="optimizer steps (or give epochs)")
    epochs: float | None = Field(None, gt=0, description="passes over the training pairs (kto: examples): sets max_steps = "
                                                         "ceil(epochs x pairs / batch_size); give one of the two")
    dtype: str = Field("float32", description="training dtype: float32 | bfloat16")
    batch_size: int = Field(8, ge=1, description="pairs per optimizer step (kto: examples)")
    micro_batch_tokens: int = Field(4096, ge=64, description="tokens per forward/backward (whole pairs; each prompt counted once)")
    max_length: int = Field(1024, ge=8, description="maximum tokens of prompt + completion")
    too_long: str = Field("error", pattern="^(error|drop)$", description="an example over max_length: error (refuse) | drop")
    mask_special_tokens: bool = Field(False, description="leave the tokenizer's special/template tokens (<|eot_id|>, <|im_end|>, "
                                      "headers) out of the chosen and rejected log-prob sums (Llama 3's DPO recipe)")
    optim: OptimSettings = Field(default_factory=lambda: OptimSettings(lr=1e-6, warmup_ratio=0.1))
    lora: LoraSettings = Field(default_factory=LoraSettings)
    eval_data: str = Field("", description="held-out preference data; empty: split eval_fraction off the training data")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="share of pairs held out when eval_data is empty")
    eval_every: int = Field(25, ge=0, description="held-out preference accuracy (and the length probe) every N steps (0: start and end only)")
    length_probe: LengthProbeSettings = Field(default_factory=LengthProbeSettings)
    displacement_patience: int = Field(3, ge=1, description="steps in a row with chosen and rejected log-probs both below the reference before the alarm")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    pad_to_multiple_of: int = Field(64, ge=1, description="round each packed row up to this many tokens (few shapes: oneDNN reuses its kernels)")
    progress: bool = Field(True, description="show a progress bar")

    @model_validator(mode="after")
    def _check_loss(self):
        accepted = loss_keywords(self.loss) - set(FILLED_BY_RECIPE)  # raises for an unknown loss
        unknown = sorted(set(self.loss_args) - accepted)
        if unknown:
            raise ValueError(f"loss_args {unknown} are not arguments of preference loss '{self.loss}' (it takes {sorted(accepted)})")
        if self.beta is not None and "beta" not in accepted:
            raise ValueError(f"preference loss '{self.loss}' has no beta (it takes {sorted(accepted)})")
        if self.loss == "kto" and self.batch_size < 2:
            raise ValueError("kto estimates its reference point from mismatched pairs of the batch: batch_size >= 2")
        return self


@dataclass(eq=False)
class DPORun:
    cfg: DPOConfig
    life: RunLifecycle
    tok: object
    train: list[TokenizedPair]
    evals: list[TokenizedPair]
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    sampler: EpochSampler
    loss_fn: object
    loss_args: dict
    ref: ReferenceCache | None  # None: reference-free loss (orpo, simpo)
    device: torch.device
    models_loaded: int = 1
    probe: LengthProbe | None = None
    reference_length: float | None = None
    initial_eval: dict = field(default_factory=dict)
    alarms: PreferenceAlarms = field(default_factory=PreferenceAlarms)
    metrics: object = None
    measured: Measured = field(default_factory=Measured)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    info: ranks.DistInfo = field(default_factory=ranks.DistInfo)

    @property
    def unpaired(self) -> bool:
        return not preference_losses.meta(self.cfg.loss).get("paired", True)


# ---------------------------------------------------------------- the loss of a micro-batch


class Meter:
    """Metrics averaged over examples across micro-batches; NaN (an empty side of a KTO batch) is skipped."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict, weight: float) -> None:
        for k, v in metrics.items():
            v = float(v)
            if not math.isnan(v):
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def result(self) -> dict:
        return {k: self.sums[k] / self.weights[k] for k in self.sums}

    def reduce(self, info: ranks.DistInfo) -> None:
        """Sums and weights over ranks (a rank that ran only padding has no keys: the union is gathered)."""
        if info.world == 1:
            return
        import torch.distributed as dist

        names: list = [None] * info.world
        dist.all_gather_object(names, sorted(self.sums))
        keys = sorted(set().union(*names))
        totals = ranks.global_sum([self.sums.get(k, 0.0) for k in keys] + [self.weights.get(k, 0.0) for k in keys], info)
        self.sums = dict(zip(keys, totals[: len(keys)]))
        self.weights = dict(zip(keys, totals[len(keys):]))


def preference_loss(run: DPORun, logps, lengths, split: str, ids: list[int], examples: list[TokenizedPair],
                    z0: float | None = None):
    """Per-example losses (B,) and metrics of one micro-batch: logps (S,) in sequence order."""
    lengths = lengths.to(logps.dtype)
    if examples[0].label is None:  # pairs: sequences alternate chosen, rejected
        pc, pr, lc, lr = logps[0::2], logps[1::2], lengths[0::2], lengths[1::2]
        keys_c, keys_r = [(split, i, 0) for i in ids], [(split, i, 1) for i in ids]
    else:  # unpaired (KTO): desirable examples play "chosen", undesirable ones "rejected"
        d = [k for k, e in enumerate(examples) if e.label]
        u = [k for k, e in enumerate(examples) if not e.label]
        pc, pr, lc, lr = logps[d], logps[u], lengths[d], lengths[u]
        keys_c, keys_r = [(split, ids[k], 0) for k in d], [(split, ids[k], 0) for k in u]
    rc = rr = None
    if run.ref is not None:
        rc, rr = run.ref.get(keys_c, logps.device), run.ref.get(keys_r, logps.device)
    params = loss_keywords(run.cfg.loss)
    kwargs = dict(run.loss_args)
    kwargs.update({k: v for k, v in (("chosen_lengths", lc), ("rejected_lengths", lr), ("kl", z0 or 0.0)) if k in params})
    loss, m = run.loss_fn(pc, pr, rc, rr, **kwargs)
    if rc is not None:
        wc, wr = (pc - rc).detach(), (pr - rr).detach()  # log π_θ − log π_ref per sequence
        m["logratio/chosen"], m["logratio/rejected"] = wc.mean(), wr.mean()
        if examples[0].label is None and "rewards/accuracies" not in m:  # kto on held-out pairs
            m["rewards/accuracies"] = (wc > wr).float().mean()
        if examples[0].label is not None:  # unpaired: does the implicit reward's sign match the label?
            m["label_accuracy"] = torch.cat([(wc > 0).float(), (wr < 0).float()]).mean()
    return loss, m


# ---------------------------------------------------------------- reference


def kl_pairs(ids: list[int]) -> list[tuple[int, int]]:
    """KTO's mismatched pairs: prompt of example k with the completion of example k−1 (TRL's shift)."""
    return [(ids[k], ids[k - 1]) for k in range(len(ids))]


def reference_entries(run: DPORun, plan: list[list[int]]) -> list:
    """(keys, (prompt ids, continuations)) of every sequence whose reference log-prob the run needs."""
    out = [([("train", i, k) for k in range(len(e.continuations))], (e.prompt_ids, e.continuations))
           for i, e in enumerate(run.train)]
    out += [([("eval", i, k) for k in range(len(e.continuations))], (e.prompt_ids, e.continuations))
            for i, e in enumerate(run.evals)]
    if run.unpaired:  # the mismatched pairs of every planned batch
        seen = set()
        for ids in plan:
            for i, j in kl_pairs(ids):
                if (i, j) not in seen:
                    seen.add((i, j))
                    out.append(([("kl", i, j)], (run.train[i].prompt_ids, [run.train[j].continuations[0]])))
    return out


def prepare_reference(run: DPORun) -> None:
    """Fill the cache before the first update (or reuse the run directory's cache on resume)."""
    cfg = run.cfg
    plan_sampler = copy.deepcopy(run.sampler)
    plan = [plan_sampler.take(cfg.batch_size) for _ in range(run.life.start, cfg.max_steps)]
    entries = reference_entries(run, plan)
    path = run.life.out / "reference.json"
    fp = fingerprint([group for keys, group in entries if keys[0][0] != "kl"])  # the data, not the plan
    run.ref.load(path, fp)
    missing = run.ref.missing(entries)
    if missing and run.life.resuming and not cfg.lora.enabled:
        raise UserError(f"{len(missing)} sequences need reference log-probs that {path} lacks, and under full "
                        "fine-tuning the reference (the initial weights) is gone: resume with the same data and max_steps")
    run.ref.fill(run.model, entries, run.tok.pad_token_id, cfg.micro_batch_tokens, cfg.mixed_precision,
                 cfg.pad_to_multiple_of)
    if run.life.main:
        run.ref.save(path, fp)


@torch.no_grad()
def kto_reference_point(run: DPORun, ids: list[int]) -> float:
    """z0 = max(0, mean over mismatched pairs of log π_θ(y_j|x_i) − log π_ref(y_j|x_i)), detached."""
    pairs = kl_pairs(ids)
    keys = [("kl", i, j) for i, j in pairs]
    groups = [(run.train[i].prompt_ids, [run.train[j].continuations[0]]) for i, j in pairs]
    if run.ref.missing([([k], g) for k, g in zip(keys, groups)]):  # LoRA past the planned steps: base model
        run.ref.fill(run.model, [([k], g) for k, g in zip(keys, groups)], run.tok.pad_token_id,
                     run.cfg.micro_batch_tokens, run.cfg.mixed_precision, run.cfg.pad_to_multiple_of)
    total = 0.0
    run.model.eval()
    for batch, idx in micro_batches(groups, run.tok.pad_token_id, run.cfg.micro_batch_tokens,
                                    run.cfg.pad_to_multiple_of, run.device):
        logps = fsdp.apply(run.model, sequence_logps, batch, run.cfg.mixed_precision)
        total += float((logps - run.ref.get([keys[j] for j in idx], logps.device)).sum())
    run.model.train()
    return max(0.0, total / len(pairs))


# ---------------------------------------------------------------- one step


def accumulate(run: DPORun, ids: list[int], z0: float | None) -> tuple[float, dict, int, int]:
    """Backward of Σ_examples loss / n over the step's micro-batches -> (loss, metrics, tokens computed,
    sequence tokens: each sequence with its own prompt, what the planner counts). Sharded: this rank's
    share of the micro-batches (weight 0: padding that keeps the ranks' forwards in step), sums reduced."""
    cfg = run.cfg
    examples = [run.train[i] for i in ids]
    meter, total, computed, seq_tokens = Meter(), 0.0, 0, 0
    scale = getattr(run.model, "loss_scale", 1.0)  # FSDP averages gradients over ranks: W x makes it a sum
    mbs = list(micro_batches([(e.prompt_ids, e.continuations) for e in examples], run.tok.pad_token_id,
                             cfg.micro_batch_tokens, cfg.pad_to_multiple_of, run.device))
    for (batch, idx), w in ranks.rank_share(mbs, run.info):
        logps = fsdp.apply(run.model, sequence_logps, batch, cfg.mixed_precision)  # (S,)
        loss, m = preference_loss(run, logps, batch.loss_tokens, "train", [ids[j] for j in idx],
                                  [examples[j] for j in idx], z0)
        loss = loss.sum() / len(ids) * w
        (loss * scale if scale != 1.0 else loss).backward()
        if not w:
            continue
        total += float(loss.detach())
        meter.add(m, len(idx))
        computed += batch.num_tokens
        seq_tokens += sum(len(examples[j].prompt_ids) * len(examples[j].continuations) + sum(map(len, examples[j].continuations))
                          for j in idx)
    meter.reduce(run.info)
    total, computed, seq_tokens = ranks.global_sum([total, computed, seq_tokens], run.info)
    return total, meter.result(), int(computed), int(seq_tokens)


def dpo_step(run: DPORun, step: int) -> dict:
    """One optimizer step; returns the metrics row it logged."""
    cfg, timer = run.cfg, run.timer
    t0 = time.perf_counter()
    # 1. data
    with timer("data"):
        ids = run.sampler.take(cfg.batch_size)
    # 2. KTO's reference point
    z0 = None
    if run.unpaired:
        with timer("kl"):
            z0 = kto_reference_point(run, ids)
    # 3. forward + loss + backward
    with timer("forward_backward"):
        loss, metrics, computed, seq_tokens = accumulate(run, ids, z0)
    # 4. update
    with timer("update"):
        lr = run.scheduler.get_last_lr()[0]
        grad_norm = optimizer_step(run.model, run.optimizer, cfg.optim.max_grad_norm, run.scheduler)
        synchronize(run.device)
    dt = time.perf_counter() - t0
    run.measured.add_step(seq_tokens)
    row = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "examples": len(ids), "tokens": computed,
           "sequence_tokens": seq_tokens, "examples_per_s": len(ids) / dt, "tokens_per_s": computed / dt,
           **({"kto/z0": z0} if z0 is not None else {}), **metrics, **timer.pop()}
    return log_step(run, step, row)


def log_step(run: DPORun, step: int, row: dict) -> dict:
    cfg, done = run.cfg, step + 1
    if done == cfg.max_steps or (cfg.eval_every and done % cfg.eval_every == 0):
        row.update(evaluate(run))
        row.update(measure_length(run))
    row.update(run.alarms.update(done, row))
    return run.metrics.write(done, row)


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(run: DPORun) -> dict:
    """Held-out loss and preference accuracy (the loss's own reward: implicit β·log-ratio, or the
    length-normalised log-prob of orpo/simpo); unpaired held-out data: label accuracy."""
    if not run.evals:
        return {}
    cfg, meter = run.cfg, Meter()
    run.model.eval()
    groups = [(e.prompt_ids, e.continuations) for e in run.evals]
    for batch, idx in micro_batches(groups, run.tok.pad_token_id, cfg.micro_batch_tokens, cfg.pad_to_multiple_of, run.device):
        logps = fsdp.apply(run.model, sequence_logps, batch, cfg.mixed_precision)
        loss, m = preference_loss(run, logps, batch.loss_tokens, "eval", idx, [run.evals[j] for j in idx], 0.0)
        meter.add({"loss": loss.mean(), **m}, len(idx))
    run.model.train()
    res = meter.result()
    out = {"eval/loss": res["loss"]}
    for name, key in (("eval/accuracy", "rewards/accuracies"), ("eval/margin", "rewards/margins"),
                      ("eval/label_accuracy", "label_accuracy"), ("eval/logratio_chosen", "logratio/chosen"),
                      ("eval/logratio_rejected", "logratio/rejected")):
        if key in res:
            out[name] = res[key]
    return out


def measure_length(run: DPORun) -> dict:
    if run.probe is None:
        return {}
    with run.timer("length_probe"):
        policy = run.probe.measure()
    return {"length/policy": policy, "length/reference": run.reference_length,
            "length/ratio": policy / max(run.reference_length, 1e-9)}


# ---------------------------------------------------------------- run


def setup(cfg: DPOConfig) -> DPORun:
    """Data checked and tokenized before any model loads; then the model, the reference cache, the probe."""
    device = resolve_device(cfg.device)
    info = init_ranks(cfg)
    device = ranks.rank_device(device, info)
    life = RunLifecycle(cfg, info)
    seed_everything(cfg.seed)
    tok = load_tokenizer(cfg.model, cfg.chat_template, cfg.chat_template_args)
    unpaired = not preference_losses.meta(cfg.loss).get("paired", True)
    train, evals = load_split(tok, cfg.data, cfg.eval_data, cfg.eval_fraction, cfg.seed, cfg.max_length, cfg.too_long,
                              unpaired_ok=unpaired, unpair_train=unpaired)
    if cfg.mask_special_tokens:  # Llama 3 §4.1.4: special/template tokens out of the loss
        special = special_token_ids(tok)
        train, evals = mask_special(train, special), mask_special(evals, special)
    note = resolve_max_steps(cfg, len(train), cfg.batch_size, "examples" if unpaired else "pairs", life)
    if note and info.main:
        print(note, flush=True)
    measured = Measured()
    model = load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed, device=device)
    model = memory_savers(model, cfg.lora, cfg.gradient_checkpointing)
    model.train()
    inner, model = model, (fsdp.shard_model(model) if info.world > 1 else model)  # inner: the HF model
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    loss_args = dict(cfg.loss_args) | ({"beta": cfg.beta} if cfg.beta is not None else {})
    uses_ref = preference_losses.meta(cfg.loss).get("reference", True)
    run = DPORun(cfg, life, tok, train, evals, model, optimizer, scheduler, EpochSampler(len(train), cfg.seed),
                 preference_losses.get(cfg.loss), loss_args, ReferenceCache() if uses_ref else None, device,
                 alarms=PreferenceAlarms(cfg.displacement_patience, cfg.length_probe.alarm_ratio,
                                         stream=None if info.main else open(os.devnull, "w")), measured=measured,
                 info=info)
    state = life.restore(model, optimizer, scheduler)
    if state:
        run.sampler.load(state["sampler"], cfg.data)
        run.alarms.load(state.get("alarms", {}))
        run.initial_eval = state.get("initial_eval", {})
    if run.ref is not None:
        with run.timer("reference"):
            prepare_reference(run)
    if not state:
        run.initial_eval = evaluate(run)
    setup_probe(run, state)
    if life.main:
        write_plan(life.out, plan_run(cfg, inner, train))
    run.metrics = life.metrics()
    return run


def setup_probe(run: DPORun, state: dict) -> None:
    cfg = run.cfg
    if not cfg.length_probe.prompts:
        return
    prompts = [e.prompt_ids for e in (run.evals or run.train)]
    run.probe = LengthProbe(run.model, run.tok, prompts, cfg.length_probe, cfg.seed, backend=cfg.backend)
    run.reference_length = state.get("reference_length") if state else None
    if run.reference_length is None:
        if state and not cfg.lora.enabled:
            raise UserError("the checkpoint has no reference length and the reference weights are gone")

        with reference_mode(run.model):
            run.reference_length = run.probe.measure()


def checkpoint_state(run: DPORun) -> dict:
    return {"sampler": run.sampler.state(), "alarms": run.alarms.state(), "reference_length": run.reference_length,
            "initial_eval": run.initial_eval}


def checkpoint_args(run: DPORun) -> CheckpointArgs:
    return CheckpointArgs(run.model, run.optimizer, run.scheduler, checkpoint_state(run), tok=run.tok)


def finish(run: DPORun) -> dict:
    cfg, life = run.cfg, run.life
    life.save_final(run.model, run.tok, lora=cfg.lora.enabled)
    if not life.main:
        return {}
    plan = measured_plan(life.out, run.measured)
    history = life.history()
    evals = [r for r in history if "eval/accuracy" in r or "eval/label_accuracy" in r]
    trainable, total = trainable_fraction(run.model)
    summary = {
        "loss": cfg.loss, "steps": cfg.max_steps, "train_examples": len(run.train), "eval_examples": len(run.evals),
        "first_loss": history[0]["loss"] if history else math.nan, "last_loss": history[-1]["loss"] if history else math.nan,
        **{f"{k}_before": v for k, v in run.initial_eval.items()},
        **({f"{k}_after": v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {}),
        **(run.ref.stats() if run.ref is not None else {"reference/sequences": 0}),
        "models_loaded": run.models_loaded, "trainable_params": trainable, "total_params": total,
        "alarms_fired": run.alarms.fired,
        "tokens predicted (plan)": plan["predicted"]["tokens_per_step"] * (cfg.max_steps - life.start),
        "sequence tokens counted": plan["measured"]["tokens"],
    }
    life.finish(summary, f"{cfg.loss} — {cfg.model}", {"summary": summary, "plan vs measured": plan.get("comparison", {})})
    return summary


def plan_run(cfg: DPOConfig, model, train: list[TokenizedPair]) -> dict:
    """The planner's `dpo` (reference log-probs precomputed, not held) for the data's mean sequence length."""
    seqs = [len(e.prompt_ids) + len(c) for e in train for c in e.continuations]
    seq_len = max(1, round(sum(seqs) / len(seqs)))
    per_pair = max(1, round(sum(len(e) for e in train) / len(train)))
    micro = max(1, min(2 * cfg.batch_size, 2 * (cfg.micro_batch_tokens // per_pair)))
    return predict_run(cfg, model, "dpo", steps=cfg.max_steps, batch=cfg.batch_size, seq_len=seq_len, micro_batch=micro,
                       precompute_ref=True)


def init_ranks(cfg: DPOConfig) -> ranks.DistInfo:
    """torchrun's ranks (world size 1 without it); refuses what a sharded run cannot do yet."""
    return training_run.init_ranks([(cfg.lora.enabled, "lora"),
                                    (cfg.length_probe.prompts > 0, "the length probe (length_probe.prompts=0)")])


def train(cfg: DPOConfig) -> dict:
    """Run the preference optimisation; returns the summary (rank 0; other ranks of a sharded run: {})."""
    run = setup(cfg)
    run_loop(run.life, cfg, lambda step: dpo_step(run, step), lambda: checkpoint_args(run), desc=f"dpo/{cfg.loss}",
             postfix=lambda row: {"loss": f"{row['loss']:.4f}"})
    return finish(run)


def main(argv: list[str]) -> None:
    cfg = parse_args(DPOConfig, argv, prog="posttrain dpo")
    summary = train(cfg)
    if not summary:  # ranks > 0 of a torchrun run
        return
    acc = [(k, summary[k]) for k in ("eval/accuracy_before", "eval/accuracy_after") if k in summary]
    print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}"
          + "".join(f"; {k} {v:.3f}" for k, v in acc) + f"; run directory: {cfg.output_dir}")
