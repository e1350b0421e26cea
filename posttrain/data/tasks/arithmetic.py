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
# a fixed split for honest held-out evaluation: every third pair (27) is held out, 54 are for training
HELDOUT_PAIRS = DIGIT_PAIRS[1::3]
TRAIN_PAIRS = [p for p in DIGIT_PAIRS if p not in HELDOUT_PAIRS]


def single_digit_add(n: int | None, rng: random.Random, pool: list[tuple[int, int]] = DIGIT_PAIRS) -> list[dict]:
    """Single-digit addition, answered with just the number (score it with `math` in `last_number`
    mode). n rows drawn uniformly from the pairs of `pool`; n=None: each pair once, in order (an eval set)."""
    pairs = pool if n is None else [rng.choice(pool) for _ in range(n)]
    rows = []
    for a, b in pairs:
        question = DIGIT_PROMPT.format(a=a, b=b)
        rows.append({
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": str(a + b)}],
            "prompt": [{"role": "user", "content": question}],
            "answer": str(a + b),
        })
    return rows


def single_digit_add_train(n: int | None, rng: random.Random) -> list[dict]:
    """The 54 training pairs of the fixed split (`single_digit_add_heldout` has the other 27)."""
    return single_digit_add(n, rng, TRAIN_PAIRS)


def single_digit_add_heldout(n: int | None, rng: random.Random) -> list[dict]:
    """The 27 held-out pairs (every third of the 81): never drawn by `single_digit_add_train`."""
    return single_digit_add(n, rng, HELDOUT_PAIRS)


# two-digit additions (harder for small models): a fixed pool of 81 pairs, split like the single-digit ones
TWO_DIGIT_PAIRS = [(10 + i // 90, 10 + i % 90) for i in random.Random(27).sample(range(90 * 90), 81)]  # a, b in 10..99
TWO_DIGIT_HELDOUT = TWO_DIGIT_PAIRS[1::3]
TWO_DIGIT_TRAIN = [p for p in TWO_DIGIT_PAIRS if p not in TWO_DIGIT_HELDOUT]


def mixed_add_train(n: int | None, rng: random.Random) -> list[dict]:
    """Easy and hard prompts mixed: the 54 single-digit training pairs and 54 two-digit ones (a, b in 10..99),
    n rows drawn uniformly from the 108; `mixed_add_heldout` has the other 27 + 27."""
    return single_digit_add(n, rng, TRAIN_PAIRS + TWO_DIGIT_TRAIN)


def mixed_add_heldout(n: int | None, rng: random.Random) -> list[dict]:
    """The 27 held-out single-digit pairs, then 27 held-out two-digit pairs: never drawn by `mixed_add_train`."""
    return single_digit_add(n, rng, HELDOUT_PAIRS + TWO_DIGIT_HELDOUT)
