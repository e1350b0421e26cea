"""Frozen, versioned judge prompts. A prompt's text never changes once released: a new wording is a new
version, and every judge output records the version it was made with (and `digest(version)`, a hash of
the text, which tests pin so that an edit without a new version fails).

Two tasks, each in two variants: an explanation then the verdict in double brackets, and a direct one
(the verdict alone: fewer tokens, and what a small local judge follows best):

    pairwise-v1          which of two responses is better -> explanation, then "[[A]]" or "[[B]]"
    pairwise-direct-v1   the same question -> "A" or "B"
    score-v1             rate one response on a rubric from 1 to 10 -> explanation, then "Rating: [[7]]"
    score-direct-v1      the same -> "7"

The formats follow MT-Bench's judge prompts (Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench
and Chatbot Arena": a verdict in double brackets after a short explanation, pairwise and single-answer
grading); the wording here is our own. The pairwise prompts force a choice (no tie option): ties come
from asking in both orders and getting two different answers (position swap, as MT-Bench does).
`{rubric}` is the rubric or the written constitution; DEFAULT_RUBRIC is used when none is given.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class JudgePrompt:
    version: str
    kind: str  # "pairwise" | "score"
    system: str
    user: str  # str.format template: pairwise {question} {response_a} {response_b}; score {question} {response} {rubric}


DEFAULT_RUBRIC = ("Helpfulness, correctness and clarity: does the response answer the question that was asked, "
                  "is what it says true, and is it easy to follow? Length is not a quality in itself.")

_SYSTEM = "You are a careful, impartial judge of AI assistant responses."

_PAIRWISE_BODY = (
    "Compare the two responses below to the user's question and decide which one is better. "
    "Judge helpfulness, correctness, relevance and clarity. Do not let the order of the responses, "
    "their length or the assistants' names influence you.\n\n"
    "[Question]\n{question}\n\n"
    "[Response A]\n{response_a}\n[End of Response A]\n\n"
    "[Response B]\n{response_b}\n[End of Response B]\n\n"
)

_SCORE_BODY = (
    "Rate the response below to the user's question against this rubric:\n{rubric}\n\n"
    "[Question]\n{question}\n\n"
    "[Response]\n{response}\n[End of Response]\n\n"
)

PROMPTS: dict[str, JudgePrompt] = {
    "pairwise-v1": JudgePrompt(
        "pairwise-v1", "pairwise", _SYSTEM,
        _PAIRWISE_BODY + "First explain your decision in a few sentences. Then give your verdict on the last line, "
                         "exactly \"[[A]]\" if Response A is better or \"[[B]]\" if Response B is better."),
    "pairwise-direct-v1": JudgePrompt(
        "pairwise-direct-v1", "pairwise", _SYSTEM,
        _PAIRWISE_BODY + "Which response is better, A or B? Answer with the letter only."),
    "score-v1": JudgePrompt(
        "score-v1", "score", _SYSTEM,
        _SCORE_BODY + "First explain your rating in a few sentences. Then give the rating on the last line as an integer "
                      "from 1 (worst) to 10 (best) in double brackets, for example \"Rating: [[6]]\"."),
    "score-direct-v1": JudgePrompt(
        "score-direct-v1", "score", _SYSTEM,
        _SCORE_BODY + "How good is the response, from 1 (worst) to 10 (best)? Answer with the number only."),
}


def get(version: str, kind: str | None = None) -> JudgePrompt:
    """The prompt of `version`; `kind` checks it is a pairwise or a score prompt."""
    if version not in PROMPTS:
        raise KeyError(f"unknown judge prompt version '{version}' (known: {', '.join(PROMPTS)})")
    p = PROMPTS[version]
    if kind is not None and p.kind != kind:
        known = ", ".join(v for v, q in PROMPTS.items() if q.kind == kind)
        raise KeyError(f"judge prompt '{version}' is a {p.kind} prompt; a {kind} prompt is needed ({known})")
    return p


def digest(version: str) -> str:
    """sha256 of the prompt's text (system, user template): recorded in outputs, pinned by tests."""
    p = PROMPTS[version]
    return hashlib.sha256(f"{p.kind}\x00{p.system}\x00{p.user}".encode()).hexdigest()


def render(prompt: JudgePrompt, **fields: str) -> list[dict]:
    """Chat messages for the judge. Braces in the fields are safe (values are substituted once)."""
    return [{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.user.format(**fields)}]
