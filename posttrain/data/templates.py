"""Chat-template rendering with an exact loss mask, found by rendering (not by `{% generation %}` tags).

For assistant turn i of a conversation we render
    before = template(messages[:i], add_generation_prompt=True)   # ends with the assistant header
    upto   = template(messages[:i+1])                              # ends after turn i
and the trained span is upto[len(before):], with trailing whitespace after the end-of-turn token
left out (ChatML's "\n" after <|im_end|>): the assistant's content *and* its end-of-turn token,
never the next turn's header. The text is then cut at span boundaries and each piece tokenized on
its own, so trained tokens are exactly the ones the policy would generate after that header.
Templates whose rendering of a prefix is not a prefix of the full rendering (e.g. ones that drop
earlier reasoning) are refused with a clear error rather than silently mis-masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be masked exactly for this conversation."""


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the policy generated the token (trained), 0 elsewhere
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) token spans with mask 1

    def __len__(self) -> int:
        return len(self.input_ids)


def _render(tok, messages, add_generation_prompt=False, **kw) -> str:
    if not messages and not add_generation_prompt:
        return ""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] if text else []


def from_segments(tok, segments: list[tuple[str, bool]]) -> Tokenized:
    """Tokenize (text, trained) pieces one by one and concatenate."""
    ids: list[int] = []
    mask: list[int] = []
    spans = []
    for text, trained in segments:
        piece = _encode(tok, text)
        if trained and piece:
            spans.append((len(ids), len(ids) + len(piece)))
        ids.extend(piece)
        mask.extend([int(trained)] * len(piece))
    return Tokenized(ids, mask, spans)


def conversation_segments(tok, messages: list[dict], train_turns: set[int] | None = None, **kw) -> list[tuple[str, bool]]:
    """Split the rendered conversation into (text, trained) pieces. Default: every assistant turn."""
    if train_turns is None:
        train_turns = {i for i, m in enumerate(messages) if m["role"] == "assistant"}
    full = _render(tok, messages, **kw)
    segments: list[tuple[str, bool]] = []
    cursor = 0
    for i in sorted(train_turns):
        if messages[i]["role"] != "assistant":
            raise TemplateError(f"message {i} is a {messages[i]['role']} turn; only assistant turns can be trained")
        upto = _render(tok, messages[: i + 1], **kw)
        before = _render(tok, messages[:i], add_generation_prompt=True, **kw) if i else _opening(tok, upto, **kw)
        if not upto.startswith(before) or not full.startswith(upto):
            raise TemplateError(
                f"the chat template does not render turn {i} as a prefix of the conversation "
                "(it rewrites earlier turns); exact assistant masking is impossible with this template"
            )
        end = len(upto.rstrip())
        content = messages[i]["content"].strip()
        if content and content not in upto[len(before):end]:
            raise TemplateError(f"the chat template does not reproduce assistant turn {i}'s content verbatim")
        segments.append((full[cursor:len(before)], False))
        segments.append((full[len(before):end], True))
        cursor = end
    segments.append((full[cursor:], False))
    return [(t, m) for t, m in segments if t]


def _opening(tok, upto: str, **kw) -> str:
    """`before` for an assistant turn that opens the conversation (a greeting): templates refuse to render no
    messages, so the assistant header is found as what the generation prompt adds after a user turn,
        header = template([user], add_generation_prompt=True)[len(template([user])):]
    and `before` is the rendered turn up to and including its first header (a default system prompt the template
    puts first stays before it, untrained)."""
    probe = [{"role": "user", "content": "x"}]
    plain = _render(tok, probe, **kw)
    header = _render(tok, probe, add_generation_prompt=True, **kw)[len(plain):]
    at = upto.find(header) if header.strip() else -1
    if at < 0:
        raise TemplateError("the conversation starts with an assistant turn and the chat template has no assistant "
                            "header to find in it: start it with a user (or system) turn")
    return upto[: at + len(header)]


def render_messages(tok, messages: list[dict], train_turns: set[int] | None = None, **kw) -> Tokenized:
    return from_segments(tok, conversation_segments(tok, messages, train_turns, **kw))


def render_prompt(tok, prompt, add_generation_prompt: bool = True, **kw) -> list[int]:
    """Token ids a policy continues from: the chat template with the generation prompt, or plain text.
    `kw` go to the template (`tools=[...]`, `continue_final_message=True`, template variables)."""
    if isinstance(prompt, str):
        return tok(prompt)["input_ids"]
    return _encode(tok, _render(tok, prompt, add_generation_prompt=add_generation_prompt, **kw))


def render_prompt_completion(tok, prompt, completion) -> Tokenized:
    """Loss only on the completion (and the end-of-turn / EOS that closes it)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        ids = tok(prompt)["input_ids"]
        done = _encode(tok, completion) + [tok.eos_token_id]
        return Tokenized(ids + done, [0] * len(ids) + [1] * len(done), [(len(ids), len(ids) + len(done))])
    if isinstance(prompt, str) or isinstance(completion, str):
        raise TemplateError("prompt and completion must both be strings or both be conversations")
    messages = list(prompt) + list(completion)
    train = {len(prompt) + i for i, m in enumerate(completion) if m["role"] == "assistant"}
    return render_messages(tok, messages, train)


def render_text(tok, text: str) -> Tokenized:
    """Plain language modelling: every token (and a closing EOS) is trained."""
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    return Tokenized(ids, [1] * len(ids), [(0, len(ids))])


def render_row(tok, data: dict, fmt: str) -> Tokenized:
    """Render one validated SFT row of a language-modelling or prompt-completion format."""
    if fmt == "conversation":
        return render_messages(tok, data["messages"])
    if fmt == "text":
        return render_text(tok, data["text"])
    if fmt == "prompt_completion":
        return render_prompt_completion(tok, data["prompt"], data["completion"])
    raise TemplateError(f"format '{fmt}' has no SFT rendering")


# ---------------------------------------------------------------- templates for tokenizers without one

# Built-in chat templates (`chat_template=<name>`). chatml: the <|im_start|>role ... <|im_end|> layout many
# instruct models use (the markers are plain text to a tokenizer that lacks them as special tokens).
# plain: "User: ...\nAssistant: ..." lines, what a base model continues most naturally.
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "plain": (
        "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}{{ eos_token if m['role'] == 'assistant' else '' }}\n"
        "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
    ),
}


def set_chat_template(tok, option: str = "", args: dict | None = None) -> None:
    """Apply `chat_template=` to a tokenizer: '' keeps its own; a built-in name or a .jinja file replaces it.
    `args` (chat_template_args) are fixed for every render: `{% set name = value %}` lines put before the
    template, so every path that renders (SFT masks, RL prompts, eval, serve) sees the same values."""
    import json
    from pathlib import Path

    from posttrain.errors import UserError

    if option in BUILTIN_TEMPLATES:
        tok.chat_template = BUILTIN_TEMPLATES[option]
    elif option:
        path = Path(option)
        if not path.is_file():
            raise UserError(f"chat_template={option!r}: neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                            "nor a template file")
        tok.chat_template = path.read_text(encoding="utf-8")
    if args:
        if not has_template(tok):
            raise UserError("chat_template_args: the tokenizer has no chat template to pass them to")
        bad = [k for k in args if not str(k).isidentifier()]
        if bad:
            raise UserError(f"chat_template_args: {bad} are not template variable names")
        header = "".join(f"{{%- set {k} = {json.dumps(v)} -%}}" for k, v in args.items())  # JSON literals are Jinja literals
        tok.chat_template = header + tok.chat_template


def has_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


CONVERSATIONAL_FIELDS = ("messages", "prompt", "completion", "chosen", "rejected")


def check_template(tok, rows) -> None:
    """Refuse conversational rows (a `messages` list, or a prompt/completion given as turns) when the tokenizer
    has no chat template, naming the fix; string prompts on such a tokenizer are plain text and pass."""
    from posttrain.errors import UserError

    if has_template(tok):
        return
    for row in rows:
        data = row.data if hasattr(row, "data") else row
        field = next((f for f in CONVERSATIONAL_FIELDS if isinstance(data.get(f), list)), None)
        if field is not None:
            where = f"{row.source} row {row.number}" if hasattr(row, "source") else "the data"
            raise UserError(f"{where}: field '{field}' is a conversation, but the tokenizer has no chat template "
                            f"(a base model?): give chat_template=chatml, chat_template=plain or chat_template=path/to/template.jinja, "
                            "or use string prompts (rendered as plain text)")
