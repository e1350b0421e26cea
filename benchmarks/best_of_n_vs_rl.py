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
from pathlib import Path

import yaml

from posttrain.eval.selection import equal_tokens

ROOT = Path(__file__).resolve().parents[1]
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


def fmt(m: dict) -> str:
    return f"{m['value']:.3f} [{m['low']:.3f}, {m['high']:.3f}]"


def fmt_diff(m: dict) -> str:
    return f"{m['value']:+.3f} [{m['low']:+.3f}, {m['high']:+.3f}]"


def table(base: dict, rl: dict) -> str:
    lines = ["| budget (tokens / problem) | base: samples, tokens | base best-of-N (verifier: oracle) | base majority | "
             "GRPO: samples, tokens | GRPO majority | GRPO best-of-N (oracle) | GRPO maj − base maj | GRPO maj − base best-of-N |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in equal_tokens(base, rl, orders=ORDERS)["rows"]:
        x, y = r["a"], r["b"]
        lines.append(f"| {r['budget']} | {x['samples']:.1f}, {x['tokens']:.1f} | {fmt(x['best_of_n'])} | {fmt(x['majority'])} | "
                     f"{y['samples']:.1f}, {y['tokens']:.1f} | {fmt(y['majority'])} | {fmt(y['best_of_n'])} | "
                     f"{fmt_diff(r['b_maj_minus_a_maj'])} | {fmt_diff(r['b_maj_minus_a_best_of_n'])} |")
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
