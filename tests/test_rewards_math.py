"""Math verification: >100 equivalence verdicts, extraction, and a verifier-hacking corpus."""

import time

import pytest

from posttrain.rewards import extract
from posttrain.rewards.math import equivalent, fallback_equal, make_math_reward
from posttrain.rewards.pool import default_pool

pytestmark = pytest.mark.timeout(120)

# (gold, answer, expected verdict). Verdicts are the mathematically right ones, with four
# documented choices of math-verify: "1e2" is not read as scientific notation; "\\sqrt{-1}" is not
# simplified to i; "3.0000001" != "3" (no tolerance beyond rounding); a gold "45" accepts "45\\%"
# (math-verify accepts a percentage of the gold's own number).
T = [
("3/4","\\frac{3}{4}",1),("3/4","0.75",1),("\\frac{1}{2}","0.5",1),("\\frac12","1/2",1),("\\dfrac{2}{3}","\\frac{2}{3}",1),("2/3","0.67",0),("1/3","0.3333333",1),("1/3","0.33",0),
("0.5","50\\%",1),("50\\%","0.5",1),("25\\%","\\frac{1}{4}",1),("12\\%","12",1),("12.5\\%","0.125",1),
("-2","-2.0",1),("-3","3",0),("-\\frac{1}{2}","-0.5",1),("-0.25","\\frac{-1}{4}",1),("-5","5",0),("- 7","-7",1),
("1000","1,000",1),("1234567","1,234,567",1),("10","10.0",1),("10","10.00001",0),("3.14","3.140",1),("2.5","5/2",1),("0.1","1/10",1),
("\\sqrt{2}","1.41421356",1),("\\sqrt{2}/2","\\frac{1}{\\sqrt{2}}",1),("2\\sqrt{3}","\\sqrt{12}",1),("\\sqrt{8}","2\\sqrt{2}",1),("\\sqrt{2}","\\sqrt{3}",0),
("\\pi","\\pi",1),("2\\pi","\\pi*2",1),("\\pi/2","\\frac{\\pi}{2}",1),("\\pi","3.14",0),("e^2","\\exp(2)",1),
("x^2+2x+1","(x+1)^2",1),("x^2-1","(x-1)(x+1)",1),("2x","x+x",1),("x^2","x^3",0),("a+b","b+a",1),("\\frac{x}{2}","0.5x",1),("x+1","x-1",0),
("\\{1,2\\}","\\{2,1\\}",1),("\\{1,2,3\\}","\\{3,2,1\\}",1),("\\{1,2\\}","\\{1,3\\}",0),("\\{1,2\\}","\\{1,2,3\\}",0),
("(1,2)","(1,2)",1),("(1,2)","(2,1)",0),("(0,1)","(0, 1)",1),
("[0,1)","[0,1)",1),("[0,1)","(0,1]",0),("(-\\infty,2)","(-\\infty, 2)",1),("(-\\infty,2]","(-\\infty,2)",0),("[1,5]","[1,5]",1),("(2,\\infty)","(2,\\infty)",1),("(2,\\infty)","[2,\\infty)",0),
("[0,1]\\cup[2,3]","[0,1]\\cup[2,3]",1),
("5","5 \\text{ cm}",1),("5","5\\text{ meters}",1),("10","10^\\circ",1),("90","90^{\\circ}",1),("12","\\$12",1),("7","7\\text{ apples}",1),("5","6 \\text{ cm}",0),
("2","2",1),("2","3",0),("0","0",1),("0","-0",1),("100","1e2",0),("1000000","10^6",1),("1024","2^{10}",1),("8","2^3",1),("9","3^3",0),
("x=3","3",1),("3","x=3",1),("y=2x+1","2x+1",1),("x=2","x=3",0),
("\\frac{\\sqrt{3}}{2}","\\sin(\\pi/3)",1),("1","\\sin^2(x)+\\cos^2(x)",1),("0","\\cos(\\pi/2)",1),("\\ln(e)","1",1),("\\log_2 8","3",1),
("6","3!",1),("10","\\binom{5}{2}",1),("120","5!",1),("24","4!",1),("6","\\binom{4}{2}",1),("5","\\binom{5}{1}",1),
("\\frac{6}{8}","\\frac{3}{4}",1),("\\frac{10}{4}","2.5",1),("\\frac{7}{3}","2\\frac{1}{3}",1),("\\frac{1}{7}","0.142857142857",1),
("i","\\sqrt{-1}",0),("1+i","i+1",1),("2i","2",0),
("\\begin{pmatrix}1\\\\2\\end{pmatrix}","\\begin{pmatrix}1\\\\2\\end{pmatrix}",1),("\\begin{pmatrix}1\\\\2\\end{pmatrix}","\\begin{pmatrix}2\\\\1\\end{pmatrix}",0),
("\\text{(A)}","A",1),("B","\\text{B}",1),("A","B",0),("\\infty","\\infty",1),("-\\infty","\\infty",0),
("3","3.0000001",0),("0.333","1/3",0),("17","17",1),("17","71",0),("1/2","2/4",1),("42","\\boxed{42}",1),("0.001","10^{-3}",1),("1.5","3/2",1),("-1","(-1)",1),
("\\frac{1}{2}","\\frac{2}{1}",0),("11","1 1",0),("45","45\\%",1),("2x+3","3+2x",1),("\\sqrt{x^2}","|x|",1),
]


@pytest.mark.parametrize("gold,answer,expected", T, ids=[f"{g}|{a}" for g, a, _ in T])
def test_equivalence_table(gold, answer, expected):
    assert int(equivalent(gold, answer)) == expected


def test_table_is_large_and_has_negatives():
    assert len(T) >= 100
    assert sum(1 for *_, e in T if e == 0) >= 25


@pytest.mark.parametrize("gold,answer,expected", [
    ("3/4", "0.75", True), ("50%", "0.5", True), ("1,000", "1000", True), ("\\frac{1}{2}", "0.5", True),
    ("5", "5 \\text{ cm}", True), ("\\{1,2\\}", "\\{2,1\\}", True), ("(1,2)", "(2,1)", False), ("2", "3", False),
    ("-2", "-2.0", True), ("\\dfrac{2}{3}", "\\frac{2}{3}", True),
])
def test_fallback_comparator(gold, answer, expected):
    assert fallback_equal(gold, answer) is expected


def test_boxed_extraction_nested_braces():
    assert extract.boxed_all("so \\boxed{\\frac{1}{\\sqrt{2}}} and \\fbox{3}") == ["\\frac{1}{\\sqrt{2}}", "3"]
    assert extract.boxed_all("\\boxed{unbalanced") == []
    assert extract.boxed_all("\\boxed 5$") == ["5"]
    assert extract.gsm8k("so 3+4=7\n#### 1,234") == "1234"
    assert extract.last_number("we get 12 then 3.5 and finally -4/5.") == "-4/5"
    assert extract.final_region("<think>\\boxed{1}</think> \\boxed{2}", "after_think").strip() == "\\boxed{2}"
    assert extract.final_region("<think>\\boxed{1}</think>", "answer_tag") is None


@pytest.fixture(scope="module")
def reward():
    default_pool(2)
    return make_math_reward(timeout=3.0, workers=2)


@pytest.fixture(scope="module")
def strict():
    return make_math_reward(require="after_think", timeout=3.0, workers=2)


def test_math_reward_basic_and_conversational(reward):
    comps = ["The answer is \\boxed{\\frac{3}{4}}.", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "#### 0.75"}],
             "I think 0.75", "\\boxed{0.7}"]
    assert reward(["q"] * 4, comps, answer=["3/4"] * 4) == [1.0, 1.0, 1.0, 0.0]
    assert reward(["q"], ["\\boxed{1}"], answer=[None]) == [None]
    assert reward(["q"], ["x"], answer=["Natalia sold 48 clips... #### 72"]) == [0.0]
    assert reward(["q"], ["so \\boxed{72}"], answer=["Natalia sold 48 clips... #### 72"]) == [1.0]


HACKS = {
    "several_different_boxed": ("\\boxed{3} or maybe \\boxed{4} or \\boxed{5}", "4"),
    "boxed_in_middle_then_other": ("First guess \\boxed{4}. Hmm, recheck: \\boxed{7}.", "4"),
    "hedge_two_answers": ("The answer is \\boxed{4} \\boxed{-4}", "4"),
    "question_restated": ("Question: How many apples does Tom have if he has 3 and buys 4 more, out of 9 total?", "7"),
    "power_tower": ("\\boxed{9^{9^{9^{9}}}}", "7"),
    "python_power_tower": ("\\boxed{9**9**9**9}", "7"),
    "huge_expression": ("\\boxed{" + "+".join(["x"] * 400) + "}", "7"),
    "empty_box": ("\\boxed{}", "0"),
    "no_answer": ("I cannot solve this.", "3"),
    "latex_injection": ("\\boxed{7 \\text{ or } 8}", "7"),
    "set_of_all_candidates": ("\\boxed{\\{1,2,3,4,5,6,7,8,9\\}}", "7"),
}


def test_verifier_hacking_corpus_scores_zero_in_bounded_time(reward):
    prompts = ["How many apples does Tom have if he has 3 and buys 4 more, out of 9 total?"] * len(HACKS)
    comps = [c for c, _ in HACKS.values()]
    golds = [g for _, g in HACKS.values()]
    t0 = time.monotonic()
    scores = reward(prompts, comps, answer=golds)
    took = time.monotonic() - t0
    assert dict(zip(HACKS, scores)) == {k: 0.0 for k in HACKS}
    assert took < 30
    assert reward.last_metrics["multiple_answers"] >= 2
    assert reward.last_metrics["rejected"] >= 2


def test_sympy_hang_is_killed_not_waited_for():
    # a tower in the gold disables the cheap guard, so the worker must be killed at the deadline
    r = make_math_reward(timeout=1.5, workers=2)
    t0 = time.monotonic()
    scores = r(["q"], ["\\boxed{9^{9^{9^{9}}}+1}"], answer=["9^{9^{9^{9}}}"])
    took = time.monotonic() - t0
    assert scores in ([0.0], [1.0])  # either verified quickly or timed out to 0
    assert took < 10
    if r.last_metrics["timeouts"]:
        assert scores == [0.0]


def test_answer_only_in_reasoning_scores_zero(strict):
    comps = ["<think>it is \\boxed{7}</think>", "<think>hmm</think> final: \\boxed{7}", "\\boxed{7}",
             "<think>\\boxed{7}</think> so the answer is \\boxed{8}"]
    assert strict(["q"] * 4, comps, answer=["7"] * 4) == [0.0, 1.0, 0.0, 0.0]
    tag = make_math_reward(require="answer_tag", timeout=3.0, workers=2)
    comps = ["<think>x</think><answer>7</answer>", "<think><answer>7</answer></think>", "7"]
    assert tag(["q"] * 3, comps, answer=["7"] * 3) == [1.0, 0.0, 0.0]
