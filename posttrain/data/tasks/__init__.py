"""Synthetic task generators: deterministic, offline, with gold answers for verifiers.

`data=arithmetic` gives 1,000 conversations; `data=arithmetic:200` gives 200. Rows carry the
columns every recipe understands: `messages` (SFT), `prompt` + `answer` (RL with a verifier).
"""

from __future__ import annotations

import random

from posttrain.data.tasks.arithmetic import arithmetic

TASKS = {"arithmetic": arithmetic}


def generate(name: str, seed: int = 1234) -> list[dict]:
    base, _, count = name.partition(":")
    n = int(count) if count else 1000
    return TASKS[base](n, random.Random(seed))
