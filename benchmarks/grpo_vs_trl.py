"""GRPO step time and reward: posttrain vs TRL's GRPOTrainer, alternating step by step in one process.

Task: SmolLM2-135M-Instruct (fp32 weights, CPU) on single-digit addition ("What is a + b? Answer with
just the number.", built-in `single_digit_add:2000`), reward `math` in `last_number` mode (the same
function object on both sides: posttrain's reward is TRL-compatible). Settings, both sides:
4 prompts x 8 samples per step (TRL: num_generations=8, per_device_train_batch_size=32 completions,
gradient_accumulation_steps=1, so one generation batch of 32 completions per optimizer step), at most
24 new tokens, temperature 1, top_p 1, top_k off, AdamW (fused) lr 5e-6 linear to 0 over --steps,
no warmup, no weight decay, max_grad_norm 1, beta 0 (no reference model), one PPO epoch (TRL
num_iterations=1), PPO clip 0.2, group-std advantages, per-sequence token-mean loss averaged over the
sequences (posttrain grpo = seq_mean_token_mean; TRL loss_type="grpo" with the whole step in one
micro-batch), no activation checkpointing, --precision bf16 (default: autocast bf16, fp32 weights;
posttrain mixed_precision=bf16, TRL bf16=True) or fp32. Both sides see the same prompts in the same
order: TRL's dataset is posttrain's prompt order (its EpochSampler), unshuffled. posttrain runs with its default
zero_advantage=forward: a group whose rewards are all equal (advantages exactly 0, no gradient at beta 0) gets a
no-grad forward for its metrics and no backward; the update and the metrics are those of backwarding it
(tests/test_rl_zero_advantage.py). TRL backwards every group; --zero-advantage train makes posttrain do the same.
--trl-defaults keeps TRL's own GRPOConfig defaults for everything but the task (model, data, reward,
batch shape, generation limit and sampling, lr and its schedule, steps, seed); the changes are printed.

The sides alternate: a TRL callback runs one posttrain step (`rl.rl_step`) at every TRL step end.
posttrain's step time is the wall time of rl_step; TRL's is the time between its step ends minus the
posttrain step inside. The first --warmup steps of each side are not timed (oneDNN kernel builds,
first-call costs). Prints mean/median s/step, both rewards per step, the last-5-steps mean reward, and
finally `speedup: N.NNx` (TRL median s/step / posttrain median s/step). Before it, the per-phase table of
both sides (benchmarks/phases.py: generate, reward, old/ref log-probs, forward, backward, optimizer, weight
sync, logging, other; seconds per step and achieved FLOP/s against the matmul peak measured in the run).
--profile DIR writes a torch profiler trace of the last warm-up step of each side (untimed).

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/grpo_vs_trl.py [--steps 20] [--warmup 2] [--precision bf16|fp32] [--trl-defaults]
        [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import os
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
PROMPTS, GROUP, MAX_NEW, LR = 4, 8, 24, 5e-6
REWARD_OPTIONS = {"math": {"mode": "last_number"}}


def posttrain_config(args, out_dir: str):
    from posttrain.recipes import rl

    return rl.RLConfig.model_validate({
        "model": args.model, "data": "single_digit_add:2000", "output_dir": out_dir, "max_steps": args.steps,
        "seed": args.seed, "algo": "grpo", "beta": 0.0, "reward": "math", "reward_args": REWARD_OPTIONS,
        "prompts_per_step": PROMPTS, "group_size": GROUP, "ppo_epochs": 1, "dtype": "float32",
        "mixed_precision": "bf16" if args.precision == "bf16" else "none", "device": "cpu",
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": MAX_NEW},
        "optim": {"lr": LR, "schedule": "linear", "warmup_steps": 0, "warmup_ratio": 0.0, "min_lr_ratio": 0.0,
                  "weight_decay": 0.0, "max_grad_norm": 1.0},
        "samples_per_log": 0, "progress": False,
        **({"engine": {"dtype": args.engine_dtype}} if args.engine_dtype else {}),
        "zero_advantage": getattr(args, "zero_advantage", "forward"),
    })


def trl_settings(args) -> tuple[dict, dict]:
    """(task settings, always passed; settings that make TRL match posttrain, dropped by --trl-defaults)."""
    task = dict(
        num_generations=GROUP, per_device_train_batch_size=PROMPTS * GROUP, gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0, max_steps=args.steps, seed=args.seed,
        shuffle_dataset=False,  # the dataset is already in posttrain's prompt order
        # run plumbing, no effect on the training maths
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False,
    )
    equal = dict(
        bf16=args.precision == "bf16", gradient_checkpointing=False, beta=0.0, num_iterations=1, epsilon=0.2,
        loss_type="grpo", scale_rewards="group", max_grad_norm=1.0, optim="adamw_torch_fused", weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
    )
    return task, equal


def default_changes(equal: dict) -> dict:
    """What --trl-defaults changes: {setting: (TRL default, the matched value)} where they differ."""
    from trl import GRPOConfig

    with tempfile.TemporaryDirectory() as tmp:
        defaults = GRPOConfig(output_dir=tmp, use_cpu=True, report_to="none")
    out = {}
    for k, v in equal.items():
        d = getattr(defaults, k)
        d = getattr(d, "value", d)  # enums (optim, scheduler)
        if d != v:
            out[k] = (d, v)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of each side (the lr schedule spans them)")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each side left out of the timing")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"], help="both sides: bf16 autocast | fp32")
    p.add_argument("--trl-defaults", action="store_true", help="TRL with its GRPOConfig defaults for everything but the task")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-dtype", default=None, choices=["float32", "bfloat16"],
                   help="posttrain's sampler precision (default: the run's, bf16 under --precision bf16)")
    p.add_argument("--zero-advantage", default="forward", choices=["forward", "skip", "train"],
                   help="posttrain's zero_advantage (default: its own default, forward = no backward for groups whose "
                        "advantages are all 0; train = backward every group, as TRL does)")
    p.add_argument("--out", default="benchmarks/results/grpo_vs_trl.json")
    p.add_argument("--model", default=MODEL, help="both sides (tiny-random: a smoke test of the benchmark itself)")
    p.add_argument("--profile", default=None, metavar="DIR", help="torch profiler traces of the last warm-up step of each side (needs --warmup >= 1)")
    Allocator.add_flag(p)
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must be larger than --warmup")
    torch.set_num_threads(args.threads)

    import datasets
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.models.loading import load_tokenizer
    from posttrain.recipes import rl
    from posttrain.rewards.registry import compose
    from posttrain.training.data_order import EpochSampler

    task, equal = trl_settings(args)
    changed = default_changes(equal) if args.trl_defaults else {}
    print(f"threads={args.threads} model={args.model} steps={args.steps} warmup={args.warmup} precision={args.precision} "
          f"trl_defaults={args.trl_defaults} shared_malloc={args.shared_malloc}", flush=True)
    if changed:
        print("TRL defaults kept (default vs matched): "
              + ", ".join(f"{k}={d!r} (vs {v!r})" for k, (d, v) in changed.items()), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        run = rl.setup(posttrain_config(args, f"{tmp}/posttrain"))
        # TRL's dataset: the prompts posttrain's sampler will draw, in its order (no dynamic sampling: 4 per step)
        order = EpochSampler(len(run.rows), args.seed).take(PROMPTS * args.steps)
        ds = datasets.Dataset.from_list([{"prompt": run.rows[i].data["prompt"], "answer": run.rows[i].data["answer"]}
                                         for i in order])
        expected = [[run.rows[i].data["prompt"][-1]["content"] for i in order[k * PROMPTS:(k + 1) * PROMPTS]]
                    for k in range(args.steps)]

        reward = compose("math", options=REWARD_OPTIONS)
        trl_prompts: list[list[str]] = []

        def math(prompts, completions, **kw):  # the same reward; records TRL's prompts to check the order
            trl_prompts.append([pr[-1]["content"] for pr in prompts[::GROUP]])
            return reward(prompts, completions, **kw)

        clock, trace = PhaseClock(), Trace(args.profile)

        malloc = Allocator(args.shared_malloc)

        def rewards(row: dict) -> str:  # TRL logs this step's reward before the callback's step end
            return f"  reward trl {trainer._metrics['train']['reward'][-1]:.3f} posttrain {row['reward/mean']:.3f}"

        alt = alternate(clock, trace, malloc, args.warmup, lambda i: rl.rl_step(run, i), line=rewards)
        targs = GRPOConfig(output_dir=f"{tmp}/trl", **task, **({} if args.trl_defaults else equal))
        trainer = GRPOTrainer(model=stock_model(args.model), reward_funcs=[math], args=targs, train_dataset=ds,
                              processing_class=load_tokenizer(args.model), callbacks=[alt])
        trainer.remove_callback(PrinterCallback)  # our own per-step line instead of TRL's log dicts
        trl_gen: list[float] = []
        generate_and_score = trainer._generate_and_score_completions

        def timed_generate(*a, **kw):  # TRL's generation + scoring phase, for the breakdown
            t = time.perf_counter()
            out = generate_and_score(*a, **kw)
            trl_gen.append(time.perf_counter() - t)
            return out

        trainer._generate_and_score_completions = timed_generate
        instrument(clock, run, trainer)
        peak = measure_peak("bf16" if args.precision == "bf16" else "fp32", args.threads)
        try:
            trainer.train()
        finally:
            clock.restore()
        history = trainer.state.log_history

    w = args.warmup
    trl_rewards = [trl_reward_at(history, k + 1) for k in range(args.steps)]
    pt_rewards = [r["reward/mean"] for r in alt.pt_rows]

    def stats(times):
        return {"mean_s": statistics.fmean(times), "median_s": statistics.median(times), "timed_steps": len(times)}

    results = {
        "trl": {**stats(alt.trl[w:]), "step_s": alt.trl, "generate_s": trl_gen, "rewards": trl_rewards,
                "last5_reward": statistics.fmean(trl_rewards[-5:]), "version": __import__("trl").__version__},
        "posttrain": {**stats(alt.pt[w:]), "step_s": alt.pt, "generate_s": [r.get("time/generate") for r in alt.pt_rows],
                      "update_s": [r.get("time/update") for r in alt.pt_rows], "rewards": pt_rewards,
                      "last5_reward": statistics.fmean(pt_rewards[-5:])},
        "same_prompts": trl_prompts[: args.steps] == expected,
        "trl_defaults_changed": {k: {"trl_default": d, "matched": v} for k, (d, v) in changed.items()},
    }
    # backward: twice the training forwards that had one (grads of inputs and of weights); posttrain's no-grad
    # forwards of zero-advantage groups (zero_advantage=forward) have none
    clock.flops["trl"]["backward"] = 2 * clock.flops["trl"].get("forward", 0.0)
    clock.flops["posttrain"]["backward"] = 2 * clock.flops["posttrain"].get("forward with grad", 0.0)
    clock.flops["posttrain"].pop("forward with grad", None)
    print("\n" + table(clock, ["trl", "posttrain"], peak))
    results["phases"] = as_json(clock, ["trl", "posttrain"], peak)
    speedup = results["trl"]["median_s"] / results["posttrain"]["median_s"]
    results["speedup_median"] = speedup
    results["speedup_mean"] = results["trl"]["mean_s"] / results["posttrain"]["mean_s"]

    print(f"\n{'side':10s} {'mean s/step':>12s} {'median s/step':>14s} {'generate s':>11s} {'last-5 reward':>14s}")
    for name in ("trl", "posttrain"):
        r = results[name]
        gen = [g for g in r["generate_s"][w:] if g is not None]
        print(f"{name:10s} {r['mean_s']:12.2f} {r['median_s']:14.2f} {statistics.median(gen) if gen else float('nan'):11.2f} "
              f"{r['last5_reward']:14.3f}")
    print(f"same prompts in the same order: {results['same_prompts']}")
    print(f"speedup (mean s/step): {results['speedup_mean']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), **results}, indent=1))
    print(f"speedup: {speedup:.2f}x")


def instrument(clock: PhaseClock, run, trainer) -> None:
    """Time both sides' phases (benchmarks/phases.py) and count their FLOPs from the shapes each computes."""
    from posttrain.recipes.rl import phases as ph
    from posttrain.recipes.rl import step as rl_step_module

    n_body, vh = body_params(run.model), run.model.get_output_embeddings().weight.numel()

    def pt_generate(a, k, trajs):  # the engine prefills each group's prompt once, then decodes every sample
        prompts = {tuple(t.prompt_ids) for t in trajs}
        generated = sum(len(t.response_ids) for t in trajs)
        return flops_forward(n_body, vh, sum(map(len, prompts)) + generated, generated)

    def pt_forward(a, k, out):  # one packed row (shared prompt), logits only at the loss tokens
        flops = flops_forward(n_body, vh, a[1].input_ids.numel(), a[1].targets.numel())
        if torch.is_grad_enabled():  # a forward the backward will follow (not a zero-advantage group's)
            clock.add_flops("forward with grad", flops)
        return flops

    clock.hook_torch()
    clock.wrap(ph, "generate", "generate", pt_generate)
    clock.wrap(ph, "score", "reward")
    clock.wrap(ph, "reference_logps", "reference")
    clock.wrap(ph, "policy_logps", lambda c: c.parent() if c.parent() in ("reference", "kl probe") else "forward",
               pt_forward)
    clock.wrap(run.rollout, "sync_weights", "weight sync")
    clock.wrap(rl_step_module, "log_step", "logging")
    if run.drift is not None:
        clock.wrap(run.drift, "measure", "kl probe")

    def trl_generate(a, k, out):  # HF generate: a padded batch, every row decodes until the longest ends
        prompt_ids, completion_ids = out[0], out[1]
        rows, longest = len(prompt_ids), max(map(len, completion_ids))
        return flops_forward(n_body, vh, rows * (max(map(len, prompt_ids)) + longest), rows * longest)

    def trl_forward(a, k, out):  # padded (B, P + C) rows, logits for the last logits_to_keep positions
        ids, keep = a[1], a[3]
        return flops_forward(n_body, vh, ids.numel(), ids.shape[0] * keep)

    clock.wrap(trainer, "_generate_and_score_completions", "prepare")
    clock.wrap(trainer, "_generate", "generate", trl_generate)
    clock.wrap(trainer, "_calculate_rewards", "reward")
    clock.wrap(trainer, "compute_loss", "loss")
    clock.wrap(trainer, "_get_per_token_logps_and_entropies",
               lambda c: "forward" if c.parent() == "loss" else "old/ref log-probs", trl_forward)


def trl_reward_at(history: list[dict], step: int) -> float:
    for h in history:
        if h.get("step") == step and "reward" in h:
            return h["reward"]
    return float("nan")


if __name__ == "__main__":
    main()
