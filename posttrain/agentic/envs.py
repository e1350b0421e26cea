"""Built-in environments (`env=calculator`, `env=python_code`, `env=search_qa`) and `load_env`, which finds a
registered name (these, once this module is imported) or loads `env=path/to/file.py:Class`.

    calculator   rows {prompt, answer}: arithmetic with a calculator tool; reward 1 when the final
                 answer's last number equals `answer`. Metric tool_correct: a call returned the answer.
    python_code  rows {prompt, tests}: write a function, try it with the Python tool (sandboxed); the
                 final answer's code is run against the hidden `tests` in the code verifier's sandbox.
    search_qa    rows {prompt, answer[, documents]}: look things up with a mock search over local
                 documents (env_args documents=FILE.jsonl or a `documents` column); reward 1 when the
                 final answer contains `answer` (case-insensitive).
"""

from __future__ import annotations

import re
from typing import Callable

from posttrain.agentic.env import ENVS, Environment, ToolEnv, check_env_class, register_env
from posttrain.agentic.tools import calculator_tool, python_tool, search_tool
from posttrain.errors import UserError
from posttrain.rewards.code import extract_code, run_sample
from posttrain.rewards.pool import default_pool

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def opening(row: dict, system_prompt: str = "") -> list[dict]:
    """The row's prompt as a conversation (a string becomes one user message)."""
    prompt = row["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text or "")
    return found[-1].replace(",", "") if found else None


def same_number(a: str | None, b) -> bool:
    try:
        return a is not None and abs(float(a) - float(str(b).replace(",", ""))) < 1e-9
    except ValueError:
        return False


@register_env("calculator")
class CalculatorEnv(ToolEnv):
    def __init__(self, system_prompt: str = "", timeout_s: float = 2.0):
        self.system_prompt = system_prompt
        self.tools = [calculator_tool(timeout_s)]

    def reset(self, row: dict, seed: int) -> list[dict]:
        self.answer = row["answer"]
        return opening(row, self.system_prompt)

    def reward(self, episode) -> float | None:
        if episode.finish_reason != "answer":
            return 0.0
        return float(same_number(last_number(episode.final_text), self.answer))

    def metrics(self, episode) -> dict:
        """tool_correct: some calculator call returned the gold answer."""
        hit = any(c["status"] == "ok" and same_number(c.get("output"), self.answer)
                  for t in episode.turns for c in t.tool_calls)
        return {"tool_correct": float(hit)}


@register_env("python_code")
class PythonCodeEnv(ToolEnv):
    def __init__(self, system_prompt: str = "", wall_s: float = 5.0, test_wall_s: float = 10.0, **sandbox_opts):
        self.system_prompt, self.test_wall_s = system_prompt, test_wall_s
        self.sandbox_opts = sandbox_opts
        self.tools = [python_tool(wall_s=wall_s, **sandbox_opts)]

    def reset(self, row: dict, seed: int) -> list[dict]:
        self._tests = row.get("tests")  # hidden: kept here, never passed to a tool
        self._stdio = row.get("stdio")
        if self._tests is None and self._stdio is None:
            raise ValueError("python_code rows need 'tests' or 'stdio'")
        return opening(row, self.system_prompt)

    def reward(self, episode) -> float | None:
        if episode.finish_reason != "answer":
            return 0.0
        job = (extract_code(episode.final_text), self._tests, self._stdio, {"wall_s": self.test_wall_s},
               self.sandbox_opts, "local", None)
        out = default_pool().map(run_sample, [job], timeout=self.test_wall_s * max(1, len(self._stdio or [1])) + 15)[0]
        if not out.ok:
            return 0.0
        r = out.value
        return float(r["total"] > 0 and r["passed"] == r["total"])


@register_env("search_qa")
class SearchEnv(ToolEnv):
    def __init__(self, documents=None, system_prompt: str = "", top_k: int = 3):
        self.system_prompt, self.top_k, self.documents = system_prompt, top_k, documents
        self.tools = [search_tool(documents if documents is not None else [], top_k)]

    def reset(self, row: dict, seed: int) -> list[dict]:
        if "documents" in row:  # per-row documents replace the env's collection
            self.tools = [search_tool(row["documents"], self.top_k)]
        self.answer = str(row["answer"])
        return opening(row, self.system_prompt)

    def reward(self, episode) -> float | None:
        if episode.finish_reason != "answer":
            return 0.0
        return float(self.answer.lower() in (episode.final_text or "").lower())


def load_env(spec: str, options: dict | None = None) -> Callable[[], Environment]:
    """A factory of environments from a registered name or 'path/to/file.py:Class'; options are
    keyword arguments of the class. Errors name the file and class."""
    options = dict(options or {})
    if ".py:" in spec:
        from posttrain.rewards.registry import _load_module  # the registry imports math-verify (slow)

        path_text, _, cls_name = spec.rpartition(":")
        try:
            module, path = _load_module(path_text)
        except UserError as e:
            raise UserError(f"env {spec}: {e}") from None
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise UserError(f"env {spec}: {path} defines no '{cls_name}'")
    elif spec in ENVS:
        cls = ENVS[spec]
    else:
        raise UserError(f"unknown env '{spec}' (built-in: {', '.join(sorted(ENVS))}; or path/to/file.py:Class)")
    check_env_class(cls, spec)
    try:
        cls(**options)
    except TypeError as e:
        raise UserError(f"env {spec}: bad env_args {sorted(options)}: {e}") from None
    return lambda: cls(**options)
