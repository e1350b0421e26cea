"""The environment protocol as documented (posttrain/agentic/env.py, docs/agentic.md): reset/step/reward are all an
environment needs (no base class, no `tools`: no tools); reset may return a string (the first user message); a
reset or `tools` of another shape is refused with what it must be, not a raw AttributeError / TypeError."""

import json

import pytest

from agentic_envs import DictReset, Echo, StringEcho, ToolsByName
from conftest import write_jsonl
from posttrain.agentic.env import EnvProtocolError, bind_env, start_messages, tools_of
from posttrain.cli import main as cli

PROMPTS = [{"prompt": "What is 2 + 2?"}, {"prompt": "Name a colour."}]


def test_duck_typed_env_reads_as_no_tools():
    env = Echo()
    assert tools_of(env) == []
    bind_env(env, "FMT")  # no bind method: the format is set as an attribute
    assert env.format == "FMT"
    assert start_messages(env, {"prompt": "hi"}, 0) == [{"role": "user", "content": "hi"}]
    assert start_messages(StringEcho(), {}, 0) == [{"role": "user", "content": "Say something."}]


def test_reset_and_tools_of_the_wrong_shape_are_refused_clearly():
    with pytest.raises(EnvProtocolError, match=r"DictReset.reset\(row, seed\) must return the opening conversation: a "
                                               r"non-empty list of \{'role': ..., 'content': ...\} messages, or a string .* returned dict"):
        start_messages(DictReset(), {}, 0)
    with pytest.raises(EnvProtocolError, match="must return the opening conversation.*returned list \\[\\]"):
        start_messages(type("Empty", (Echo,), {"reset": lambda self, row, seed: []})(), {}, 0)
    with pytest.raises(EnvProtocolError, match="ToolsByName: `tools` holds a str, not a posttrain.agentic.tools.Tool"):
        tools_of(ToolsByName())


def test_rl_trains_an_env_without_tools(tmp_path):
    """`posttrain rl env=...:Echo` used to die with AttributeError: 'Echo' object has no attribute 'tools'."""
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "run"
    assert cli(["rl", "model=tiny-random", f"data={data}", f"output_dir={out}", "env=tests/agentic_envs.py:Echo",
                "prompts_per_step=2", "group_size=2", "max_new_tokens=4", "max_steps=1", "progress=false"]) == 0
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["agent/turns"] == 1 and row["agent/tool_calls"] == 0


def test_eval_env_whose_reset_returns_a_string(tmp_path):
    """It used to fail with TypeError: string indices must be integers."""
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    assert cli(["eval", "env=tests/agentic_envs.py:StringEcho", f"data={data}", "n=1", "max_new_tokens=4",
                f"output_dir={tmp_path / 'e'}"]) == 0
    doc = json.loads((tmp_path / "e" / "results.json").read_text())
    assert len(doc["items"]) == 2


def test_cli_reports_a_bad_reset_as_a_user_error(tmp_path, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    assert cli(["eval", "--env", "tests/agentic_envs.py:DictReset", f"data={data}", "n=1", "max_new_tokens=4",
                f"output_dir={tmp_path / 'e'}"]) == 2
    assert "DictReset.reset(row, seed) must return the opening conversation" in capsys.readouterr().err
