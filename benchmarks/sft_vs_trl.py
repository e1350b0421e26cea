"""SFT training throughput: posttrain vs TRL's SFTTrainer, side by side in one run.

Same model (SmolLM2-135M-Instruct, fp32 weights, CPU), same data (the built-in arithmetic conversations),
same packing (best-fit decreasing into rows of --max-length tokens, attention kept inside samples),
same rows per step (--batch) and per forward (--micro), same optimizer (AdamW, same lr), same
precision (--precision fp32: everything fp32; bf16: torch.autocast bf16 on both sides, which is
TRL's default `bf16=True`), no activation checkpointing on either side (TRL's SFTConfig turns it on
by default; --trl-defaults keeps TRL's defaults instead, for reference).
Both are timed per optimizer step after --warmup steps; tokens are real (non-padding) tokens. The two
sides run alternately --repeats times and the best run of each is compared.
Also prints the raw forward+backward rate of the bare HF model on one packed row as the ceiling, and the
per-phase table of both sides (benchmarks/phases.py: forward, backward, optimizer, other; achieved FLOP/s
against the matmul peak measured in the run). --profile DIR writes a torch profiler trace of the last warm-up step of each side (untimed).

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/sft_vs_trl.py [--steps 6] [--max-length 512] [--repeats 2] [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("POSTTRAIN_NO_PROGRESS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# posttrain's huge pages for large CPU tensors (posttrain/__init__.py), set before torch loads. Process-wide:
# the competitor gets them too (a conservative ratio); THP_MEM_ALLOC_ENABLE=0 runs both sides without.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch
from phases import Allocator, PhaseClock, Trace, as_json, body_params, flops_forward, measure_peak, stock_model, table

MODEL = "smollm2-135m-instruct"
CLOCK, TRACE = PhaseClock(), Trace(None)


def instrument_posttrain(args) -> None:
    """Step boundaries and the forward of posttrain's SFT step (backward/optimizer: PhaseClock.hook_torch)."""
    from posttrain.recipes import sft

    step_fn = sft.sft_step

    def timed_step(run, step):
        if not hasattr(run, "_bench_sizes"):
            run._bench_sizes = (body_params(run.model), run.model.get_output_embeddings().weight.numel())
            CLOCK.wrap(sft, "token_logprobs", "forward", lambda a, k, out: flops_forward(
                *run._bench_sizes, a[1].input_ids.numel(), a[1].num_loss_tokens))
        if step == args.warmup - 1:  # the last warm-up step: the trace does not skew the timing
            TRACE.start("posttrain")
        with CLOCK.step("posttrain", counting=step >= args.warmup):
            row = step_fn(run, step)
        TRACE.stop()
        return row

    sft.sft_step = timed_step
    CLOCK._undo.append(lambda: setattr(sft, "sft_step", step_fn))


def run_posttrain(args, data_rows) -> dict:
    from posttrain.config import parse_args
    from posttrain.recipes import sft

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        data.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in data_rows))
        cfg = parse_args(sft.SFTConfig, [
            f"model={args.model}", f"data={data}", f"output_dir={tmp}/run", f"max_steps={args.steps + args.warmup}",
            f"batch_size={args.batch}", f"micro_batch_size={args.micro}", f"max_length={args.max_length}",
            "optim.lr=2e-5", "optim.warmup_steps=0", "eval_fraction=0", "eval_every=0", "sample_every=0",
            "save_every=0", "forgetting_probe=false", "progress=false",
            f"mixed_precision={'bf16' if args.precision == 'bf16' else 'none'}",
        ])
        instrument_posttrain(args)
        try:
            sft.train(cfg)
        finally:
            CLOCK.restore()
            CLOCK.hook_torch()
        rows = [json.loads(l) for l in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in rows)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def run_trl(args, data_rows) -> dict:
    import datasets
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from posttrain.models.loading import load_tokenizer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.records = []

        def on_step_begin(self, a, state, control, **kw):
            if len(self.records) == args.warmup - 1:  # the last warm-up step: the trace does not skew the timing
                TRACE.start("trl")
            CLOCK.start("trl", counting=len(self.records) >= args.warmup)
            self.t0, self.seen0 = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, a, state, control, **kw):
            self.records.append((time.perf_counter() - self.t0, state.num_input_tokens_seen - self.seen0))
            CLOCK.stop()
            TRACE.stop()

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        ds = datasets.Dataset.from_list([{"messages": r["messages"]} for r in data_rows])
        targs = SFTConfig(
            output_dir=tmp, max_steps=args.steps + args.warmup, per_device_train_batch_size=args.micro,
            gradient_accumulation_steps=args.batch // args.micro, packing=True, max_length=args.max_length,
            learning_rate=2e-5, lr_scheduler_type="cosine", warmup_steps=0, logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, dataloader_num_workers=0, include_num_input_tokens_seen="non_padding",
            assistant_only_loss=False, seed=0, disable_tqdm=True,
            **({} if args.trl_defaults else {"bf16": args.precision == "bf16", "gradient_checkpointing": False}),
        )
        trainer = SFTTrainer(model=stock_model(args.model), args=targs, train_dataset=ds,
                             processing_class=load_tokenizer(args.model), callbacks=[timer])
        sizes = body_params(trainer.model), trainer.model.get_output_embeddings().weight.numel()
        CLOCK.wrap(trainer, "compute_loss", "forward",  # HF's loss: logits at every position
                   lambda a, k, out: flops_forward(*sizes, a[1]["input_ids"].numel(), a[1]["input_ids"].numel()))
        try:
            trainer.train()
        finally:
            CLOCK.restore()
            CLOCK.hook_torch()
    recs = timer.records[args.warmup:]
    tokens = sum(t for _, t in recs)
    seconds = sum(s for s, _ in recs)
    return {"tokens": int(tokens), "seconds": seconds, "tokens_per_s": tokens / seconds}


def raw_rate(args) -> dict:
    """The bare model: forward (HF loss over all positions) + backward on one full packed row, no optimizer."""

    model = stock_model(args.model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.max_length))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    best = min(times)
    return {"tokens": args.max_length, "seconds": best, "tokens_per_s": args.max_length / best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (oneDNN builds its bf16 kernels on first use)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="packed rows per optimizer step")
    p.add_argument("--micro", type=int, default=2, help="packed rows per forward/backward")
    p.add_argument("--rows", type=int, default=600, help="conversations in the dataset")
    p.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; the best of each is compared")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="both sides: fp32, or bf16 autocast")
    p.add_argument("--trl-defaults", action="store_true", help="TRL with its own defaults (bf16 autocast + activation checkpointing)")
    p.add_argument("--out", default="")
    p.add_argument("--model", default=MODEL, help="both sides (tiny-random: a smoke test of the benchmark itself)")
    p.add_argument("--profile", default=None, metavar="DIR", help="torch profiler traces of the last warm-up step of each side (needs --warmup >= 1)")
    Allocator.add_flag(p)
    args = p.parse_args()
    TRACE.folder = args.profile
    CLOCK.hook_torch()
    peak = measure_peak("bf16" if args.precision == "bf16" else "fp32", torch.get_num_threads())
    from posttrain.data.tasks import generate

    data_rows = generate(f"arithmetic:{args.rows}")
    args.out = args.out or f"benchmarks/results/sft_vs_trl_{args.precision}{'_trl_defaults' if args.trl_defaults else ''}.json"
    print(f"threads={torch.get_num_threads()} model={args.model} max_length={args.max_length} batch={args.batch} micro={args.micro} "
          f"precision={args.precision} trl_defaults={args.trl_defaults} shared_malloc={args.shared_malloc}", flush=True)
    results = {"raw_forward_backward": raw_rate(args)}
    print(f"raw fwd+bwd   {results['raw_forward_backward']['tokens_per_s']:8.1f} tok/s", flush=True)
    runs = {"posttrain": [], "trl": []}
    malloc = Allocator(args.shared_malloc)
    for _ in range(args.repeats):  # alternate, so a noisy stretch of the shared machine hits both sides
        for name, fn in (("posttrain", run_posttrain), ("trl", run_trl)):
            malloc.side(name)
            runs[name].append(fn(args, data_rows))
            print(f"{name:13s} {runs[name][-1]['tokens_per_s']:8.1f} tok/s", flush=True)
    for name, rs in runs.items():
        results[name] = max(rs, key=lambda r: r["tokens_per_s"]) | {"all_tokens_per_s": [r["tokens_per_s"] for r in rs]}
    ratio = results["posttrain"]["tokens_per_s"] / results["trl"]["tokens_per_s"]
    results["ratio_posttrain_over_trl"] = ratio
    results["posttrain_over_raw"] = results["posttrain"]["tokens_per_s"] / results["raw_forward_backward"]["tokens_per_s"]
    results["trl_over_raw"] = results["trl"]["tokens_per_s"] / results["raw_forward_backward"]["tokens_per_s"]
    for side in ("trl", "posttrain"):  # backward: twice the forward (grads of inputs and of weights)
        CLOCK.flops[side]["backward"] = 2 * CLOCK.flops[side].get("forward", 0.0)
    print("\n" + table(CLOCK, ["trl", "posttrain"], peak))
    results["phases"] = as_json(CLOCK, ["trl", "posttrain"], peak)
    print(f"\nposttrain / TRL = {ratio:.2f}x   (posttrain at {results['posttrain_over_raw']:.2f} of raw, TRL at {results['trl_over_raw']:.2f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), **results}, indent=1))


if __name__ == "__main__":
    main()
