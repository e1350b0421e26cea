"""curriculum=band against uniform sampling at the same number of generated tokens (docs/rl.md).

SmolLM2-135M-Instruct, the quickstart's GRPO settings (configs/quickstart.yaml: 4 prompts x 8 samples, β = 0,
lr 5e-6, bf16 update, 24 new tokens), on a task that mixes easy and hard prompts: `mixed_add_train` (54
single-digit + 54 two-digit additions, reward `math` in last_number mode), the learning rate held constant
(the runs stop on a token budget, not a step count, so a schedule over steps would differ between them).

1. uniform: the data order as it is (curriculum=none), `--steps` steps; its generated tokens are the budget.
2. band: curriculum=band (0.2 < p < 0.8, floor 0.1), stepped until it has generated as many tokens.
3. Both final models: `posttrain eval` on `mixed_add_heldout:all` (27 + 27 held-out problems, `--n` samples
   each), pass@1 with intervals overall and per kind; `eval compare` band vs uniform (paired bootstrap and
   sign-flip over the 54 problems).

Prints the learning curves per generated token (training reward, and the in-run held-out pass@1 every
`--eval-every` steps), the final table and the paired test; writes benchmarks/results/curriculum_vs_uniform.json.
Heavy: run it under the shared lock, e.g.
    flock /tmp/posttrain_heavy.lock nice -n 5 .venv/bin/python benchmarks/curriculum_vs_uniform.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from posttrain.config import parse_args
from posttrain.eval import stats
from posttrain.eval.compare import compare, print_comparison
from posttrain.recipes import rl
from posttrain.recipes.quickstart import CONFIG, QuickstartConfig, run_eval_stage

ROOT = Path(__file__).resolve().parents[1]
TRAIN, HELDOUT, SINGLE = "mixed_add_train:2000", "mixed_add_heldout:all", 27  # the held-out set's first 27 are single-digit


def arm_config(qs: QuickstartConfig, out: Path, curriculum: str, max_steps: int, eval_every: int) -> rl.RLConfig:
    """The quickstart's RL section with the mixed task, a constant lr, and the curriculum of this arm."""
    d = qs.rl.model_dump(mode="json", exclude_unset=True)  # only what the recipe sets: B x G derived defaults stay
    d.update(model=qs.model, data=TRAIN, output_dir=str(out), max_steps=max_steps, save_every=0, resume=False,
             curriculum=curriculum)
    d["optim"] = {**d.get("optim", {}), "schedule": "constant"}
    d["eval"] = {**d.get("eval", {}), "data": HELDOUT, "every": eval_every, "n": 4}
    return rl.RLConfig.model_validate(d)


def train_arm(cfg: rl.RLConfig, token_budget: int | None, label: str) -> dict:
    """Steps until max_steps, or until `token_budget` generated tokens; -> rows, tokens, seconds."""
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a fresh run each time
    run, t0, rows, tokens = rl.setup(cfg), time.perf_counter(), [], 0
    for step in range(cfg.max_steps):
        row = rl.rl_step(run, step)
        tokens += int(row["generated_tokens"])
        rows.append({**row, "cum_generated_tokens": tokens})
        shown = f" | held-out pass@1 {row['eval/pass@1']:.3f}" if "eval/pass@1" in row else ""
        print(f"  {label} step {step + 1:>3} | tokens {tokens:>6} | reward {row['reward/mean']:.3f}{shown}", flush=True)
        if token_budget is not None and tokens >= token_budget:
            break
    rl.finish(run, final_checkpoint=False)  # final/ only: no optimizer state to write
    return {"rows": rows, "tokens": tokens, "steps": len(rows), "seconds": time.perf_counter() - t0}


def finished_arm(out: Path) -> dict:
    """A finished arm read back from its run folder (metrics.jsonl and final/)."""
    if not (out / "final" / "config.json").is_file():
        raise SystemExit(f"{out} has no final/: run without --reuse-{out.name}")
    rows, tokens = [], 0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        tokens += int(row["generated_tokens"])
        rows.append({**row, "cum_generated_tokens": tokens})
    return {"rows": rows, "tokens": tokens, "steps": len(rows), "seconds": None}


def curve(rows: list[dict], budget: int, bins: int) -> list[dict]:
    """Training reward per token bin (mean over the steps ending in it), and the last held-out pass@1 by then."""
    out, last_eval = [], None
    for b in range(1, bins + 1):
        hi, lo = budget * b / bins, budget * (b - 1) / bins
        inside = [r for r in rows if lo < r["cum_generated_tokens"] <= hi or (b == bins and r["cum_generated_tokens"] > hi)]
        for r in rows:
            if r["cum_generated_tokens"] <= hi and "eval/pass@1" in r:
                last_eval = (r["eval/pass@1"], r["cum_generated_tokens"])
        rewards = [r["reward/mean"] for r in inside if r["reward/mean"] == r["reward/mean"]]
        out.append({"tokens": round(hi), "reward": sum(rewards) / len(rewards) if rewards else None,
                    "heldout": last_eval[0] if last_eval else None, "heldout_at": last_eval[1] if last_eval else None})
    return out


def split_pass1(doc: dict) -> dict:
    """pass@1 with its clustered Wilson interval over all problems, the single-digit and the two-digit ones."""
    items = sorted(doc["items"], key=lambda it: it["index"])
    n = doc["protocol"]["n"]
    out = {}
    for name, part in [("all", items), ("single-digit", items[:SINGLE]), ("two-digit", items[SINGLE:])]:
        fr = [it["pass@1"] for it in part]
        value, low, high = stats.clustered_wilson(fr, n)
        out[name] = {"value": value, "low": low, "high": high}
    return out


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def fmt(x, spec=".3f") -> str:
    return "–" if x is None else format(x, spec)


def print_tables(arms: dict, evals: dict, cmp: dict, budget: int, bins: int) -> None:
    print(f"\nlearning curve per generated token (budget {budget} tokens; reward = mean training reward of the steps "
          "ending in the bin; held-out = last in-run pass@1, n=4)")
    curves = {k: curve(a["rows"], budget, bins) for k, a in arms.items()}
    print("| generated tokens | uniform reward | band reward | uniform held-out | band held-out |")
    print("|---|---|---|---|---|")
    for cu, cb in zip(curves["uniform"], curves["band"]):
        print(f"| {cu['tokens']} | {fmt(cu['reward'])} | {fmt(cb['reward'])} | {fmt(cu['heldout'])} | {fmt(cb['heldout'])} |")
    print("\nheld-out pass@1 after the budget (mixed_add_heldout, 95% clustered Wilson intervals)")
    print("| | steps | generated tokens | all 54 | single-digit 27 | two-digit 27 |")
    print("|---|---|---|---|---|---|")
    for k, doc in evals.items():
        p = split_pass1(doc)
        cells = " | ".join(f"{p[s]['value']:.3f} [{p[s]['low']:.3f}, {p[s]['high']:.3f}]" for s in ("all", "single-digit", "two-digit"))
        steps, tokens = (arms[k]["steps"], arms[k]["tokens"]) if k in arms else ("0", "0")
        print(f"| {k} | {steps} | {tokens} | {cells} |")
    waste = {k: mean([r.get("groups/zero_adv_frac") for r in a["rows"]]) for k, a in arms.items()}
    print(f"\ngroups without signal (all pass or all fail), mean over steps: uniform {fmt(waste['uniform'])}, "
          f"band {fmt(waste['band'])}")
    bt, sf = cmp["bootstrap"], cmp["sign_flip"]
    print(f"\nband − uniform pass@1 {bt['diff']:+.4f}, paired bootstrap 95% [{bt['low']:+.4f}, {bt['high']:+.4f}], "
          f"p = {bt['p_value']:.4g}; sign-flip over problems p = {sf['p_value']:.4g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="uniform arm's steps (its generated tokens are the budget)")
    ap.add_argument("--n", type=int, default=16, help="samples per held-out problem in the final evaluation")
    ap.add_argument("--eval-every", type=int, default=10, help="in-run held-out pass@1 (n=4) every N steps")
    ap.add_argument("--bins", type=int, default=6, help="token bins of the learning-curve table")
    ap.add_argument("--base", action="store_true", help="also evaluate the untrained model")
    ap.add_argument("--out", default="runs/curriculum_vs_uniform")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "curriculum_vs_uniform.json"))
    ap.add_argument("--reuse-uniform", action="store_true", help="take the uniform arm from a finished run in --out")
    ap.add_argument("--reuse-band", action="store_true", help="take the band arm too (only the final evaluations run)")
    ap.add_argument("--model", default=None, help="another model (tiny-random: a seconds-long smoke test)")
    args = ap.parse_args()
    qs = parse_args(QuickstartConfig, ["--config", str(CONFIG), *([f"model={args.model}"] if args.model else [])])
    out = ROOT / args.out
    t0 = time.perf_counter()
    if args.reuse_uniform:
        arms = {"uniform": finished_arm(out / "uniform")}
    else:
        arms = {"uniform": train_arm(arm_config(qs, out / "uniform", "none", args.steps, args.eval_every), None, "uniform")}
    budget = arms["uniform"]["tokens"]
    if args.reuse_band:
        arms["band"] = finished_arm(out / "band")
    else:
        arms["band"] = train_arm(arm_config(qs, out / "band", "band", 3 * args.steps, args.eval_every), budget, "band")
    eval_cfg = qs.eval.model_copy(update={"data": HELDOUT, "n": args.n, "k": [k for k in qs.eval.k if k <= args.n]})
    evals = {}
    if args.base:
        evals["base"] = run_eval_stage(eval_cfg, qs.model, out / "eval_base", "base model")
    for k in ("uniform", "band"):
        evals[k] = run_eval_stage(eval_cfg, str(out / k / "final"), out / f"eval_{k}", k)
        evals[k]["_path"] = str(out / f"eval_{k}" / "results.json")
    cmp = compare(evals["uniform"], evals["band"])
    print_comparison(cmp)
    print_tables(arms, evals, cmp, budget, args.bins)
    result = {"budget_tokens": budget, "seconds": time.perf_counter() - t0,
              "arms": arms,
              "heldout": {k: split_pass1(d) for k, d in evals.items()},
              "compare": {"bootstrap": cmp["bootstrap"], "sign_flip": cmp["sign_flip"]}}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=float))
    print(f"\n{path} ({(time.perf_counter() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    main()
