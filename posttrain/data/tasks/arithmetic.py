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
