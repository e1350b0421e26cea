"""Tools an environment lends the model, and how a call is contained.

A `Tool` is a name, a description, a JSON-schema of its arguments (what the chat template's
`tools=` shows the model) and a function returning text. `execute` runs one parsed call with
least privilege and containment:

- unknown tool, bad arguments, malformed call -> an error observation (the model reads it; the
  episode goes on), never an exception in the trainer;
- the function raising -> "error: ExcType: message";
- the function running past its timeout -> "error: timed out after N s" (it runs in a daemon thread;
  the Python tool's own sandbox kills its process at its wall limit, so nothing keeps running there);
- long output -> truncated to `max_chars` with a marker.

Every call is logged (`ToolResult.log()`: name, arguments, status, seconds, output size) into the
episode's record: the side effects a run had are in its episodes file.

Built-ins (`make_tool(name, **options)`):
    calculator  safe arithmetic by AST evaluation (calculator.py), in-process, pure
    python      a program run in the code verifier's sandbox (rewards/sandbox.py: fresh interpreter,
                no network, throw-away uid as root, rlimits, temp dir, wall timeout); stdout back
    search      BM25 over a local document set (search.py), read-only
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from posttrain.agentic.calculator import evaluate, format_value
from posttrain.agentic.search import MockSearch
from posttrain.errors import UserError
from posttrain.rewards.sandbox import Limits, Sandbox


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments: {"type": "object", "properties": {...}, "required": [...]}
    fn: Callable[..., str]
    timeout_s: float = 10.0

    def schema(self) -> dict:
        """The OpenAI / transformers `tools=` entry."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @property
    def main_argument(self) -> str:
        """The argument a plain-text call (`<tool>calculator: 2*3</tool>`) fills."""
        required = self.parameters.get("required") or list(self.parameters.get("properties", {}))
        return required[0]


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    raw: str = ""
    error: str | None = None  # the call could not be parsed


@dataclass
class ToolResult:
    name: str
    arguments: dict
    text: str
    status: str  # ok | error | timeout | unknown_tool | bad_call
    seconds: float = 0.0
    truncated: bool = False

    def log(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "status": self.status,
                "seconds": round(self.seconds, 6), "output": self.text[:200], "output_chars": len(self.text),
                "truncated": self.truncated}


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars] + f"\n...[truncated {len(text) - max_chars} characters]", True


def execute(call: ToolCall, tools: dict[str, Tool], max_chars: int = 2000) -> ToolResult:
    """Run one call, contained (see the module docstring); never raises."""
    if call.error is not None:
        return ToolResult(call.name, call.arguments, f"error: {call.error}", "bad_call")
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(call.name, call.arguments, f"error: unknown tool {call.name!r} (tools: {', '.join(tools)})",
                          "unknown_tool")
    allowed = set(tool.parameters.get("properties", {}))
    missing = [k for k in tool.parameters.get("required", []) if k not in call.arguments]
    extra = sorted(set(call.arguments) - allowed) if allowed else []
    if missing or extra:
        what = f"missing argument {missing[0]!r}" if missing else f"unknown argument {extra[0]!r}"
        return ToolResult(call.name, call.arguments, f"error: {tool.name}: {what}", "bad_call")
    box: dict = {}

    def target():
        try:
            box["text"] = str(tool.fn(**call.arguments))
        except BaseException as e:  # a tool's failure is an observation
            box["error"] = f"{type(e).__name__}: {e}"

    t0 = time.perf_counter()
    worker = threading.Thread(target=target, daemon=True, name=f"tool-{tool.name}")
    worker.start()
    worker.join(tool.timeout_s)
    seconds = time.perf_counter() - t0
    if worker.is_alive():
        return ToolResult(tool.name, call.arguments, f"error: {tool.name} timed out after {tool.timeout_s:g} s",
                          "timeout", seconds)
    if "error" in box:
        text, status = f"error: {box['error']}", "error"
    else:
        text, status = box["text"], "ok"
    text, cut = truncate(text, max_chars)
    return ToolResult(tool.name, call.arguments, text, status, seconds, cut)


# ---------------------------------------------------------------- built-in tools


def calculator_tool(timeout_s: float = 2.0) -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses, sqrt).",
                {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 347 * 86"}},
                 "required": ["expression"]},
                lambda expression: format_value(evaluate(str(expression))), timeout_s)


class PythonSandboxError(RuntimeError):
    """The program failed, timed out or the sandbox could not start: the message is the observation."""


def python_tool(wall_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 512, output_bytes: int = 4096,
                nproc: int = 16, **sandbox_opts) -> Tool:
    """Run a program in the code verifier's sandbox and return its stdout (stderr's tail on failure)."""
    sandbox = Sandbox(Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, output_bytes=output_bytes, nproc=nproc),
                      **sandbox_opts)

    def run(code: str) -> str:
        r = sandbox.run_program(str(code), "")
        if r.status == "timeout":
            raise PythonSandboxError(f"program timed out after {wall_s:g} s")
        if r.status == "error":
            raise PythonSandboxError(r.stderr.strip() or "sandbox failed")
        if r.exit_status != 0:
            tail = "\n".join(r.stderr.strip().splitlines()[-3:])
            raise PythonSandboxError(f"program failed (exit {r.exit_status}){': ' + tail if tail else ''}\n{r.stdout}".rstrip())
        return r.stdout

    # the thread's deadline is a backstop above the sandbox's own wall limit (which kills the process)
    return Tool("python", "Run a Python program (standard library only, no network) and return what it prints.",
                {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                 "required": ["code"]}, run, wall_s + 10.0)


def search_tool(documents, top_k: int = 3, snippet_chars: int = 200, timeout_s: float = 5.0) -> Tool:
    engine = MockSearch(documents, top_k, snippet_chars)
    return Tool("search", "Search the document collection; returns the best matching titles with snippets.",
                {"type": "object", "properties": {"query": {"type": "string", "description": "search words"}},
                 "required": ["query"]}, engine, timeout_s)


TOOLS: dict[str, Callable[..., Tool]] = {"calculator": calculator_tool, "python": python_tool, "search": search_tool}


def make_tool(name: str, **options) -> Tool:
    if name not in TOOLS:
        raise UserError(f"unknown tool '{name}' (built-in: {', '.join(TOOLS)})")
    try:
        return TOOLS[name](**options)
    except TypeError as e:
        raise UserError(f"tool '{name}': {e}") from None
