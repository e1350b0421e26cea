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


def check_env_class(cls, where: str) -> None:
    missing = [m for m in ("reset", "step", "reward") if not callable(getattr(cls, m, None))]
    if not inspect.isclass(cls) or missing:
        raise UserError(f"env {where}: not an environment class (needs reset, step, reward; missing {missing})")
