"""The environment protocol and the registry of named environments (`load_env` is in envs.py, beside the built-ins).

An episode: the state is the whole history (prompt, the model's turns, the observations), an action
is one generated turn, the environment answers it, the reward comes at the end.

    class MyEnv(Environment):
        tools = [calculator_tool()]                       # what the model may call (shown via the template)
        def reset(self, row: dict, seed: int) -> list[dict]:       # the opening conversation
            return [{"role": "user", "content": row["question"]}]
        def step(self, action: str) -> tuple[str | None, bool, dict]:
            ...                                           # (observation, done, info)
        def reward(self, episode) -> float | None:        # None: the reward does not apply
            ...

Only reset, step and reward are required; the base class is optional. `tools` is optional (an environment
without the attribute has no tools: the model answers in plain turns), and so are `metrics(episode)` and `bind`.
`reset` returns the opening conversation, a list of {"role", "content"} messages; a string is taken as the
one user message (`"What is 2 + 2?"` == `[{"role": "user", "content": "What is 2 + 2?"}]`); anything else is
refused naming the class (`start_messages`). `tools_of`, `bind_env` and `start_messages` are how the rollout
and the set-up read an environment, so a duck-typed one works like a subclass.

`reset` must be deterministic in (row, seed): the G samples of a group share one prompt. `step`
receives the turn's text (decoded for the environment only; the trajectory keeps the token ids) and
returns the observation the model sees next (None when done). `ToolEnv` implements `step` for the
usual case: parse the turn's tool calls with `self.format`, run them contained (tools.execute),
return their outputs; a turn without a call is the final answer and ends the episode.

Hidden data (tests, the gold answer) stays in the environment object in the trainer's process:
tools run elsewhere (the Python tool in a sandbox with its own temp dir) and never receive it.
"""

from __future__ import annotations

import inspect

from posttrain.agentic.tools import Tool, ToolResult, execute
from posttrain.errors import UserError


class Environment:
    """Base class; see the module docstring. One instance per episode (it may keep state)."""

    tools: list[Tool] = []
    max_tool_chars: int = 2000
    format = None  # set by the rollout (bind) before reset: the ToolFormat that parses calls

    def bind(self, tool_format) -> None:
        self.format = tool_format

    def reset(self, row: dict, seed: int) -> list[dict]:
        raise NotImplementedError

    def step(self, action: str) -> tuple[str | None, bool, dict]:
        raise NotImplementedError

    def reward(self, episode) -> float | None:
        raise NotImplementedError


class ToolEnv(Environment):
    """Tool calls in a turn are executed and their outputs returned; a turn without one ends the episode."""

    def step(self, action: str) -> tuple[str | None, bool, dict]:
        calls = self.format.parse(action)
        if not calls:
            return None, True, {"final": action}
        results: list[ToolResult] = [execute(c, {t.name: t for t in self.tools}, self.max_tool_chars) for c in calls]
        text = "\n".join(r.text for r in results)
        return text, False, {"tool_calls": [r.log() for r in results]}


# ---------------------------------------------------------------- registry (the built-ins register in envs.py)

ENVS: dict[str, type] = {}


def register_env(name: str):
    def deco(cls):
        ENVS[name] = cls
        return cls
    return deco


# ---------------------------------------------------------------- reading an environment (duck-typed or a subclass)


class EnvProtocolError(UserError):
    """An environment that does not follow the protocol (the message names the class and what it returned)."""


def tools_of(env) -> list[Tool]:
    """The environment's tools: its `tools` attribute, optional (missing or None: no tools)."""
    tools = getattr(env, "tools", None)
    name = type(env).__name__
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, dict)) or not hasattr(tools, "__iter__"):
        raise EnvProtocolError(f"env {name}: `tools` must be a list of posttrain.agentic.tools.Tool (got {type(tools).__name__})")
    tools = list(tools)
    bad = [t for t in tools if not isinstance(t, Tool)]
    if bad:
        raise EnvProtocolError(f"env {name}: `tools` holds a {type(bad[0]).__name__}, not a posttrain.agentic.tools.Tool "
                               "(build one with calculator_tool(), python_tool(), search_tool() or Tool(...))")
    return tools


def bind_env(env, tool_format) -> None:
    """Hand the tool format to the environment: its `bind` when it has one, else the `format` attribute (if settable)."""
    bind = getattr(env, "bind", None)
    if callable(bind):
        bind(tool_format)
        return
    try:
        env.format = tool_format
    except AttributeError:  # __slots__ or a read-only property: it does not parse calls itself
        pass


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def start_messages(env, row: dict, seed: int) -> list[dict]:
    """`env.reset(row, seed)` as the opening conversation: a list of {"role", "content"} messages, or a string
    (one user message). Anything else: EnvProtocolError saying what reset must return."""
    messages = env.reset(row, seed)
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    ok = isinstance(messages, (list, tuple)) and len(messages) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages)
    if not ok:
        raise EnvProtocolError(
            f"env {type(env).__name__}.reset(row, seed) must return the opening conversation: a non-empty list of "
            f"{{'role': ..., 'content': ...}} messages, or a string (the first user message); it returned {_shown(messages)}")
    return [dict(m) for m in messages]


def check_env_class(cls, where: str) -> None:
    missing = [m for m in ("reset", "step", "reward") if not callable(getattr(cls, m, None))]
    if not inspect.isclass(cls) or missing:
        raise UserError(f"env {where}: not an environment class (needs reset, step, reward; missing {missing})")
