"""A synthetic preference set with a learnable rule: the preferred reply starts with "Sure", the other with
"No"; the rest of both replies is random words (different in chosen and rejected), so only the rule
separates them on held-out pairs."""

import random

WORDS = "apple river stone cloud green quick seven table music light paper ocean".split()


def rule_pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        topic = rng.choice(WORDS)
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        b = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        rows.append({"prompt": [{"role": "user", "content": f"Say something about {topic}."}],
                     "chosen": [{"role": "assistant", "content": f"Sure {a}"}],
                     "rejected": [{"role": "assistant", "content": f"No {b}"}]})
    return rows
