"""Final answers as the math verifier reads them, and their grouping into classes of equal answers: what
majority vote needs (cons@k in `posttrain eval`, `select=majority` in generate / eval / serve).

    ex = extraction_settings(reward_fn.parts, reward_args)   # {mode, require, strip_prompt, use_math_verify} | None
    extract_answer(text, prompt, ex)                          # "7" | None (format missing, no answer)
    cluster_answers(["1/2", "0.5", "3", None])                # [0, 0, 1, None]: classes under `math.equivalent`

`cluster_answers` calls the verifier's equivalence (math-verify, unbounded in time): run it through
`posttrain.rewards.pool` as the verifier itself is run.
"""

from __future__ import annotations

from posttrain.data.formats import completion_text
from posttrain.rewards import extract

MATH_REQUIRE = {"math": None, "math_answer_tag": "answer_tag", "math_after_think": "after_think"}


def extraction_settings(parts: list[tuple[str, float]], reward_args: dict) -> dict | None:
    """How the math reward in a composition finds the final answer ({mode, require, strip_prompt, use_math_verify}),
    or None when the composition has no math reward (then there is no cons@k and no majority vote)."""
    for name, _ in parts:
        if name in MATH_REQUIRE:
            opts = dict(reward_args.get(name, {}))
            return {"mode": opts.get("mode", "auto"), "require": opts.get("require", MATH_REQUIRE[name]),
                    "strip_prompt": opts.get("strip_prompt", True), "use_math_verify": opts.get("use_math_verify", True)}
    return None


def extract_answer(text: str, prompt, ex: dict) -> str | None:
    """The final answer the math reward would compare (None: format missing or no answer)."""
    region = extract.final_region(text, ex["require"])
    if region is None:
        return None
    if ex["strip_prompt"] and prompt is not None:
        region = extract.strip_restated(region, prompt if isinstance(prompt, str) else completion_text(prompt))
    cands = [a for a in extract.candidates(region, ex["mode"]) if a]
    return cands[-1] if cands else None


def group_answers(answers: list[str | None], same) -> list[int | None]:
    """Class id per answer: each answer joins the first earlier class whose representative `same(rep,
    answer)` accepts (greedy, in order; identical strings are compared once). None stays None."""
    reps: list[str] = []
    memo: dict[str, int] = {}
    out: list[int | None] = []
    for a in answers:
        if a is None:
            out.append(None)
            continue
        if a not in memo:
            memo[a] = next((i for i, r in enumerate(reps) if r == a or same(r, a)), len(reps))
            if memo[a] == len(reps):
                reps.append(a)
        out.append(memo[a])
    return out


def cluster_answers(answers: list[str | None], use_math_verify: bool = True) -> list[int | None]:
    """Pool-worker task: answer classes under the math verifier's equivalence (unbounded in time,
    like the verifier itself: run it through `posttrain.rewards.pool`)."""
    from posttrain.rewards.math import _norm, equivalent  # math-verify (slow), in the pool's worker only

    normed = [None if a is None else _norm(a) for a in answers]
    return group_answers(normed, lambda rep, a: equivalent(rep, a, use_math_verify))


def exact_classes(answers: list[str | None]) -> list[int | None]:
    """Classes by normalised string equality: the fallback when the equivalence times out in the pool."""
    from posttrain.rewards.math import _norm

    return group_answers([None if a is None else _norm(a) for a in answers], lambda rep, a: False)


def classes_in_pool(answer_lists: list[list[str | None]], use_math_verify: bool, pool, timeout: float = 30.0):
    """Answer classes of several lists in the verifier's pool (directly without one). -> (classes per list, fallbacks):
    a list whose grouping fails or times out is grouped by `exact_classes` and counted as a fallback."""
    if pool is None:
        return [cluster_answers(a, use_math_verify) for a in answer_lists], 0
    outcomes = pool.map(cluster_answers, [(a, use_math_verify) for a in answer_lists], timeout=timeout) if answer_lists else []
    out, fallbacks = [], 0
    for a, o in zip(answer_lists, outcomes):
        if o is not None and o.ok:
            out.append(o.value)
        else:
            fallbacks += 1
            out.append(exact_classes(a))
    return out, fallbacks
