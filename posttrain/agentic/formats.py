"""Tool-call formats: how tools are shown to the model, how a call is parsed out of a turn, and the
token ids that carry a tool's output back (loss mask 0).

    template  the chat template's own tool calling (transformers `apply_chat_template(tools=...)`):
              Hermes / Qwen2.5 style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the
              output comes back as a `tool` message (`<tool_response>...</tool_response>` in Qwen2.5).
    tag       a plain-tag fallback for templates without tools (SmolLM2): the tools are described in
              the system message; a call is `<tool>NAME: INPUT</tool>` (INPUT fills the tool's main
              argument) or `<tool>{"name": ..., "arguments": {...}}</tool>`; tags configurable.
    auto      template when rendering with `tools=` shows `<tool_call>`, else tag.

The text between turns ("glue": the end of the assistant turn, the tool message's header, the
output, its footer and the next assistant header) is found by rendering a conversation with
sentinels through the chat template, once; each observation is then tokenized piece by piece
(header, output, footer) and appended. Generated tokens are never decoded and re-encoded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from posttrain.agentic.tools import Tool, ToolCall
from posttrain.errors import UserError

_A, _B = "PTSENTINELASSISTANT", "PTSENTINELOBSERVATION"


@dataclass(frozen=True)
class Glue:
    """Template text around an observation: `before` closes the assistant turn and opens the tool
    message (Qwen2.5: '<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n'), `after` closes it and opens
    the next assistant turn ('\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n')."""

    before: str
    after: str


def template_glue(tok, role: str) -> Glue:
    """Glue of the tokenizer's chat template for an observation in a `role` message."""
    base = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _A}]
    try:
        text = tok.apply_chat_template(base + [{"role": role, "content": _B}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template may refuse the role
        raise UserError(f"the chat template cannot render a '{role}' message after an assistant turn ({e})") from None
    i = text.find(_A)
    j = text.find(_B, i)
    if i < 0 or j < 0:
        raise UserError(f"the chat template does not reproduce a '{role}' message verbatim; no exact glue")
    return Glue(text[i + len(_A):j], text[j + len(_B):])


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] if text else []


class ToolFormat:
    """Base: subclasses set `name`, `stop_strings`, `role` and implement parse / render_call."""

    name = ""
    role = "tool"

    def __init__(self, tok, tools: list[Tool]):
        self.tok, self.tools = tok, list(tools)
        self.by_name = {t.name: t for t in self.tools}
        self.glue = template_glue(tok, self.role)
        eos = tok.eos_token or ""
        self.eos_text = eos if eos and self.glue.before.startswith(eos) else ""

    stop_strings: list[str] = []

    def prompt_messages(self, messages: list[dict]) -> list[dict]:
        return list(messages)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(self.prompt_messages(messages), tokenize=False, add_generation_prompt=True)
        return encode(self.tok, text)

    def observation_ids(self, text: str, after_eos: bool, max_tokens: int | None = None) -> list[int]:
        """Ids appended after a turn: glue, the observation (its first `max_tokens` ids), glue; each piece
        tokenized on its own. `after_eos`: the turn ended with the end-of-turn token, which the glue
        then does not repeat."""
        before = self.glue.before[len(self.eos_text):] if after_eos and self.eos_text else self.glue.before
        body = encode(self.tok, text)
        return encode(self.tok, before) + body[:max_tokens] + encode(self.tok, self.glue.after)

    def observation_message(self, text: str) -> dict:
        return {"role": self.role, "content": text}

    def parse(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def render_call(self, name: str, arguments: dict) -> str:
        raise NotImplementedError

    def _json_call(self, body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall("", {}, body, f"the tool call is not valid JSON ({e.msg}); "
                                           'write {"name": TOOL, "arguments": {...}}')
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", {}, body, 'a tool call needs "name" (a string) and "arguments" (an object)')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            return ToolCall(obj["name"], {}, body, '"arguments" must be a JSON object')
        return ToolCall(obj["name"], args, body)


class TemplateFormat(ToolFormat):
    """The chat template's tool calling (Hermes / Qwen2.5: `<tool_call>` JSON `</tool_call>`)."""

    name = "template"
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self, tok, tools: list[Tool]):
        super().__init__(tok, tools)
        self.stop_strings = [self.close_tag]
        self._re = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.S)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, tools=[t.schema() for t in self.tools], tokenize=False,
                                            add_generation_prompt=True)
        return encode(self.tok, text)

    def parse(self, text: str) -> list[ToolCall]:
        return [self._json_call(body.strip()) for body in self._re.findall(text)]

    def render_call(self, name: str, arguments: dict) -> str:
        return f"{self.open_tag}\n{json.dumps({'name': name, 'arguments': arguments})}\n{self.close_tag}"


class TagFormat(ToolFormat):
    """`<tool>NAME: INPUT</tool>` with the tools described in the system message."""

    name = "tag"

    def __init__(self, tok, tools: list[Tool], tags: tuple[str, str] = ("<tool>", "</tool>")):
        self.open_tag, self.close_tag = tags
        if not self.open_tag or not self.close_tag:
            raise UserError("tool_tags: both tags must be non-empty, e.g. ['<tool>', '</tool>']")
        try:
            super().__init__(tok, tools)
        except UserError:  # a template that knows no `tool` role: outputs come back as user messages
            self.role = "user"
            super().__init__(tok, tools)
        self.stop_strings = [self.close_tag]
        self._re = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.S)

    def instructions(self) -> str:
        lines = [f"You can use tools. To call one, write {self.open_tag}NAME: INPUT{self.close_tag} and stop; "
                 "the result comes back in the next message. Tools:"]
        for t in self.tools:
            lines.append(f"- {t.name}: {t.description} Example: {self.render_call(t.name, {t.main_argument: '...'})}")
        return "\n".join(lines)

    def prompt_messages(self, messages: list[dict]) -> list[dict]:
        messages = list(messages)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + self.instructions()}] + messages[1:]
        return [{"role": "system", "content": self.instructions()}] + messages

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in self._re.findall(text):
            body = body.strip()
            if body.startswith("{"):
                calls.append(self._json_call(body))
                continue
            name, sep, arg = body.partition(":")
            name = name.strip()
            if not sep or not name:
                calls.append(ToolCall(name, {}, body, f"write {self.open_tag}NAME: INPUT{self.close_tag}"))
                continue
            tool = self.by_name.get(name)
            key = tool.main_argument if tool is not None else "input"
            calls.append(ToolCall(name, {key: arg.strip()}, body))
        return calls

    def render_call(self, name: str, arguments: dict) -> str:
        tool = self.by_name.get(name)
        if tool is not None and list(arguments) == [tool.main_argument]:
            return f"{self.open_tag}{name}: {arguments[tool.main_argument]}{self.close_tag}"
        return f"{self.open_tag}{json.dumps({'name': name, 'arguments': arguments})}{self.close_tag}"


def supports_template_tools(tok) -> bool:
    """Whether the chat template renders `tools=` in the Hermes `<tool_call>` convention."""
    probe = {"type": "function", "function": {"name": "probe_tool_xyz", "description": "d",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[probe], tokenize=False,
                                       add_generation_prompt=True)
    except Exception:  # templates without tool support may raise
        return False
    return "probe_tool_xyz" in text and TemplateFormat.open_tag in text


def make_format(tok, tools: list[Tool], name: str = "auto", tags: tuple[str, str] = ("<tool>", "</tool>")) -> ToolFormat:
    if name not in ("auto", "template", "tag"):
        raise UserError(f"tool_format must be auto, template or tag (got {name!r})")
    if name == "template" or (name == "auto" and supports_template_tools(tok)):
        if name == "template" and not supports_template_tools(tok):
            raise UserError("tool_format=template: this tokenizer's chat template has no <tool_call> tool calling; "
                            "use tool_format=tag (or auto)")
        return TemplateFormat(tok, tools)
    return TagFormat(tok, tools, tuple(tags))
