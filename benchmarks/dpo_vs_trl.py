"""DPO throughput and first-step loss: posttrain vs TRL's DPOTrainer, alternating step by step in one process.

Task: SmolLM2-135M-Instruct (fp32 weights, CPU) on --pairs arithmetic preference pairs built from the
built-in `arithmetic` task (prompt "What is a op b? Put the final answer in \\boxed{}.", chosen the worked
answer, rejected the same text with a wrong result), conversational. Same pairs *as tokens* on both sides:
posttrain tokenizes them (data/preference.py) and TRL's prepared dataset is replaced by those
prompt_ids / chosen_ids / rejected_ids in posttrain's order (TRL: train_sampling_strategy="sequential").
Settings, both sides: --batch pairs per optimizer step in one forward (TRL per_device_train_batch_size =
--batch, gradient_accumulation_steps = 1; posttrain micro_batch_tokens large enough), no truncation
(max_length 1024 > every pair), loss dpo (TRL "sigmoid"), β 0.1, AdamW (fused) lr 5e-7 linear to 0 over
--steps, no warmup, no weight decay, max_grad_norm 1, --precision fp32 (default) or bf16 (autocast,
fp32 weights; TRL bf16=True), no activation checkpointing (TRL's DPOConfig turns it on by default).
Reference: TRL's default (a second model, a reference forward every step; --trl-precompute: TRL's
precompute_ref_log_probs=True instead, its precompute time counted); posttrain computes the reference
log-probs once per pair before the first update (no second model) and that time is counted too, spread
over the pairs. --trl-defaults keeps TRL's own DPOConfig defaults for everything but the task.

The sides alternate: a TRL callback runs one posttrain step (`dpo.dpo_step`) at every TRL step end. The
first --warmup steps of each side are not timed. Prints per-step times, the first-step DPO loss and
log-probs of both sides (fp32: they agree within 1e-4), the per-phase table of both sides
(benchmarks/phases.py: reference, forward, backward, optimizer, other; achieved FLOP/s against the matmul peak
measured in the run; posttrain's reference pass runs before training and is shown per step), then
`speedup: N.NNx` in pairs/s. --profile DIR writes a torch profiler trace of the last warm-up step of each side (untimed).

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/dpo_vs_trl.py [--steps 12] [--warmup 2] [--batch 8] [--precision fp32|bf16] [--threads 1]
        [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("POSTTRAIN_NO_PROGRESS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# posttrain's huge pages for large CPU tensors (posttrain/__init__.py), set before torch loads. Process-wide:
# the competitor gets them too (a conservative ratio); THP_MEM_ALLOC_ENABLE=0 runs both sides without.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch
from phases import Allocator, PhaseClock, Trace, alternate, as_json, body_params, flops_forward, measure_peak, stock_model, table

MODEL = "smollm2-135m-instruct"
LR, BETA = 5e-7, 0.1


def arithmetic_pairs(n: int) -> list[dict]:
    """Chosen: the task's worked answer; rejected: the same text with the result off by 1–9."""
    from posttrain.data.tasks import generate

    pairs = []
    for i, row in enumerate(generate(f"arithmetic:{n}")):
        good = row["messages"][1]["content"]
        wrong = str(int(row["answer"]) + 1 + i % 9)
        bad = re.sub(rf"(= |boxed{{){re.escape(row['answer'])}", lambda m, w=wrong: m.group(1) + w, good)
        pairs.append({"prompt": row["prompt"], "chosen": [{"role": "assistant", "content": good}],
                      "rejected": [{"role": "assistant", "content": bad}]})
    return pairs


def posttrain_run(args, data: str, out: str):
    from posttrain.config import parse_args
    from posttrain.recipes import dpo

    cfg = parse_args(dpo.DPOConfig, [
        f"model={args.model}", f"data={data}", f"output_dir={out}", f"max_steps={args.steps}", f"seed={args.seed}",
        "loss=dpo", f"beta={BETA}", f"batch_size={args.batch}", "micro_batch_tokens=65536", "max_length=1024",
        f"optim.lr={LR}", "optim.schedule=linear", "optim.warmup_steps=0", "optim.warmup_ratio=0", "optim.min_lr_ratio=0",
        "optim.weight_decay=0", "optim.max_grad_norm=1.0", "eval_fraction=0", "eval_every=0", "length_probe.prompts=0",
        "progress=false", "device=cpu", f"mixed_precision={'bf16' if args.precision == 'bf16' else 'none'}",
    ])
    return dpo.setup(cfg)


def trl_args(args, out: str):
    from trl import DPOConfig

    task = dict(output_dir=out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                max_length=1024, learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0, max_steps=args.steps,
                seed=args.seed, beta=BETA, loss_type=["sigmoid"], train_sampling_strategy="sequential",
                logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
                disable_tqdm=True, precompute_ref_log_probs=args.trl_precompute)
    equal = dict(bf16=args.precision == "bf16", gradient_checkpointing=False, optim="adamw_torch_fused",
                 weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8)
    return DPOConfig(**task, **({} if args.trl_defaults else equal))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps of each side (the lr schedule spans them)")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each side left out of the timing")
    p.add_argument("--batch", type=int, default=8, help="pairs per optimizer step, one forward")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--trl-precompute", action="store_true", help="TRL precompute_ref_log_probs=True (no reference model)")
    p.add_argument("--trl-defaults", action="store_true", help="TRL with its DPOConfig defaults for everything but the task")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/dpo_vs_trl.json")
    p.add_argument("--model", default=MODEL, help="both sides (tiny-random: a smoke test of the benchmark itself)")
    p.add_argument("--profile", default=None, metavar="DIR", help="torch profiler traces of the last warm-up step of each side (needs --warmup >= 1)")
    Allocator.add_flag(p)
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must be larger than --warmup")
    torch.set_num_threads(args.threads)

    import datasets
    from transformers.trainer_callback import PrinterCallback
    from trl import DPOTrainer

    from posttrain.models.loading import load_tokenizer
    from posttrain.recipes import dpo
    from posttrain.training.data_order import EpochSampler

    n = args.batch * args.steps  # one epoch: every pair once on each side
    print(f"threads={args.threads} model={args.model} pairs={n} batch={args.batch} steps={args.steps} warmup={args.warmup} "
          f"precision={args.precision} trl_precompute={args.trl_precompute} trl_defaults={args.trl_defaults} shared_malloc={args.shared_malloc}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        pairs = arithmetic_pairs(n)
        data = Path(tmp) / "pairs.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in pairs))
        t0 = time.perf_counter()
        run = posttrain_run(args, str(data), f"{tmp}/posttrain")
        pt_setup = time.perf_counter() - t0
        order = EpochSampler(len(run.train), args.seed).take(n)
        tokens = [{"prompt_ids": run.train[i].prompt_ids, "chosen_ids": run.train[i].continuations[0].input_ids,
                   "rejected_ids": run.train[i].continuations[1].input_ids} for i in order]
        assert all(all(c.loss_mask) for e in run.train for c in e.continuations)  # TRL trains every completion token

        trl_precompute_s = [0.0]
        if args.trl_precompute:
            original = DPOTrainer._precompute_ref_logps

            def timed(self, *a, **k):
                t = time.perf_counter()
                out = original(self, *a, **k)
                trl_precompute_s[0] += time.perf_counter() - t
                return out

            DPOTrainer._precompute_ref_logps = timed

        clock, trace = PhaseClock(), Trace(args.profile)
        malloc = Allocator(args.shared_malloc)

        def trl_metrics():  # TRL's mean log-probs of each step, to compare the first with posttrain's
            m = trainer._metrics["train"]
            alt.trl_logps.append((m["logps/chosen"][-1], m["logps/rejected"][-1]))

        alt = alternate(clock, trace, malloc, args.warmup, lambda i: dpo.dpo_step(run, i), after_trl=trl_metrics)
        alt.trl_logps = []
        ds = datasets.Dataset.from_list([pairs[i] for i in order])
        policy = stock_model(args.model)
        # TRL builds its reference from the policy's path; a model built from a config (tiny-random) has none
        ref = None if policy.name_or_path or args.trl_precompute else stock_model(args.model)
        trainer = DPOTrainer(model=policy, ref_model=ref, args=trl_args(args, f"{tmp}/trl"), train_dataset=ds,
                             processing_class=load_tokenizer(args.model), callbacks=[alt])
        trainer.remove_callback(PrinterCallback)
        if not args.trl_precompute:  # the same tokens on both sides
            trainer.train_dataset = datasets.Dataset.from_list(tokens)
        else:
            same = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trainer.train_dataset]
            print(f"TRL's own tokenization equals posttrain's: {same == [tuple(t.values()) for t in tokens]}")
        instrument(clock, run, trainer)
        peak = measure_peak("bf16" if args.precision == "bf16" else "fp32", args.threads)
        try:
            trainer.train()
        finally:
            clock.restore()
        history = trainer.state.log_history
    # posttrain's reference pass ran once before training: its share per timed step, FLOPs of one forward per pair
    clock.seconds["posttrain"]["reference"] += run.ref.seconds * (args.steps - args.warmup) / args.steps
    clock.flops["posttrain"]["reference"] += clock.flops["posttrain"].get("forward", 0.0)
    for side in ("trl", "posttrain"):  # backward: twice the policy forward (grads of inputs and of weights)
        clock.flops[side]["backward"] = 2 * clock.flops[side].get("forward", 0.0)
    print("\n" + table(clock, ["trl", "posttrain"], peak))
    report(args, alt, history, run, n, pt_setup, trl_precompute_s[0], as_json(clock, ["trl", "posttrain"], peak))


def instrument(clock: PhaseClock, run, trainer) -> None:
    """Time both sides' phases (benchmarks/phases.py) and count their FLOPs from the shapes each computes."""
    from posttrain.recipes import dpo

    n_body, vh = body_params(run.model), run.model.get_output_embeddings().weight.numel()

    def pt_forward(a, k, out):  # one packed forward per micro-batch: each prompt once, both completions
        examples = [run.train[i] for i in a[1]]
        completions = sum(len(c.input_ids) for e in examples for c in e.continuations)
        return flops_forward(n_body, vh, sum(len(e.prompt_ids) for e in examples) + completions, completions)

    def trl_forward(a, k, out):  # padded (2B, T) rows: prompt repeated for chosen and rejected, logits everywhere
        ids = a[1]["input_ids"]
        return flops_forward(n_body, vh, ids.numel(), ids.numel())

    clock.hook_torch()
    clock.wrap(dpo, "accumulate", "forward", pt_forward)
    clock.wrap(trainer, "compute_loss", "forward", trl_forward)
    if getattr(trainer, "ref_model", None) is not None:  # TRL's default: a reference forward every step
        clock.wrap(trainer.ref_model, "forward", "reference", lambda a, k, out: trl_forward((None, k), {}, out))


def report(args, alt, history, run, n: int, pt_setup: float, trl_precompute: float, phases: dict) -> None:
    w, b = args.warmup, args.batch
    ref_s = run.ref.seconds  # posttrain's reference pass over all n pairs, before training
    pt_time = sum(alt.pt[w:]) + ref_s * (args.steps - w) / args.steps
    trl_time = sum(alt.trl[w:]) + trl_precompute * (args.steps - w) / args.steps
    pairs = b * (args.steps - w)
    trl_loss = next(h["loss"] for h in history if h.get("step") == 1 and "loss" in h)
    pt_loss = alt.pt_rows[0]["loss"]
    pt_lp = (alt.pt_rows[0]["logps/chosen"], alt.pt_rows[0]["logps/rejected"])
    results = {
        "trl": {"pairs_per_s": pairs / trl_time, "step_s": alt.trl, "median_step_s": statistics.median(alt.trl[w:]),
                "precompute_s": trl_precompute, "first_loss": trl_loss, "first_logps": alt.trl_logps[0],
                "version": __import__("trl").__version__},
        "posttrain": {"pairs_per_s": pairs / pt_time, "step_s": alt.pt, "median_step_s": statistics.median(alt.pt[w:]),
                      "reference_s": ref_s, "setup_s": pt_setup, "first_loss": pt_loss, "first_logps": pt_lp,
                      "reference": run.ref.stats()},
        "phases": phases,
        "loss_by_step": {"trl": [h["loss"] for h in history if "loss" in h], "posttrain": [r["loss"] for r in alt.pt_rows]},
    }
    speedup = results["posttrain"]["pairs_per_s"] / results["trl"]["pairs_per_s"]
    results["speedup_pairs_per_s"] = speedup
    d_loss = abs(trl_loss - pt_loss)
    d_lp = max(abs(x - y) / max(abs(x), 1) for x, y in zip(alt.trl_logps[0], pt_lp))
    print(f"\nfirst-step DPO loss: trl {trl_loss:.6f}  posttrain {pt_loss:.6f}  |Δ| {d_loss:.2e} "
          f"({'agree' if d_loss < 1e-4 else 'DIFFER'} within 1e-4)")
    print(f"first-step mean log-probs (chosen, rejected): trl ({alt.trl_logps[0][0]:.4f}, {alt.trl_logps[0][1]:.4f})  "
          f"posttrain ({pt_lp[0]:.4f}, {pt_lp[1]:.4f})  max relative |Δ| {d_lp:.2e}")
    print(f"loss by step  trl {['%.4f' % x for x in results['loss_by_step']['trl'][:4]]}  "
          f"posttrain {['%.4f' % x for x in results['loss_by_step']['posttrain'][:4]]}")
    print(f"{'side':10s} {'pairs/s':>8s} {'median s/step':>14s} {'reference s':>12s}")
    print(f"{'trl':10s} {results['trl']['pairs_per_s']:8.2f} {results['trl']['median_step_s']:14.2f} "
          f"{trl_precompute if args.trl_precompute else float('nan'):12.2f}")
    print(f"{'posttrain':10s} {results['posttrain']['pairs_per_s']:8.2f} {results['posttrain']['median_step_s']:14.2f} {ref_s:12.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), **results}, indent=1, default=float))
    print(f"speedup: {speedup:.2f}x")


if __name__ == "__main__":
    main()
