"""Evaluation items: rows of a task or JSONL file, checked, and rendered into prompt token ids.

A row has `prompt` (a string: one user turn; or a `[{role, content}]` conversation) plus the
columns its reward reads (`answer` for math, `tests`/`stdio` for code). An optional `id` names the
item (else its row number). The chat template, an optional system prompt and few-shot exchanges
are applied here; all three are recorded in the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.data import formats
from posttrain.data.templates import check_template, has_template
from posttrain.errors import UserError

EVAL_FORMATS = ("prompt_only", "prompt_completion")


@dataclass
class Item:
    """One evaluation problem."""

    index: int
    id: str
    row: formats.Row
    messages: list[dict] | None  # the conversation sent (None when the chat template is off)
    prompt_text: str  # the prompt as the model sees it (rendered)
    prompt_ids: list[int]

    @property
    def data(self) -> dict:
        return self.row.data


def load_rows(data: str, max_items: int = 0) -> list[formats.Row]:
    rows, _ = formats.load(data, allowed=EVAL_FORMATS)
    return rows[:max_items] if max_items else rows


def check_columns(rows: list[formats.Row], columns: dict[str, tuple]) -> None:
    """Every row has the columns the rewards need (`columns`: reward -> required columns, a tuple
    entry = any one of its alternatives); the first missing one is named with its file and row."""
    from posttrain.rewards.registry import reserved_column  # math-verify (slow) only when rewards are used

    for row in rows:
        if (hit := reserved_column(row.data)) is not None:
            raise row.error(hit[0], f"this column name is taken by {hit[1]}")
        for reward, cols in columns.items():
            for col in cols:
                alts = col if isinstance(col, tuple) else (col,)
                if not any(row.data.get(a) is not None for a in alts):
                    raise row.error(" or ".join(alts), f"missing (reward '{reward}' needs it)")


def few_shot_messages(path: str) -> list[dict]:
    """User/assistant exchanges from a file: rows with `messages`, or `prompt` + `completion` or
    `answer` (strings)."""
    if not path:
        return []
    rows = formats.read_rows(path)
    out: list[dict] = []
    for row in rows:
        d = row.data
        if isinstance(d.get("messages"), list):
            formats.check_conversation(row, "messages", d["messages"], need_assistant=True)
            out += [{"role": m["role"], "content": m["content"]} for m in d["messages"] if m["role"] != "system"]
            continue
        reply = d.get("completion", d.get("answer"))
        if not isinstance(d.get("prompt"), str) or not isinstance(reply, str):
            raise row.error("prompt", "a few-shot row needs `messages`, or string `prompt` and `completion` (or `answer`)")
        out += [{"role": "user", "content": d["prompt"]}, {"role": "assistant", "content": reply}]
    if not out:
        raise UserError(f"few_shot file {path} has no examples")
    return out


def conversation(row: formats.Row, system_prompt: str, shots: list[dict]) -> list[dict]:
    prompt = row.data["prompt"]
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt:
        if msgs and msgs[0]["role"] == "system":
            raise row.error("prompt[0]", "the row has its own system message; leave system_prompt empty for this data")
        head = [{"role": "system", "content": system_prompt}]
    else:
        head, msgs = ([msgs[0]], msgs[1:]) if msgs and msgs[0]["role"] == "system" else ([], msgs)
    return head + shots + msgs


def build_items(tok, rows: list[formats.Row], system_prompt: str = "", shots: list[dict] | None = None,
                chat_template: bool = True) -> list[Item]:
    """Render every row's prompt; refuse rows that cannot be rendered, naming them. `chat_template` False, or a
    tokenizer without a template (a base model): string prompts as plain text, conversations refused."""
    shots = shots or []
    items = []
    if chat_template and not has_template(tok):
        check_template(tok, rows)
        chat_template = False
    for i, row in enumerate(rows):
        ident = str(row.data.get("id", row.number))
        if chat_template:
            msgs = conversation(row, system_prompt, shots)
            try:
                text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # a template error names the row
                raise row.error("prompt", f"the chat template cannot render it: {e}") from None
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            if not isinstance(row.data["prompt"], str):
                raise row.error("prompt", "chat_template=none needs plain string prompts")
            if system_prompt or shots:
                raise UserError("system_prompt and few_shot need a chat template (the tokenizer's, or chat_template=chatml|plain|file)")
            msgs, text = None, row.data["prompt"]
            ids = tok(text)["input_ids"]
        if not ids:
            raise row.error("prompt", "renders to no tokens")
        items.append(Item(i, ident, row, msgs, text, ids))
    ids = [it.id for it in items]
    if len(set(ids)) != len(ids):
        dup = next(x for x in ids if ids.count(x) > 1)
        raise UserError(f"{rows[0].source}: item id '{dup}' appears twice (ids pair items in `eval compare`)")
    return items
