"""Test-time selection among the N samples of one prompt (`select=` in generate, eval and serve).

    select=best_of_n n=8 reward=rm:runs/rm/final   keep the sample with the highest reward
    select=majority  n=8 reward=math               keep a sample of the most frequent final answer (self-consistency)

Tie rules (deterministic; order = sample index j = 0 … N−1):
- best_of_n: the lowest index among the samples with the highest reward; a sample without a reward (None) never
  beats one with a reward; when no sample has one, sample 0.
- majority: final answers are extracted as the math verifier in `reward=` extracts them (its `mode`, required
  format) and grouped by its equivalence (`1/2` = `0.5`), as cons@k does (rewards/answers.py). The class with
  the most votes wins; between tied classes, the one whose first sample comes first; the kept sample is the
  winning class's first sample. Samples without an answer abstain; when none has one, sample 0.
  (`posttrain eval`'s cons@k scores a tie by the expected value of a random tie-break instead: it is an
  estimate, this is a decision.)

Oracle: a reward that reads dataset columns sees the reference (`math` reads `answer`, `code` the tests), so
best_of_n with it is pass@N-like: what N samples could reach if a checker knew the answer, not a method one can
deploy. Majority (no reference needed) and best_of_n by a reward model (`rm:PATH`) are the non-oracle options.
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass

from posttrain.errors import UserError

METHODS = ("best_of_n", "majority")
HELP = ("test-time selection among n samples per prompt: best_of_n (highest reward=) | majority (most frequent final "
        "answer under reward='s math extraction); '' = off")


def best_index(rewards: list[float | None]) -> int:
    """Index of the highest reward; ties -> the lowest index; None never wins unless every reward is None (-> 0)."""
    best = None
    for j, r in enumerate(rewards):
        if r is not None and (best is None or r > rewards[best]):
            best = j
    return 0 if best is None else best


def majority_index(classes: list[int | None]) -> tuple[int, int]:
    """(index of the kept sample, votes of its class) for answer classes per sample (None: no answer, abstains).
    The most voted class wins, ties -> the class seen first; the kept sample is its first. No answer at all -> (0, 0)."""
    votes = Counter(c for c in classes if c is not None)
    if not votes:
        return 0, 0
    top = max(votes.values())
    first = next(j for j, c in enumerate(classes) if c is not None and votes[c] == top)
    return first, top


def check_select(select: str, n: int, reward: str) -> None:
    """Refuse misuse before any model loads (the message names the key and what to give)."""
    if not select:
        return
    if select not in METHODS:
        close = difflib.get_close_matches(select, METHODS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"select='{select}' is not a selection method{hint} (known: {', '.join(METHODS)}; '' = off)")
    if n < 1:
        raise UserError(f"select={select} needs n >= 1 samples per prompt to choose from (got n={n})")
    if not reward:
        what = ("the reward that ranks the samples: a verifier such as math, or rm:PATH (a reward model)"
                if select == "best_of_n" else "the math verifier whose answer extraction and equivalence the vote uses, e.g. reward=math")
        raise UserError(f"select={select} needs reward=: {what}")


@dataclass
class Choice:
    """The selection of one prompt: the kept sample and what decided it."""

    index: int
    rewards: list[float | None] | None = None  # best_of_n: every sample's reward
    answers: list[str | None] | None = None  # majority: every sample's extracted answer
    classes: list[int | None] | None = None  # majority: answer class per sample
    votes: int = 0  # majority: votes of the winning class

    def record(self, method: str) -> dict:
        out: dict = {"method": method, "n": len(self.rewards or self.classes or []), "index": self.index}
        if self.rewards is not None:
            out["rewards"] = self.rewards
        if self.classes is not None:
            out.update(answers=self.answers, classes=self.classes, votes=self.votes)
        return out


class Selector:
    """Builds the reward (checked now: an unknown reward or a missing rm: folder is refused before sampling) and
    chooses among the samples of each prompt.

        sel = Selector("majority", "math", {"math": {"mode": "last_number"}})
        sel.choose([(prompt, row, [text_0, …], [ids_0, …])]) -> [Choice]
    """

    def __init__(self, method: str, reward: str, reward_args: dict | None = None, pool=None, n: int = 1):
        from posttrain.rewards.answers import extraction_settings
        from posttrain.rewards.registry import compose  # math-verify, torch for rm: (not for --help)

        check_select(method, n, reward)
        self.method, self.spec, self.pool = method, reward, pool
        args = {k: dict(v) for k, v in (reward_args or {}).items()}
        self.reward_fn = compose(reward, on_error="record", options=args)
        self.ex = extraction_settings(self.reward_fn.parts, args)
        if method == "majority" and self.ex is None:
            raise UserError(f"select=majority votes on the final answer the math verifier extracts: reward= must contain "
                            f"math, math_answer_tag or math_after_think (got '{reward}'); use select=best_of_n for other rewards")
        self.columns: dict[str, tuple] = {k: tuple(v) for k, v in self.reward_fn.columns.items() if v} if method == "best_of_n" else {}
        self.oracle = bool(self.columns)  # best_of_n by a reward that reads the reference (answer, tests)

    def describe(self) -> str:
        if self.method == "majority":
            return f"majority vote on the final answer ({self.spec}'s extraction and equivalence; needs no reference)"
        if self.oracle:
            cols = sorted({c if isinstance(c, str) else "|".join(c) for cs in self.columns.values() for c in cs})
            return (f"best_of_n by {self.spec}, which reads the reference ({', '.join(cols)}): an ORACLE, pass@n-like, "
                    "not deployable (use select=majority or reward=rm:PATH for a non-oracle choice)")
        return f"best_of_n by {self.spec} (sees no reference)"

    def choose(self, groups: list[tuple]) -> list[Choice]:
        """groups: (prompt, row (dataset columns, may be {}), texts, token ids per sample) per prompt."""
        if self.method == "best_of_n":
            return [Choice(best_index(r), rewards=r) for r in self.rewards(groups)]
        from posttrain.rewards.answers import classes_in_pool, extract_answer

        answers = [[extract_answer(t, prompt, self.ex) for t in texts] for prompt, _, texts, _ in groups]
        classes, _ = classes_in_pool(answers, self.ex["use_math_verify"], self.pool)
        out = []
        for a, c in zip(answers, classes):
            j, votes = majority_index(c)
            out.append(Choice(j, answers=a, classes=c, votes=votes))
        return out

    def rewards(self, groups: list[tuple]) -> list[list[float | None]]:
        """Every sample's reward, one call over all prompts (dataset columns per sample, TRL's convention)."""
        prompts, texts, ids, rows, sizes = [], [], [], [], []
        for prompt, row, ts, tids in groups:
            prompts += [prompt] * len(ts)
            texts += list(ts)
            ids += [list(x) for x in tids]
            rows += [row or {}] * len(ts)
            sizes.append(len(ts))
        keys = {k for r in rows for k in r if k not in ("prompt", "messages", "completion")}
        columns = {k: [r.get(k) for r in rows] for k in keys}
        values = self.reward_fn(prompts, texts, completion_ids=ids, **columns) if texts else []
        out, at = [], 0
        for m in sizes:
            out.append(list(values[at:at + m]))
            at += m
        return out

    def check_rows(self, rows: list[dict], source: str) -> None:
        """Every row carries the columns the selection reward reads (else it cannot score), naming the first gap."""
        for i, row in enumerate(rows):
            for reward, cols in self.columns.items():
                for col in cols:
                    alts = col if isinstance(col, tuple) else (col,)
                    if not any(row.get(a) is not None for a in alts):
                        raise UserError(f"{source}: row {i + 1}: field '{' or '.join(alts)}' missing (select=best_of_n "
                                        f"by reward '{reward}' needs it)")
