"""The OpenAI API as `posttrain serve` speaks it: request bodies, errors, and the shapes of logprobs, tool calls
and streamed text (no HTTP here; rollout/serve.py routes requests through these).

Request keys. Every key OpenAI defines for /v1/completions and /v1/chat/completions is accepted at its
default (a no-op: `frequency_penalty=0`, `presence_penalty=0`, `logit_bias={}`, `best_of=n`, `user`,
`metadata`, `store=false`, `response_format={"type": "text"}`, ...); a value this server does not implement is
refused with 400 naming the parameter (`code: unsupported_value`), never ignored. A key OpenAI does not define
is refused as OpenAI does ("Unrecognized request argument supplied: ..."), except these vLLM extensions:
`top_k`, `min_p` (0 only), `repetition_penalty` (1 only), `min_tokens` (0 only), `ignore_eos`,
`stop_token_ids` (stop at these too, besides the model's end-of-sequence ids), `include_stop_str_in_output`,
`skip_special_tokens`, and for chat `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`.
`stop` takes any number of non-empty strings (OpenAI: at most 4; lm-eval sends its stop sequences plus EOS).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.rollout.types import MAX_TOP_LOGPROBS, TokenLogprob

# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc) -> str | None:
    """pydantic's error location -> OpenAI's param path ('messages.[0].role'), without the body and union member names."""
    parts = []
    for x in list(loc)[1:]:  # [0] is "body"
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif not any(c in x for c in "[(") and x not in _TYPE_NAMES:
            parts.append(x)
    return ".".join(parts) or None


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors of a request body -> one 400 naming the first parameter (all messages joined)."""
    first = errors[0] if errors else {}
    param = _param(first.get("loc", ()))
    if first.get("type") == "json_invalid" or (param is None and first.get("type") in ("model_attributes_type", "dict_type")):
        return APIError(400, "We could not parse the JSON body of your request: it must be a JSON object. (HINT: The "
                        "OpenAI API expects a JSON payload.)")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param)
    msgs = list(dict.fromkeys(f"{_param(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}" for e in errors))
    return APIError(400, "; ".join(msgs), param)


def unsupported(param: str, value, accepted: str) -> APIError:
    return APIError(400, f"Unsupported value: {param}={value!r} is not implemented by posttrain serve; only {accepted} is accepted.",
                    param, "unsupported_value")


def context_error(limit: int, prompt: int, completion: int | None, param: str) -> APIError:
    if completion is None:
        msg = (f"This model's maximum context length is {limit} tokens. However, your prompt has {prompt} tokens, which "
               f"leaves no room for the completion. Please reduce the length of the prompt.")
    else:
        msg = (f"This model's maximum context length is {limit} tokens. However, you requested {prompt + completion} tokens "
               f"({prompt} in the prompt, {completion} for the completion). Please reduce the length of the prompt or completion.")
    return APIError(400, msg, param, "context_length_exceeded")


def check_unicode(value, param: str = "") -> None:
    """400 naming the first string inside `value` (a body's dump) that holds a lone surrogate (not valid Unicode)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = f"\\u{ord(value[e.start]):04x}"
            raise APIError(400, f"{param or 'body'}: contains a lone surrogate escape ({bad} at character {e.start}), "
                           "which is not valid Unicode text; send UTF-8 text (a surrogate pair is fine)", param or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(v, f"{param}.{k}" if param else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_unicode(v, f"{param}.[{i}]" if param else f"[{i}]")


# ---------------------------------------------------------------- request bodies


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # nothing to obfuscate here: accepted, no effect


class _Body(_Strict):
    """Keys both completion endpoints take (see the module docstring)."""

    model: str = ""
    n: int = Field(1, ge=1, le=256)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM extension: -1 or 0 = off")
    max_tokens: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def check_noops(self) -> None:
        """Refuse (400) what is not a no-op among the keys accepted only at their defaults, and text that is not
        Unicode (a lone surrogate escape such as "\\ud800": JSON allows it, no tokenizer can encode it)."""
        check_unicode(self.model_dump(exclude_none=True))
        for name, default in (("frequency_penalty", 0), ("presence_penalty", 0), ("min_p", 0), ("repetition_penalty", 1),
                              ("min_tokens", 0)):
            v = getattr(self, name)
            if v is not None and v != default:
                raise unsupported(name, v, f"{default} (the default)")
        if self.logit_bias and any(b != 0 for b in self.logit_bias.values()):
            raise unsupported("logit_bias", self.logit_bias, "an empty map (or biases of 0)")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
        if self.stop_token_ids is not None and not all(t >= 0 for t in self.stop_token_ids):
            raise APIError(400, "stop_token_ids: token ids are integers >= 0", "stop_token_ids")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def check_noops(self) -> None:
        super().check_noops()
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", self.best_of, f"best_of = n ({self.n})")
        if self.suffix:
            raise unsupported("suffix", self.suffix, "no suffix")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and isinstance(p[0], int):
            items = [list(p)]
        else:
            items = list(p)
        if not items or not all(items):
            raise APIError(400, "prompt: give a non-empty string, a list of them, a list of token ids or a list of such lists",
                           "prompt")
        return items


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # other keys (e.g. reasoning_content) go to the chat template as given
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, v):
        for c in v or []:
            fn = c.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError("a tool call is {'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
        return v

    def text(self, i: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            kind = part.get("type", "text")
            if kind == "text":
                parts.append(str(part.get("text", "")))
            elif kind != "refusal":
                raise APIError(400, f"messages[{i}].content: parts of type '{kind}' are not supported (this server is "
                               "text only)", f"messages.[{i}].content")
        return "".join(parts)

    def for_template(self, i: int) -> dict:
        """The message as chat templates read it: text content, tool-call arguments as objects (HF's convention)."""
        m = {k: v for k, v in (self.model_extra or {}).items()}
        m.update(role="system" if self.role == "developer" else self.role, content=self.text(i))
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                m[key] = getattr(self, key)
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        return m


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    prediction: dict | None = None
    audio: dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    web_search_options: dict | None = None
    verbosity: str | None = None
    # vLLM extensions
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_noops(self) -> None:
        super().check_noops()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: logprobs must be set to true if this parameter is used", "top_logprobs")
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            raise unsupported("response_format", rf, "{'type': 'text'} (no constrained decoding)")
        if self.store:
            raise unsupported("store", self.store, "false (nothing is stored)")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported("service_tier", self.service_tier, "'auto' or 'default'")
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", self.modalities, "['text']")
        for name in ("reasoning_effort", "prediction", "audio", "functions", "function_call", "web_search_options", "verbosity"):
            if getattr(self, name) is not None:
                raise unsupported(name, getattr(self, name), "null")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message: set add_generation_prompt to false with it", "continue_final_message")
        if self.tools is not None:
            for i, t in enumerate(self.tools):
                if t.get("type") != "function" or not isinstance(t.get("function"), dict) or not t["function"].get("name"):
                    raise APIError(400, f"tools[{i}]: a tool is {{'type': 'function', 'function': {{'name': ..., "
                                   "'parameters': ...}}}", f"tools.[{i}]")
        tc = self.tool_choice
        if tc is not None and tc not in ("none", "auto"):
            what = "'required'" if tc == "required" else (repr(tc) if isinstance(tc, str) else "a named function")
            raise APIError(400, f"tool_choice={what} is not supported: forcing a tool call needs constrained decoding, which "
                           "posttrain serve does not do; use 'auto' (tool calls are parsed when the model writes them) or 'none'",
                           "tool_choice", "unsupported_value")
        if tc is not None and not self.tools:
            raise APIError(400, "tool_choice: only allowed when tools are given", "tool_choice")

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------- text and logprobs


def cut_at_stop(text: str, stops: list[str], keep_stop: bool = False) -> tuple[str, bool]:
    """(text up to the earliest stop string (through it with keep_stop), whether one occurred)."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, False
    i, s = min(hits)
    return text[:i + len(s)] if keep_stop else text[:i], True


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters a stream must not send yet: an incomplete UTF-8 character (decoded as U+FFFD)
    or the start of a stop string (the text may turn out to end before it)."""
    n = len(text) - len(text.rstrip("\ufffd"))
    body = text[:len(text) - n]
    for s in stops:
        for k in range(min(len(s) - 1, len(body)), 0, -1):
            if body.endswith(s[:k]):
                n = max(n, len(text) - len(body) + k)
                break
    return n


class TokenText:
    """Token strings as OpenAI's logprobs show them (each token decoded alone, as vLLM does)."""

    def __init__(self, tokenizer):
        self.tok, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.cache[token_id] = self.tok.decode([token_id])
        return s


def completion_logprobs(token_ids: list[int], lps: list[TokenLogprob | None], text: TokenText, offset: int = 0) -> tuple[dict, int]:
    """The /v1/completions `logprobs` object for these tokens ({tokens, token_logprobs, top_logprobs, text_offset});
    top_logprobs per position: the requested top-k (best first) and the token itself when not among them; None
    where nothing precedes the token (echo's first prompt token). Returns (object, offset after the last token)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, lp in zip(token_ids, lps):
        s = text(t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(lp.logprob))
        top: dict[str, float] = {}
        for i, v in [*lp.top, (t, lp.logprob)]:
            top.setdefault(text(i), _finite(v))  # best first: a string two ids decode to keeps the higher value
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(token_ids: list[int], lps: list[TokenLogprob], text: TokenText) -> list[dict]:
    """The chat `logprobs.content` entries: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
    def entry(t, v):
        s = text(t)
        return {"token": s, "logprob": _finite(v), "bytes": list(s.encode("utf-8"))}

    return [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for t, lp in zip(token_ids, lps)]


def _finite(v: float) -> float:
    return max(float(v), -9999.0)  # -inf is not JSON; OpenAI and vLLM report -9999.0


# ---------------------------------------------------------------- tool calls


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_call_format(template: str | None) -> str | None:
    """The tool-call syntax a chat template teaches, when this server can parse it: 'hermes' for
    <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen 2.5/3, Hermes, SmolLM3 and others); else None."""
    return "hermes" if template and "<tool_call>" in template else None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, OpenAI tool_calls) from Hermes-style output; a block that is not a JSON
    object with a name leaves the whole text as content (no half-parsed calls)."""
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    rest = TOOL_CALL.sub("", text).strip()
    return (rest or None), calls


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
