"""Math reward: extract the final answer, compare with the gold answer symbolically (docs/rewards.md).

Comparison uses math-verify (Hugging Face; `verify(gold, answer)` — gold first, the order matters
for its set/interval and relation handling) in a killable worker process. math-verify's own
timeouts use SIGALRM, which works only in a main thread, so both are disabled
(`parsing_timeout=None`, `timeout_seconds=None`) and time is enforced by killing the worker
(`pool.WorkerPool`). Without the `math` extra a small fallback comparator (numbers, fractions,
percentages, tuples/sets, normalised strings) is used.

Verifier-hacking defences (each counted in `last_metrics`):
- several *different* boxed answers -> 0 (hedging: `\\boxed{3}` or `\\boxed{4}`);
- `require="answer_tag" | "after_think"`: an answer only inside the reasoning -> 0;
- a verbatim restatement of the question is removed before `last_number` extraction;
- answers longer than `max_answer_chars`, or power towers (`9^{9^{9^9}}`) when the gold has none,
  -> 0 without reaching sympy; anything else that runs past `timeout` s -> worker killed, 0.
"""

from __future__ import annotations

import re
from fractions import Fraction

from posttrain.rewards import extract
from posttrain.rewards.base import RewardError, completion_text, register
from posttrain.rewards.pool import default_pool

try:  # the `math` extra
    import math_verify  # noqa: F401

    HAVE_MATH_VERIFY = True
except ImportError:  # pragma: no cover - exercised by forcing use_math_verify=False
    HAVE_MATH_VERIFY = False

_TOWER = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?[^\s{}()]*\^|\*\*[^*]*\*\*")


def _latex(s: str) -> str:
    s = s.strip()
    s = re.sub(r"(?<!\\)%", r"\\%", s)  # bare % is a LaTeX comment
    if "\\boxed" in s or s.startswith("$"):
        return s
    return f"${s}$"


# ---------------------------------------------------------------- fallback comparator

def _norm(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(left|right|,|;|!|displaystyle)", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^\\circ", "").replace("^{\\circ}", "")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def _number(s: str) -> Fraction | None:
    s = _norm(s)
    pct = s.endswith("\\%") or s.endswith("%")
    s = s.rstrip("%").rstrip("\\")
    s = re.sub(r"(?<=\d)[a-zA-Z]+$", "", s)  # trailing unit: "5cm"
    m = re.fullmatch(r"(-?)\\frac\{?(-?\d+)\}?\{?(\d+)\}?", s)
    try:
        if m:
            v = Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
        elif re.fullmatch(r"-?\d+/\d+", s):
            v = Fraction(s)
        elif re.fullmatch(r"-?(\d[\d,]*)?(\.\d+)?", s) and any(c.isdigit() for c in s):
            v = Fraction(s.replace(",", ""))
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return v / 100 if pct else v


def fallback_equal(gold: str, answer: str) -> bool:
    """Numbers (with fractions, %, thousands separators, a trailing unit), tuples and sets
    element-wise, else normalised strings."""
    g, a = _number(gold), _number(answer)
    if g is not None and a is not None:
        return g == a or abs(float(g) - float(a)) <= 1e-6 * max(1.0, abs(float(g)))
    ng, na = _norm(gold), _norm(answer)
    if ng == na:
        return True
    for open_, close in (("(", ")"), ("\\{", "\\}"), ("{", "}"), ("[", "]")):
        if ng.startswith(open_) and ng.endswith(close) and na.startswith(open_) and na.endswith(close):
            gi, ai = ng[len(open_):-len(close)].split(","), na[len(open_):-len(close)].split(",")
            if len(gi) != len(ai):
                return False
            if open_ in ("\\{", "{"):
                return sorted(map(_norm, gi)) == sorted(map(_norm, ai)) or all(
                    any(fallback_equal(x, y) for y in ai) for x in gi)
            return all(fallback_equal(x, y) for x, y in zip(gi, ai))
    return False


# ---------------------------------------------------------------- comparison (runs in a worker)

def equivalent(gold: str, answer: str, use_math_verify: bool = True) -> bool:
    """Is `answer` equal to `gold`? Unbounded in time: call it through the pool."""
    if use_math_verify and HAVE_MATH_VERIFY:
        import logging

        from math_verify import parse, verify

        logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" warnings: we kill instead

        g = parse(_latex(gold), parsing_timeout=None)
        a = parse(_latex(answer), parsing_timeout=None)
        if g and a:
            return bool(verify(g, a, timeout_seconds=None))
    return fallback_equal(gold, answer)


def verify_candidates(gold: str, answers: list[str], use_math_verify: bool = True) -> tuple[float, str]:
    """Worker task: (score, reason). Several answers must all be equivalent to one another."""
    distinct = list(dict.fromkeys(_norm(a) for a in answers))
    if len(distinct) > 1 and not all(equivalent(distinct[0], d, use_math_verify) for d in distinct[1:]):
        return 0.0, "multiple_answers"
    return (1.0, "correct") if equivalent(gold, answers[-1], use_math_verify) else (0.0, "wrong")


# ---------------------------------------------------------------- the reward

def make_math_reward(mode: str = "auto", require: str | None = None, timeout: float = 5.0,
                     workers: int | None = None, max_answer_chars: int = 300,
                     use_math_verify: bool = True, strip_prompt: bool = True):
    """Build a math reward. mode: auto | boxed | gsm8k | last_number | raw; require: None |
    answer_tag | after_think; column `answer` holds the gold (a GSM8K `... #### 42` solution works)."""
    extract.candidates("", mode)  # validate the mode now
    extract.final_region("", require)

    def math_reward(prompts, completions, answer=None, **_):
        if answer is None:
            raise RewardError("math", [(None, "needs the dataset column 'answer' (the gold answer)")])
        n = len(completions)
        scores: list[float | None] = [None] * n
        counts = {"timeouts": 0, "format_missing": 0, "no_answer": 0, "multiple_answers": 0, "rejected": 0}
        jobs, where = [], []
        for i, (c, gold) in enumerate(zip(completions, answer)):
            if gold is None:
                continue
            gold = str(gold)
            gold = extract.gsm8k(gold) or gold if "####" in gold else gold
            boxed_gold = extract.boxed_all(gold)
            gold = boxed_gold[-1] if boxed_gold else gold
            region = extract.final_region(completion_text(c), require)
            if region is None:
                scores[i] = 0.0
                counts["format_missing"] += 1
                continue
            if strip_prompt and prompts is not None and prompts[i] is not None:
                region = extract.strip_restated(region, completion_text(prompts[i]) if not isinstance(prompts[i], str) else prompts[i])
            cands = [a for a in extract.candidates(region, mode) if a]
            if not cands:
                scores[i] = 0.0
                counts["no_answer"] += 1
                continue
            if any(len(a) > max(max_answer_chars, 4 * len(gold)) for a in cands) or (
                    any(_TOWER.search(a) for a in cands) and not _TOWER.search(gold)):
                scores[i] = 0.0
                counts["rejected"] += 1
                continue
            jobs.append((gold, cands, use_math_verify))
            where.append(i)
        errors = []
        if jobs:
            for i, out in zip(where, default_pool(workers).map(verify_candidates, jobs, timeout=timeout)):
                if out.timed_out:
                    scores[i] = 0.0
                    counts["timeouts"] += 1
                elif out.error:
                    errors.append((i, out.error))
                else:
                    scores[i], reason = out.value
                    counts["multiple_answers"] += reason == "multiple_answers"
        math_reward.last_metrics = counts
        if errors:
            raise RewardError("math", errors, scores, samples=completions)
        return scores

    math_reward.last_metrics = {}
    return math_reward


register("math", columns=("answer",), factory=make_math_reward,
         description="1 if the final answer equals the gold `answer` (math-verify, killable worker), else 0")(make_math_reward())
register("math_answer_tag", columns=("answer",),
         description="math, but the answer must be in <answer>...</answer> outside <think>")(make_math_reward(require="answer_tag"))
register("math_after_think", columns=("answer",),
         description="math, but the answer must come after </think>")(make_math_reward(require="after_think"))
