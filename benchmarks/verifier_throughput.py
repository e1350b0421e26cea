"""Verifications per second with 1 and 2 worker processes, for math and for code.

    .venv/bin/python benchmarks/verifier_throughput.py [--n-math 400] [--n-code 40] [--json out.json]

Math: math-verify comparisons of mixed LaTeX answers (fractions, decimals, sets, expressions).
Code: assert-style tests, one fresh sandboxed interpreter per sample. Workers are warmed up
before timing (their import of sympy / math-verify is a one-off cost).
"""

from __future__ import annotations

import argparse
import json
import time

from posttrain.rewards.code import make_code_reward
from posttrain.rewards.math import make_math_reward
from posttrain.rewards.pool import default_pool

MATH = [("\\boxed{\\frac{3}{4}}", "0.75"), ("so \\boxed{2\\sqrt{3}}", "\\sqrt{12}"), ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
        ("\\boxed{(x+1)^2}", "x^2+2x+1"), ("#### 1,234", "1234"), ("\\boxed{[0,1)}", "(0,1]"), ("\\boxed{50\\%}", "0.5"),
        ("the answer is 17", "18")]
CODE = [("def f(x):\n    return x * x", ["assert f(2) == 4", "assert f(3) == 9", "assert f(-1) == 1"]),
        ("def f(x):\n    return x + x", ["assert f(2) == 4", "assert f(3) == 9"])]


def bench(kind: str, n: int, workers: int) -> float:
    default_pool(workers)
    if kind == "math":
        reward = make_math_reward(workers=workers)
        comps = [MATH[i % len(MATH)][0] for i in range(n)]
        cols = {"answer": [MATH[i % len(MATH)][1] for i in range(n)]}
    else:
        reward = make_code_reward(workers=workers)
        comps = [CODE[i % len(CODE)][0] for i in range(n)]
        cols = {"tests": [CODE[i % len(CODE)][1] for i in range(n)]}
    reward([""] * 2 * workers, comps[: 2 * workers], **{k: v[: 2 * workers] for k, v in cols.items()})  # warm up
    t0 = time.perf_counter()
    reward([""] * n, comps, **cols)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-math", type=int, default=400)
    ap.add_argument("--n-code", type=int, default=40)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    for kind, n in (("math", args.n_math), ("code", args.n_code)):
        for w in (1, 2):
            rows.append({"verifier": kind, "workers": w, "n": n, "per_second": bench(kind, n, w)})
            print(f"{kind:5s} workers={w}  {rows[-1]['per_second']:8.1f} verifications/s  (n={n})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
