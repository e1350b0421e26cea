"""Two-operand arithmetic word problems with a boxed final answer."""

from __future__ import annotations

import random

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        op = rng.choice(list(OPS))
        a, b = rng.randint(0, 99), rng.randint(0, 99 if op != "*" else 12)
        value = OPS[op](a, b)
        question = f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."
        reply = f"{a} {op} {b} = {value}. The answer is \\boxed{{{value}}}."
        rows.append({
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}],
            "prompt": [{"role": "user", "content": question}],
            "answer": str(value),
        })
    return rows


DIGIT_PROMPT = "What is {a} + {b}? Answer with just the number."
DIGIT_PAIRS = [(a, b) for a in range(1, 10) for b in range(1, 10)]  # the 81 single-digit problems


def single_digit_add(n: int | None, rng: random.Random) -> list[dict]:
    """Single-digit addition, answered with just the number (score it with `math` in `last_number`
    mode). n rows drawn uniformly from the 81 pairs; n=None: each pair once, in order (an eval set)."""
    pairs = DIGIT_PAIRS if n is None else [rng.choice(DIGIT_PAIRS) for _ in range(n)]
    rows = []
    for a, b in pairs:
        question = DIGIT_PROMPT.format(a=a, b=b)
        rows.append({
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": str(a + b)}],
            "prompt": [{"role": "user", "content": question}],
            "answer": str(a + b),
        })
    return rows
