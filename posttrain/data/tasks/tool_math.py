"""Multiplication a model of SmolLM2-135M's size cannot do in its head but can with a calculator."""

from __future__ import annotations

import random

MULT_PROMPT = "What is {a} * {b}? Use the calculator, then give the final answer as a number."


def multiply_3x2(n: int | None, rng: random.Random) -> list[dict]:
    """3-digit × 2-digit products (`env=calculator`); n=None: 200 rows (an evaluation set)."""
    rows = []
    for _ in range(200 if n is None else n):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": MULT_PROMPT.format(a=a, b=b)}], "answer": str(a * b),
                     "a": a, "b": b})
    return rows
