"""Agentic tools: safe calculator, mock search, containment of failing tools, hostile programs through
the Python tool (the code verifier's hostile corpus), hidden tests out of reach."""

import copy
import os
import time

import pytest

from posttrain.agentic import calculator as calc
from posttrain.agentic.envs import load_env
from posttrain.agentic.formats import make_format
from posttrain.agentic.rollout import new_episodes, run_episodes
from posttrain.agentic.search import MockSearch
from posttrain.agentic.settings import AgentSettings
from posttrain.agentic.tools import Tool, ToolCall, execute
from posttrain.errors import UserError
from posttrain.rewards.sandbox import IS_ROOT, _procs_of_uid
from posttrain.rollout.settings import SamplingSettings
from tests.agentic_envs import PyEnv, ScriptedBackend
from tests.test_rewards_sandbox import HOSTILE, MARK

# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize("expr,value", [("347 * 86", 29842), ("2**10 - 1", 1023), ("(1 + 2) * 3", 9), ("7 / 2", 3.5),
                                        ("7 // 2", 3), ("-3 + 5 % 3", -1), ("sqrt(16)", 4.0), ("12 × 3", 36), ("2^5", 32)])
def test_calculator_evaluates(expr, value):
    assert calc.evaluate(expr) == value


@pytest.mark.parametrize("expr,why", [
    ("__import__('os').system('true')", "not allowed"), ("open('/etc/passwd')", "not allowed"),
    ("(1).__class__", "not allowed"), ("x + 1", "not allowed"), ("'a' * 3", "not allowed"),
    ("[i for i in range(9)]", "not allowed"), ("9 ** 9 ** 9", "exponent"), ("1 / 0", "division by zero"),
    ("1 +", "cannot parse"), ("1+" * 150 + "1", "longer than"), ("10 ** 99 * 10 ** 99", "digits"), ("", "empty"),
])
def test_calculator_refuses(expr, why):
    with pytest.raises(calc.CalcError, match=why):
        calc.evaluate(expr)


def test_calculator_formats_values():
    assert calc.format_value(29842) == "29842" and calc.format_value(4.0) == "4" and calc.format_value(1 / 3) == "0.3333333333"


# ---------------------------------------------------------------- search


DOCS = [{"title": "Paris", "text": "Paris is the capital of France."},
        {"title": "Berlin", "text": "Berlin is the capital of Germany."},
        {"title": "Cheese", "text": "France makes many cheeses; Brie comes from France."}]


def test_mock_search_ranks_by_bm25():
    s = MockSearch(DOCS, top_k=2)
    out = s("capital of Germany")
    assert out.splitlines()[0].startswith("[1] Berlin")
    assert "no results" in s("volcano")
    scores = s.scores("France")
    assert scores[1] == 0 and scores[0] > 0 and scores[2] > scores[0]  # two mentions beat one (BM25 tf)


# ---------------------------------------------------------------- containment of in-process tools


def _tool(fn, timeout=0.5):
    return Tool("t", "test tool", {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}, fn, timeout)


def test_execute_contains_raise_hang_flood_and_bad_calls():
    tools = {"t": _tool(lambda x: 1 / 0)}
    r = execute(ToolCall("t", {"x": "1"}), tools)
    assert r.status == "error" and "ZeroDivisionError" in r.text
    t0 = time.perf_counter()
    r = execute(ToolCall("t", {"x": "1"}), {"t": _tool(lambda x: time.sleep(30), 0.3)})
    assert r.status == "timeout" and "timed out" in r.text and time.perf_counter() - t0 < 2
    r = execute(ToolCall("t", {"x": "1"}), {"t": _tool(lambda x: "y" * 10**6)}, max_chars=100)
    assert r.truncated and len(r.text) < 200 and "truncated" in r.text
    assert execute(ToolCall("nope", {}), tools).status == "unknown_tool"
    assert execute(ToolCall("t", {}), tools).status == "bad_call"
    assert execute(ToolCall("t", {"x": "1", "y": 2}), tools).status == "bad_call"
    assert execute(ToolCall("", {}, "{", error="not JSON"), tools).status == "bad_call"
    assert set(r.log()) >= {"name", "arguments", "status", "seconds", "output_chars", "truncated"}


# ---------------------------------------------------------------- hostile programs through the Python tool


@pytest.fixture(scope="module")
def tag_tok(tiny_tok):
    return copy.deepcopy(tiny_tok)


def _call_ids(tok, fmt, code: str) -> list[int]:
    return tok(fmt.render_call("python", {"code": code}), add_special_tokens=False)["input_ids"]


@pytest.mark.timeout(120)
def test_hostile_programs_are_contained(tag_tok):
    """Every program of the sandbox's hostile corpus runs as a Python tool call inside an episode: each
    episode goes on to its next turn and ends cleanly, the host is untouched, no sandbox process
    survives, the hidden test never appears in an observation."""
    tok = tag_tok
    programs = dict(HOSTILE)
    fmt = make_format(tok, PyEnv().tools, "tag")
    names = sorted(programs)
    final = tok("done", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # first turns in group order (one request per group), then the second turns
    backend = ScriptedBackend([_call_ids(tok, fmt, programs[n]) for n in names] + [final] * len(names), tok.eos_token_id)
    groups = new_episodes(PyEnv, [{"name": n} for n in names], 1, fmt, seed=0)
    t0 = time.perf_counter()
    run_episodes(backend, fmt, groups, AgentSettings(max_turns=3, env_workers=4, max_observation_tokens=64),
                 SamplingSettings(max_new_tokens=64), tok)
    took = time.perf_counter() - t0
    assert took < 90, f"hostile episodes took {took:.1f} s"
    assert not os.path.exists(MARK), "a program wrote outside its work dir"
    for name, (ep,) in zip(names, groups):
        assert ep.finish_reason == "answer" and len(ep.turns) == 2, (name, ep.finish_reason)
        (call,) = ep.turns[0].tool_calls
        assert call["status"] in ("ok", "error", "timeout"), (name, call)
        assert call["output_chars"] <= 2100  # flooding is truncated (max_tool_chars + marker)
        assert "HIDDEN-TEST-7f3a" not in (ep.turns[0].observation or ""), name
        assert ep.turns[0].returned <= 64 + 20  # observation tokens capped (+ glue)
    if IS_ROOT:
        time.sleep(0.2)
        leftovers = [p for p in os.listdir("/proc") if p.isdigit() and 200_000 <= _uid(p) < 2_000_000]
        assert not [p for p in leftovers if _procs_of_uid(_uid(p), live_only=True)], "sandbox processes survived"


@pytest.mark.timeout(60)
def test_hidden_test_is_out_of_reach_of_the_python_tool(tag_tok):
    """A program hunting the filesystem and other processes for the environment's hidden test finds nothing."""
    tok = tag_tok
    code = (  # the files it can reach: its dir, /tmp two levels down, other processes
        "import os, glob\nfound = False\n"
        "paths = glob.glob('*') + glob.glob('/tmp/*') + glob.glob('/tmp/*/*') + glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ')\n"
        "for p in paths[:3000]:\n"
        "    try:\n        found = found or 'HIDDEN-TEST-7f3a' in open(p, errors='ignore').read(1 << 16)\n    except Exception: pass\n"
        "print('FOUND' if found else 'NOTFOUND')\n")
    fmt = make_format(tok, PyEnv().tools, "tag")
    final = tok("done", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    backend = ScriptedBackend([_call_ids(tok, fmt, code), final], tok.eos_token_id)
    groups = new_episodes(lambda: PyEnv(wall_s=20.0), [{}], 1, fmt, seed=0)
    run_episodes(backend, fmt, groups, AgentSettings(max_turns=2), SamplingSettings(max_new_tokens=64), tok)
    ep = groups[0][0]
    assert ep.env.tests == [PyEnv.HIDDEN]  # the environment holds it
    assert ep.turns[0].tool_calls[0]["status"] == "ok", ep.turns[0].observation
    assert "NOTFOUND" in ep.turns[0].observation, ep.turns[0].observation


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


# ---------------------------------------------------------------- environment loading


def test_load_env_by_name_and_path(tmp_path):
    assert type(load_env("calculator")()).__name__ == "CalculatorEnv"
    assert type(load_env("tests/agentic_envs.py:CalcEnv")()).__name__ == "CalcEnv"
    with pytest.raises(UserError, match="unknown env 'nope'"):
        load_env("nope")
    with pytest.raises(UserError, match="defines no 'Missing'"):
        load_env("tests/agentic_envs.py:Missing")
    with pytest.raises(UserError, match="not found"):
        load_env(str(tmp_path / "none.py") + ":X")
    bad = tmp_path / "bad_env.py"
    bad.write_text("class NotEnv:\n    def reset(self, row, seed): return []\n")
    with pytest.raises(UserError, match="missing \\['step', 'reward'\\]"):
        load_env(f"{bad}:NotEnv")
    with pytest.raises(UserError, match="bad env_args"):
        load_env("calculator", {"no_such_option": 1})


# ---------------------------------------------------------------- demonstrations for the SFT warm-up


def test_calculator_demonstrations_train_only_the_assistant_turns(tiny_tok):
    from posttrain.agentic.demos import demonstrations
    from posttrain.agentic.envs import CalculatorEnv
    from posttrain.data.templates import render_messages
    from tests.test_templates import SMOLLM2

    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = SMOLLM2
    rows = demonstrations(tok, "multiply_3x2:3", seed=1)
    msgs = rows[0]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    a, b = msgs[1]["content"].split("What is ")[1].split("?")[0].split(" * ")
    assert msgs[3]["content"] == str(int(a) * int(b)) and msgs[4]["content"].endswith(f"The answer is {int(a) * int(b)}.")
    fmt = make_format(tok, CalculatorEnv().tools)
    (call,) = fmt.parse(msgs[2]["content"])  # the rollout's parser reads what the demonstration teaches
    assert call.arguments == {"expression": f"{a} * {b}"}
    out = render_messages(tok, msgs)
    trained = [tok.decode(out.input_ids[s:e]) for s, e in out.spans]
    assert trained == [msgs[2]["content"] + "<|im_end|>", msgs[4]["content"] + "<|im_end|>"]
