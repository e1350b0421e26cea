"""Synthetic task generators: deterministic, offline, with gold answers for verifiers.

`data=arithmetic` gives 1,000 conversations; `data=arithmetic:200` gives 200. `single_digit_add`
("What is 3 + 5? Answer with just the number.") draws from the 81 single-digit pairs;
`single_digit_add:all` is each pair once (an evaluation set); `single_digit_add_train` (54 pairs) and
`single_digit_add_heldout` (the other 27) are a fixed split for training and honest held-out evaluation.
`mixed_add_train` / `mixed_add_heldout` mix those with as many two-digit additions (easy and hard prompts, for
the curriculum, docs/rl.md).
`humaneval_mini:all` is 12 hand-written HumanEval-style code problems (`prompt` + `tests`, score with
`code`). `multiply_3x2` is 3-digit × 2-digit multiplication for the calculator environment
(`env=calculator`). Rows carry the
columns every recipe understands, and TRL's: `prompt` + `completion` (SFT; the same conversation is also in
`messages`), `prompt` + `answer` (RL with a verifier).
"""

from __future__ import annotations

import random

from posttrain.data.tasks.arithmetic import (
    arithmetic,
    mixed_add_heldout,
    mixed_add_train,
    single_digit_add,
    single_digit_add_heldout,
    single_digit_add_train,
)
from posttrain.data.tasks.code import humaneval_mini
from posttrain.data.tasks.tool_math import multiply_3x2
from posttrain.errors import UserError

TASKS = {"arithmetic": arithmetic, "single_digit_add": single_digit_add, "single_digit_add_train": single_digit_add_train,
         "single_digit_add_heldout": single_digit_add_heldout, "humaneval_mini": humaneval_mini,
         "multiply_3x2": multiply_3x2, "mixed_add_train": mixed_add_train, "mixed_add_heldout": mixed_add_heldout}


NO_FIXED_SET = {"arithmetic"}  # drawn at random without a finite problem set: no `:all`


def task_count(name: str) -> int | None:
    """'task' -> 1000, 'task:200' -> 200, 'task:all' -> None (each problem once); anything else is refused naming
    the forms there are."""
    base, _, count = name.partition(":")
    forms = f"{base} (1000 rows), {base}:200 (a row count)" + ("" if base in NO_FIXED_SET else f", {base}:all (each problem once)")
    if count == "all" and base in NO_FIXED_SET:
        raise UserError(f"data '{name}': {base} draws new problems at random and has no fixed set to take 'all' of; "
                        f"give a row count: {forms}")
    if count == "all":
        return None
    if not count:
        return 1000
    if not count.isdigit() or int(count) < 1:
        raise UserError(f"data '{name}': '{count}' is not a row count (a positive integer); the forms are: {forms}")
    return int(count)


def generate(name: str, seed: int = 1234) -> list[dict]:
    base, _, _ = name.partition(":")
    rows = TASKS[base](task_count(name), random.Random(seed))
    return [with_completion(r) for r in rows]


def with_completion(row: dict) -> dict:
    """A row with `messages` and its `prompt` also gets `completion` (the turns after the prompt): the columns
    TRL's trainers read (SFT: prompt + completion; GRPO: prompt), so a task written to a file (`posttrain data
    export`) trains there too. posttrain's SFT renders prompt + completion exactly as it renders `messages`."""
    if "messages" in row and "prompt" in row and "completion" not in row:
        return {**row, "completion": row["messages"][len(row["prompt"]):]}
    return row
