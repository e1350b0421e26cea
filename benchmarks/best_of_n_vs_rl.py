"""Is RL's gain worth more than sampling more from the base model? Best-of-N (by the verifier: an oracle) and
majority vote on SmolLM2-135M-Instruct against the GRPO-trained model of the quickstart, on the quickstart's 27
held-out additions, at EQUAL generated tokens, with intervals.

    .venv/bin/posttrain quickstart output_dir=/tmp/qs                        # the GRPO model: /tmp/qs/rl/final
    flock /tmp/posttrain_heavy.lock nice -n 5 .venv/bin/python benchmarks/best_of_n_vs_rl.py --trained /tmp/qs/rl/final

Both models are evaluated with the quickstart's protocol (configs/quickstart.yaml `eval`: n = 16, temperature 1,
24 new tokens, seed 0) through `posttrain eval select=best_of_n` and `select=majority` (same seed: the same
samples). The first table is what `eval select=` prints: the first N samples of each problem (one draw: noisy;
Wilson intervals over the 27 problems). Then, for a budget of B generated tokens per problem, each model draws
samples while their tokens fit in B (at least one) and keeps one answer: best-of-N by the verifier (it reads the
reference: an upper bound, what a perfect checker would get) or the majority answer (deployable: needs no
reference). The draws are exchangeable, so each problem's value is the mean over 500 seeded orders of its 16
samples (the expected accuracy of the procedure); intervals: percentile bootstrap over problems, paired for
GRPO − base.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import yaml

from posttrain.eval import stats
from posttrain.rollout.select import best_index, majority_index

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (10, 20, 40, 80, 160, 320)
ORDERS = 500


def evaluate(model: str, select: str, out: Path, n: int) -> dict:
    """`posttrain eval` with the quickstart's protocol and select=; reuses a finished results.json."""
    if (out / "results.json").is_file():
        return json.loads((out / "results.json").read_text())
    from posttrain.eval.cli import run_eval
    from posttrain.eval.config import EvalConfig

    proto = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["eval"]
    cfg = EvalConfig(**{**proto, "n": n, "k": [k for k in (1, 2, 4, 8, 16, 32) if k <= n]}, model=model, output_dir=str(out),
                     select=select)
    return run_eval(cfg)


def within(tokens: list[int], budget: int) -> int:
    """How many samples, taken in order, fit in `budget` tokens (at least one)."""
    used = m = 0
    for t in tokens:
        if m and used + t > budget:
            break
        used, m = used + t, m + 1
    return m


def at_budget(doc: dict, budget: int, orders: int = ORDERS, seed: int = 0) -> list[dict]:
    """Per problem, averaged over `orders` seeded random orders of its n samples (the draws are exchangeable, so
    this is the expected value of drawing until the budget is spent; one order alone is noisy): samples used,
    tokens spent, and the verdict of the answer best-of-N (verifier) and majority keep."""
    rng = random.Random(seed)
    rows = []
    for it in doc["items"]:
        n = len(it["samples"])
        acc = {"m": 0.0, "tokens": 0.0, "bon": 0.0, "maj": 0.0}
        for _ in range(orders):
            perm = rng.sample(range(n), n)
            toks = [it["samples"][j]["tokens"] for j in perm]
            m = within(toks, budget)
            pick = perm[:m]
            acc["m"] += m
            acc["tokens"] += sum(toks[:m])
            acc["bon"] += it["correct"][pick[best_index([it["scores"][j] for j in pick])]]
            acc["maj"] += it["correct"][pick[majority_index([it["classes"][j] for j in pick])[0]]]
        rows.append({k: v / orders for k, v in acc.items()})
    return rows


def interval(xs: list[float]) -> str:
    mean, lo, hi = stats.bootstrap_interval(xs, 0.95, 10000, 0)
    return f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def paired(a: list[float], b: list[float]) -> str:
    r = stats.paired_bootstrap(a, b, resamples=10000, seed=0)
    return f"{r['diff']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}]"


def table(base: dict, rl: dict) -> str:
    lines = ["| budget (tokens / problem) | base: samples, tokens | base best-of-N (verifier: oracle) | base majority | "
             "GRPO: samples, tokens | GRPO majority | GRPO best-of-N (oracle) | GRPO maj − base maj | GRPO maj − base best-of-N |",
             "|---|---|---|---|---|---|---|---|---|"]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)
    for b in BUDGETS:
        x, y = at_budget(base, b), at_budget(rl, b)
        lines.append(f"| {b} | {mean(x, 'm'):.1f}, {mean(x, 'tokens'):.1f} | {interval([r['bon'] for r in x])} | "
                     f"{interval([r['maj'] for r in x])} | {mean(y, 'm'):.1f}, {mean(y, 'tokens'):.1f} | "
                     f"{interval([r['maj'] for r in y])} | {interval([r['bon'] for r in y])} | "
                     f"{paired([r['maj'] for r in x], [r['maj'] for r in y])} | {paired([r['bon'] for r in x], [r['maj'] for r in y])} |")
    return "\n".join(lines)


def per_n(doc: dict, label: str) -> list[str]:
    sel = doc["selection"]
    return [f"| {label} | {r['k']} | {r['tokens_per_problem']:.1f} | {r['accuracy']['value']:.3f} [{r['accuracy']['low']:.3f}, "
            f"{r['accuracy']['high']:.3f}] |" for r in sel["per_k"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="smollm2-135m-instruct")
    ap.add_argument("--trained", default="runs/quickstart/rl/final", help="the quickstart's GRPO model folder")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--out", default="runs/best_of_n_vs_rl")
    args = ap.parse_args()
    out = Path(args.out)
    docs = {(who, sel): evaluate(model, sel, out / f"{who}_{sel}", args.n)
            for who, model in (("base", args.base), ("grpo", args.trained)) for sel in ("best_of_n", "majority")}
    for who in ("base", "grpo"):  # same seed: the two selections saw the very same samples
        a, b = docs[(who, "best_of_n")], docs[(who, "majority")]
        assert [it["correct"] for it in a["items"]] == [it["correct"] for it in b["items"]], who
    print("per N (the first N samples of each problem):\n")
    print("| model | selection | N | generated tokens / problem | accuracy (95% Wilson over 27 problems) |")
    print("|---|---|---|---|---|")
    for who in ("base", "grpo"):
        for sel in ("best_of_n", "majority"):
            for line in per_n(docs[(who, sel)], f"{who} | {sel}"):
                print(line)
    print(f"\nat equal generated tokens (each model draws samples while they fit in the budget; mean over {ORDERS} orders "
          "of its 16 samples; 95% percentile bootstrap over the 27 problems, paired for the differences):\n")
    print(table(docs[("base", "majority")], docs[("grpo", "majority")]))


if __name__ == "__main__":
    main()
