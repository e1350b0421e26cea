"""Registry, composition, error reporting, format / language / overlong rewards, `posttrain score`."""

import json

import pytest

from posttrain.errors import DataError, UserError
from posttrain.rewards import registry
from posttrain.rewards.base import RewardError, completion_text, register
from posttrain.rewards.format import make_format_reward
from posttrain.rewards.language import script_share
from posttrain.rewards.registry import compose
from posttrain.rewards.shaping import (
    make_overlong_reward,
    overlong_defaults,
    overlong_penalty,
)

pytestmark = pytest.mark.timeout(120)


@register("test_const")
def _const(prompts, completions, value=None, **_):
    return [None if v is None else float(v) for v in value]


@register("test_boom")
def _boom(prompts, completions, **_):
    if any("boom" in completion_text(c) for c in completions):
        raise ValueError("exploded")
    return [1.0] * len(completions)


@register("test_nan")
def _nan(prompts, completions, **_):
    return [float("nan") if completion_text(c) == "nan" else 0.5 for c in completions]


def test_completion_text_takes_last_assistant_message():
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    assert completion_text(conv) == "a2" and completion_text("s") == "s"


def test_weighted_composition_and_none_semantics():
    r = compose("test_const:2.0,language:0.5")
    out = r(["p"] * 3, ["hello world", "hello", "123"], value=[1, None, 0.5])
    assert out[0] == pytest.approx(2.0 + 0.5)
    assert out[1] == pytest.approx(0.5)  # test_const is None: only language counts
    assert out[2] == pytest.approx(1.0)  # language None (no letters): only test_const
    assert r.last_metrics["rewards/test_const/none"] == 1
    assert r.last_metrics["rewards/test_const/mean"] == pytest.approx(0.75)
    assert compose("test_const")(["p"], ["x"], value=[None]) == [None]


def test_parse_spec_errors():
    with pytest.raises(UserError, match="did you mean 'math'"):
        compose("maht:1")
    with pytest.raises(UserError, match="not a number"):
        compose("math:abc")
    assert registry.parse_spec({"math": 2}) == [("math", 2.0)]


def test_raising_reward_is_reported_with_the_sample():
    r = compose("test_boom")
    with pytest.raises(RewardError) as e:
        r(["p"] * 3, ["ok", "boom here", "fine"])
    assert "sample 1" in str(e.value) and "boom here" in str(e.value) and "exploded" in str(e.value)
    rec = compose("test_boom", on_error="record")
    out = rec(["p"] * 3, ["ok", "boom here", "fine"])
    assert out == [1.0, None, 1.0]
    assert rec.last_errors == [{"reward": "test_boom", "index": 1, "error": "ValueError: exploded"}]


def test_nan_is_an_error_not_zero():
    with pytest.raises(RewardError, match="sample 1.*nan"):
        compose("test_nan")(["p"] * 2, ["x", "nan"])


def test_format_reward():
    f = make_format_reward()
    comps = ["<think>a</think><answer>b</answer>", "<think>a</think>\n<answer>b</answer>\n", "<answer>b</answer>",
             "x<think>a</think><answer>b</answer>", "<think>a</think><answer>b</answer><answer>c</answer>"]
    assert f(["p"] * 5, comps) == [1.0, 1.0, 0.0, 0.0, 0.0]
    g = make_format_reward(pattern=r"(a+)+b", timeout=1.0, workers=2)
    assert g(["p", "p"], ["aab", "a" * 40 + "c"]) == [1.0, 0.0]  # catastrophic backtracking is killed
    assert g.last_metrics["timeouts"] == 1


def test_language_consistency():
    assert script_share("Hello world", "en") == 1.0
    assert script_share("你好世界", "zh") == 1.0
    assert script_share("Hello 世界", "zh") == pytest.approx(2 / 7)
    assert script_share("The answer is $x^2$ and `code_here`", "en") == 1.0
    lang = registry.get("language").fn
    assert lang(["p", "p"], ["Привет мир", "hi"], language=["ru", "zh"]) == [1.0, 0.0]


@pytest.mark.parametrize("L,expected", [(0, 0.0), (3584, 0.0), (3585, -1 / 512), (3840, -0.5), (4096, -1.0), (5000, -1.0)])
def test_dapo_overlong_penalty(L, expected):
    # Lmax = 4096, Lcache = 512: 0 up to 3584, ((Lmax - Lcache) - L) / Lcache inside, -1 beyond
    assert overlong_penalty(L, 4096, 512) == pytest.approx(expected)


def test_overlong_reward_uses_completion_ids():
    r = make_overlong_reward(max_len=10, cache_len=4)
    assert r(["p"] * 2, ["a", "b"], completion_ids=[[1] * 6, [1] * 8]) == [0.0, -0.5]
    assert r(["p"], ["w " * 12]) == [-1.0]


def test_overlong_defaults_follow_dapo_ratio():
    # DAPO: 20,480-token limit, 4,096-token soft buffer (= 1/5)
    assert overlong_defaults(20480) == {"max_len": 20480, "cache_len": 4096}
    assert overlong_defaults(1024) == {"max_len": 1024, "cache_len": 205}  # round(204.8)
    assert overlong_defaults(2) == {"max_len": 2, "cache_len": 1}  # never a zero-width buffer
    r = make_overlong_reward(**overlong_defaults(10))  # Lcache = 2: soft limit at 8 tokens
    assert r(["p"] * 3, ["a"] * 3, completion_ids=[[1] * 8, [1] * 9, [1] * 11]) == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError):
        overlong_defaults(0)


# ---------------------------------------------------------------- rewards from the user's files

USER_REWARDS = '''
THRESHOLD = 3

def brevity(completions, max_words=10, **kwargs):
    """1 - words / max_words (TRL signature without prompts)."""
    return [1.0 - len(c.split()) / max_words for c in completions]

def exact(prompts, completions, answer):
    # no **kwargs: receives only the columns it names
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
exact.columns = ("answer",)

def fragile(prompts, completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("exploded")
    return [float("nan") if c == "nan" else 1.0 for c in completions]

def _private(prompts, completions, **kwargs):
    return [0.0] * len(completions)
'''


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    """my.py in the current directory (relative paths resolve from there), and a copy in sub/."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.py").write_text(USER_REWARDS)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my.py").write_text(USER_REWARDS)
    return tmp_path / "my.py"


def test_file_reward_composes_with_math(user_file):
    assert registry.parse_spec("my.py:brevity") == [("my.py:brevity", 1.0)]
    r = compose("math:1.0,my.py:brevity:0.1")
    assert [n for n, _ in r.parts] == ["math", "my.py:brevity"]
    out = r(["1+1?"] * 2, ["\\boxed{2}", "I think it is \\boxed{3}"], answer=["2", "2"])
    # math 1 and 0; brevity 1 - 1/10 = 0.9 and 1 - 5/10 = 0.5
    assert out == [pytest.approx(1.0 + 0.1 * 0.9), pytest.approx(0.1 * 0.5)]
    assert r.last_metrics["rewards/my.py:brevity/mean"] == pytest.approx(0.7)
    assert r.columns == {"math": ("answer",), "my.py:brevity": ()}
    # absolute path, dict form; the module is executed once per path
    again = compose({f"{user_file}:brevity": 2.0})
    assert again.parts == [("my.py:brevity", 2.0)]
    assert again.specs["my.py:brevity"].fn.fn is r.specs["my.py:brevity"].fn.fn


def test_file_reward_columns_and_keyword_filtering(user_file):
    r = compose("my.py:exact")
    assert r.columns == {"my.py:exact": ("answer",)}
    # `language` is dropped: exact() takes no **kwargs
    assert r(["p", "p"], ["4", "5"], answer=["4", "4"], language=["en", "en"]) == [1.0, 0.0]


def test_file_reward_options_are_keyword_arguments(user_file):
    r = compose("my.py:brevity", options={"my.py:brevity": {"max_words": 4}})
    assert r(["p"], ["one two three"]) == [pytest.approx(0.25)]
    # keyed by the path as written; a column of the same name loses to the option
    r = compose("sub/my.py:brevity", options={"sub/my.py:brevity": {"max_words": 2}})
    assert r(["p"], ["one"], max_words=[100]) == [pytest.approx(0.5)]
    with pytest.raises(UserError, match=r"'my.py:exact': no parameter named max_words \(it takes answer, completions, prompts\)"):
        compose("my.py:exact", options={"my.py:exact": {"max_words": 2}})


def test_file_reward_errors_name_the_problem(user_file, tmp_path):
    with pytest.raises(UserError, match="reward file not found: nope.py"):
        compose("math,nope.py:f")
    with pytest.raises(UserError, match=r"has no function 'brevty'; did you mean 'brevity'\? "
                                        r"\(functions in it: brevity, exact, fragile\)"):
        compose("my.py:brevty")
    with pytest.raises(UserError, match="my.py:THRESHOLD is a int, not a function"):
        compose("my.py:THRESHOLD")
    with pytest.raises(UserError, match=r"weight of 'my.py:brevity' is not a number: 'abc'"):
        compose("math:1.0,my.py:brevity:abc")
    with pytest.raises(UserError, match="name the function in the file: my.py:FUNCTION"):
        compose("my.py")
    with pytest.raises(UserError, match="two file rewards are named 'my.py:brevity'"):
        compose("my.py:brevity,sub/my.py:brevity")
    (tmp_path / "broken.py").write_text("x = 1\nraise RuntimeError('no gpu here')\n")
    with pytest.raises(UserError, match=r"reward file broken.py:2: importing it failed: RuntimeError: no gpu here"):
        compose("broken.py:f")
    (tmp_path / "sig.py").write_text("def f(x):\n    return [1.0]\n")
    with pytest.raises(UserError, match="must take `completions`"):
        compose("sig.py:f")


def test_file_reward_failures_name_reward_and_sample(user_file):
    with pytest.raises(RewardError) as e:
        compose("math:1.0,my.py:fragile:0.5")(["p"] * 3, ["\\boxed{1}", "boom here", "\\boxed{2}"], answer=["1"] * 3)
    msg = str(e.value)
    assert "reward 'my.py:fragile' failed on sample 1" in msg and "boom here" in msg and "exploded" in msg
    with pytest.raises(RewardError, match=r"'my.py:fragile' failed on sample 1 \(completion: 'nan'\): returned nan"):
        compose("my.py:fragile")(["p"] * 2, ["x", "nan"])
    rec = compose("my.py:fragile", on_error="record")
    assert rec(["p"] * 2, ["ok", "boom"]) == [1.0, None]
    assert rec.last_errors == [{"reward": "my.py:fragile", "index": 1, "error": "ValueError: exploded"}]


def test_score_cli_with_a_file_reward(user_file, capsys):
    from posttrain.rewards.cli import main

    _write(user_file.parent / "d.jsonl", [{"completion": "a b"}, {"completion": "a b c d"}])
    main(["data=d.jsonl", "reward=my.py:brevity:0.5", "output=o.jsonl", "workers=2",
          "reward_args={my.py:brevity: {max_words: 4}}"])
    rows = [json.loads(x) for x in (user_file.parent / "o.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rows] == [pytest.approx(0.25), pytest.approx(0.0)]
    assert rows[0]["rewards"] == {"my.py:brevity": 0.5}


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def test_score_cli(tmp_path, capsys):
    from posttrain.rewards.cli import main

    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    _write(data, [{"prompt": "1+1?", "completion": "<think>x</think><answer>\\boxed{2}</answer>", "answer": "2"},
                  {"prompt": "1+1?", "completion": [{"role": "assistant", "content": "\\boxed{3}"}], "answer": "2"}])
    main([f"data={data}", "reward=math:1.0,format:0.2", f"output={out}", "workers=2"])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["reward"] for r in rows] == [pytest.approx(1.2), 0.0]
    assert rows[0]["rewards"] == {"math": 1.0, "format": 1.0}
    text = capsys.readouterr().out
    assert "math" in text and "mean 0.5000" in text
    main([f"data={data}", "reward=math_answer_tag", f"output={out}", "reward_args={}"])


def test_score_cli_errors(tmp_path, capsys):
    from posttrain.rewards.cli import main

    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    with pytest.raises(UserError, match="unknown reward"):
        _write(data, [{"completion": "x", "answer": "1"}])
        main([f"data={data}", "reward=nope", f"output={out}"])
    _write(data, [{"completion": "x", "answer": "1"}, "{not json"])
    with pytest.raises(DataError, match=r"d.jsonl:2: invalid JSON"):
        main([f"data={data}", "reward=math", f"output={out}"])
    _write(data, [{"completion": "x", "answer": "1"}, {"completion": "y"}])
    with pytest.raises(DataError, match=r"d.jsonl:2: answer: missing \(needed by reward 'math'\)"):
        main([f"data={data}", "reward=math", f"output={out}"])
    _write(data, [{"completion": 5, "answer": "1"}])
    with pytest.raises(DataError, match="completion"):
        main([f"data={data}", "reward=math", f"output={out}"])
    _write(data, [{"completion": "ok"}, {"completion": "boom"}])
    with pytest.raises(UserError, match=r"1 reward error\(s\), first .*d.jsonl:2: reward 'test_boom'"):  # one line, exit 2
        main([f"data={data}", "reward=test_boom", f"output={out}"])
    assert "d.jsonl:2: reward 'test_boom'" in capsys.readouterr().err
    assert "reward_errors" in out.read_text().splitlines()[1]  # every row written, the failed one marked


def test_cli_router_reports_user_errors(tmp_path, capsys):
    from posttrain.cli import main

    assert main(["score", "reward=nope", f"data={tmp_path}/x.jsonl", f"output={tmp_path}/o.jsonl"]) == 2
    assert "unknown reward" in capsys.readouterr().err


def test_verifier_part_keeps_the_parts_that_read_a_ground_truth():
    from posttrain.rewards.registry import compose

    assert compose("math,format:0.2").verifiers == ["math"]
    assert compose("math,format:0.2").verifier_part().parts == [("math", 1.0)]
    assert compose("math").verifier_part() is None  # all verifiers: the reward itself
    assert compose("format").verifier_part() is None  # none: nothing trusted to fall back on
