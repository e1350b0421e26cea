"""Preference data (TRL's formats) for `posttrain rm` and `posttrain dpo`: validation, then tokenization.

    preference           {"prompt", "chosen", "rejected"}          explicit prompt
    implicit preference  {"chosen", "rejected"}                     the prompt is their common beginning
    unpaired             {"prompt", "completion", "label": bool}    KTO; paired data is unpaired for KTO
                                                                    (chosen -> label true, rejected -> false, as TRL)
    optional column      "margin": number                           preference strength (RM: Llama 2's margin)

Fields are plain strings or conversations `[{"role", "content"}, ...]`. After a conversational prompt,
`chosen`/`rejected` are the assistant's reply (`[{"role": "assistant", ...}]`, or a plain string: one
assistant turn), or the whole conversation when it starts with the prompt's messages (then the prompt
is cut off); after a string prompt they are strings. The
implicit prompt is the longest common prefix of messages (conversations) or of characters (strings; a
space before the first difference stays with the completions), as TRL's `extract_prompt`.

Every row is checked before any model loads; each refusal names file, row and field (DataError):
chosen identical to rejected, missing (or empty) prompt, empty completion, a conversational prompt the
chosen/rejected conversation does not start with, and wrong types (a number where text belongs, a
string prompt with conversational completions, a non-numeric margin, a non-boolean label).

Tokenized, a pair is one prompt and two continuations (`TokenizedPair`): the prompt tokens are shared
by construction (the chat template renders the prompt once with its generation header), each
continuation keeps its own loss mask (the assistant tokens, and the end-of-turn token that closes
them) and ends at its last trained token. Reward models (`scored=True`) instead keep each sequence whole, as
`AutoModelForSequenceClassification` reads the chat template's rendering (`scored_ids`): the score is taken at
its last non-pad token, after the template's closing text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.data import formats
from posttrain.data.formats import Row
from posttrain.data.templates import TemplateError, Tokenized, check_template, render_prompt, render_prompt_completion
from posttrain.errors import UserError

PAIRED = ("preference", "implicit_preference")
UNPAIRED = ("unpaired_preference",)
Text = Any  # str | list[dict]: a plain string or a conversation


@dataclass
class Pair:
    prompt: Text
    chosen: Text
    rejected: Text
    row: Row
    margin: float | None = None


@dataclass
class Unpaired:
    prompt: Text
    completion: Text
    label: bool  # True: desirable
    row: Row


# ---------------------------------------------------------------- validation


def _check_type(row: Row, name: str, value: Any) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list):
        formats.check_conversation(row, name, value)
        return
    raise row.error(name, f"must be a string or a list of messages, got {type(value).__name__}")


def _check_completion(row: Row, name: str, value: Text) -> None:
    """Non-empty text, or a conversation with at least one assistant turn."""
    if isinstance(value, str):
        if not value.strip():
            raise row.error(name, "empty completion")
    elif not any(m["role"] == "assistant" and m["content"].strip() for m in value):
        raise row.error(name, "empty completion: the conversation has no assistant turn after the prompt")


def _common_prefix(a: Text, b: Text) -> Text:
    """The shared beginning (TRL's `extract_prompt`): whole messages for conversations; for strings the
    characters before the first difference, a space there going to the completions ("The sky is" |
    " blue." / " green.")."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if isinstance(a, str) and 0 < n < min(len(a), len(b)) and a[n - 1] == " ":
        n -= 1
    return a[:n]


def _strip_prompt(row: Row, name: str, prompt: list, value: list) -> list:
    """A conversational completion that repeats the conversation must start with the prompt's messages."""
    if value and value[0]["role"] == "assistant":
        return value
    for i, message in enumerate(prompt):
        if i >= len(value) or value[i] != message:
            raise row.error(f"{name}[{i}]" if i < len(value) else name,
                            f"the conversation does not start with the prompt: message {i} differs from prompt[{i}] "
                            "(give the assistant reply alone, or the whole conversation beginning with the prompt)")
    return value[len(prompt):]


def _margin(row: Row) -> float | None:
    if "margin" not in row.data or row.data["margin"] is None:
        return None
    m = row.data["margin"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
        raise row.error("margin", f"must be a finite number, got {m!r}")
    return float(m)


def check_pair(row: Row, fmt: str) -> Pair:
    """One validated pair (explicit or implicit prompt) or a DataError naming the row and field."""
    for key in ("chosen", "rejected") + (("prompt",) if fmt == "preference" else ()):
        if key not in row.data or row.data[key] is None:
            problem = "missing prompt" if key == "prompt" else "missing key"
            raise row.error(key, f"{problem} (the dataset's format is '{fmt}', from its first row)")
        _check_type(row, key, row.data[key])
    chosen, rejected = row.data["chosen"], row.data["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise row.error("rejected", "chosen and rejected must both be strings or both be conversations")
    if fmt == "preference":
        prompt = row.data["prompt"]
        if isinstance(prompt, str) and not isinstance(chosen, str):
            raise row.error("chosen", "the prompt is a string: chosen and rejected must be too")
    else:
        prompt = _common_prefix(chosen, rejected)
    if (isinstance(prompt, str) and not prompt.strip()) or (isinstance(prompt, list) and not prompt):
        where = "prompt" if fmt == "preference" else "chosen"
        raise row.error(where, "missing prompt" + ("" if fmt == "preference" else
                                                   ": chosen and rejected share no beginning to use as the prompt"))
    if isinstance(prompt, list) and isinstance(chosen, str):  # a plain reply after a conversation
        chosen, rejected = _as_completion(prompt, chosen), _as_completion(prompt, rejected)
    elif isinstance(prompt, list):
        chosen = _strip_prompt(row, "chosen", prompt, chosen) if fmt == "preference" else chosen[len(prompt):]
        rejected = _strip_prompt(row, "rejected", prompt, rejected) if fmt == "preference" else rejected[len(prompt):]
    elif fmt == "implicit_preference":
        chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
    _check_completion(row, "chosen", chosen)
    _check_completion(row, "rejected", rejected)
    if chosen == rejected:
        raise row.error("rejected", "identical to chosen: a preference pair must differ")
    return Pair(prompt, chosen, rejected, row, _margin(row))


def check_unpaired(row: Row) -> Unpaired:
    for key in ("prompt", "completion"):
        if key not in row.data or row.data[key] is None:
            raise row.error(key, "missing prompt" if key == "prompt" else "missing key")
        _check_type(row, key, row.data[key])
    prompt, completion = row.data["prompt"], row.data["completion"]
    if (isinstance(prompt, str) and not prompt.strip()) or (isinstance(prompt, list) and not prompt):
        raise row.error("prompt", "missing prompt")
    if isinstance(prompt, str) and not isinstance(completion, str):
        raise row.error("completion", "the prompt is a string: the completion must be too")
    if isinstance(prompt, list):
        completion = (_as_completion(prompt, completion) if isinstance(completion, str)
                      else _strip_prompt(row, "completion", prompt, completion))
    _check_completion(row, "completion", completion)
    if not isinstance(row.data.get("label"), bool):
        raise row.error("label", f"must be true or false, got {row.data.get('label')!r}")
    return Unpaired(prompt, completion, row.data["label"], row)


PREFERENCE_DATA = ("preference pairs, one {prompt, chosen, rejected} object a row (or {chosen, rejected} conversations; "
                   "kto also {prompt, completion, label}), as .jsonl, .json, .parquet, a datasets folder or a Hub dataset "
                   "(docs/data.md)")


def _read(source: str | Path, seed: int, key: str = "data") -> list[formats.Row]:
    if not str(source).strip():
        raise UserError(f"{key}= is required: {PREFERENCE_DATA}")
    rows = formats.read_rows(source, seed)
    if not rows:
        raise UserError(f"{source}: the dataset is empty (no rows): {PREFERENCE_DATA}")
    return rows


def load_pairs(source: str | Path, seed: int = 0) -> list[Pair]:
    """Every row of a preference dataset, validated (explicit or implicit prompt)."""
    rows = _read(source, seed)
    fmt = formats.detect_format(rows[0], PAIRED)
    return [check_pair(row, fmt) for row in rows]


def load_preference(source: str | Path, unpaired_ok: bool = False, seed: int = 0) -> list[Pair] | list[Unpaired]:
    """Pairs; with `unpaired_ok` (KTO) also an unpaired dataset ({prompt, completion, label}). `seed`: a mixture's draw."""
    rows = _read(source, seed)
    fmt = formats.detect_format(rows[0], PAIRED + (UNPAIRED if unpaired_ok else ()))
    if fmt in UNPAIRED:
        return [check_unpaired(row) for row in rows]
    return [check_pair(row, fmt) for row in rows]


def unpair(pairs: list[Pair]) -> list[Unpaired]:
    """TRL's `unpair_preference_dataset`: each pair gives a desirable and an undesirable example."""
    return [Unpaired(p.prompt, p.chosen, True, p.row) for p in pairs] + [
        Unpaired(p.prompt, p.rejected, False, p.row) for p in pairs]


# ---------------------------------------------------------------- tokenization


@dataclass
class TokenizedPair:
    """A prompt and its continuations (chosen, rejected; or one completion for unpaired data)."""

    prompt_ids: list[int]
    continuations: list[Tokenized]  # ids after the prompt, with their loss masks
    row: Row
    margin: float | None = None
    label: bool | None = None  # unpaired examples
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:  # tokens of the shared-prefix layout: the prompt once
        return len(self.prompt_ids) + sum(len(c) for c in self.continuations)

    def longest(self) -> int:  # the longest prompt + continuation (what max_length bounds)
        return len(self.prompt_ids) + max(len(c) for c in self.continuations)


def _as_completion(prompt: Text, completion: Text) -> Text:
    """A plain-string completion after a conversational prompt becomes one assistant turn."""
    if isinstance(prompt, list) and isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    return completion


def render_sequences(tok, prompt: Text, completions: list[Text]) -> tuple[list[int], list[Tokenized]]:
    """Prompt ids shared by every completion, and each continuation cut after its last trained token.

    The prompt is the common token prefix of the rendered sequences (never past a trained token), so a
    template or tokenizer that merges across the boundary still yields exact continuations."""
    full = [render_prompt_completion(tok, prompt, _as_completion(prompt, c)) for c in completions]
    for f in full:
        if 1 not in f.loss_mask:
            raise TemplateError("the completion renders to no trained tokens")
    first = min(f.loss_mask.index(1) for f in full)
    n = 0
    while n < first and all(f.input_ids[n] == full[0].input_ids[n] for f in full):
        n += 1
    if n == 0:
        raise TemplateError("the completions share no prompt tokens (nothing to predict their first token from)")
    conts = []
    for f in full:
        end = len(f.loss_mask) - f.loss_mask[::-1].index(1)  # after the last trained token
        conts.append(Tokenized(f.input_ids[n:end], f.loss_mask[n:end]))
    return full[0].input_ids[:n], conts


def scored_ids(tok, prompt: Text, completion: Text) -> list[int]:
    """The tokens a sequence classifier reads for prompt + completion, built as TRL's RewardTrainer builds them
    and as a user of `AutoModelForSequenceClassification` does: a conversation is the chat template's rendering
    of the whole conversation (`apply_chat_template(prompt + reply, tokenize=True)`, no generation prompt: in
    ChatML it ends with `<|im_end|>` and a newline); plain text is prompt + completion with the EOS text
    appended when missing, tokenized with the tokenizer's special tokens. The score is then read at the last
    non-pad token of these ids (transformers' rule), e.g. that closing newline."""
    completion = _as_completion(prompt, completion)
    if isinstance(prompt, str) and isinstance(completion, str):
        text = prompt + completion
        if tok.eos_token and not text.endswith(tok.eos_token):
            text += tok.eos_token
        return list(tok(text)["input_ids"])
    if isinstance(prompt, str) or isinstance(completion, str):
        raise TemplateError("prompt and completion must both be strings or both be conversations")
    return list(tok.apply_chat_template(list(prompt) + list(completion), tokenize=True, return_dict=False))


def render_scored(tok, prompt: Text, completions: list[Text]) -> tuple[list[int], list[Tokenized]]:
    """Reward-model sequences (`scored_ids`) split into shared prompt ids and one continuation each.

    The prompt is the common token prefix of the sequences and of the rendered prompt (with its generation
    header), kept at least one token short of the shortest sequence; the continuations run to the end of the
    rendering, template suffix included, so prompt + continuation are exactly the ids transformers scores."""
    seqs = [scored_ids(tok, prompt, c) for c in completions]
    head = render_prompt(tok, prompt)
    limit = min(min(map(len, seqs)) - 1, len(head))
    n = 0
    while n < limit and all(s[n] == head[n] for s in seqs):
        n += 1
    if n == 0:
        raise TemplateError("the completions share no prompt tokens (nothing to score them after)")
    return seqs[0][:n], [Tokenized(s[n:], [1] * (len(s) - n)) for s in seqs]


def tokenize(tok, examples: list[Pair] | list[Unpaired], scored: bool = False) -> list[TokenizedPair]:
    """`scored` (reward models): each sequence as a sequence classifier reads it (`render_scored`); otherwise
    (DPO, KTO) cut after the last trained token with the completion's loss mask (`render_sequences`)."""
    render = render_scored if scored else render_sequences
    out = []
    for ex in examples:
        if isinstance(ex, Pair):
            completions, margin, label = [ex.chosen, ex.rejected], ex.margin, None
        else:
            completions, margin, label = [ex.completion], None, ex.label
        try:
            prompt_ids, conts = render(tok, ex.prompt, completions)
        except TemplateError as e:
            raise ex.row.error("chosen" if isinstance(ex, Pair) else "completion", str(e)) from None
        out.append(TokenizedPair(prompt_ids, conts, ex.row, margin, label))
    return out


def check_lengths(examples: list[TokenizedPair], max_length: int, too_long: str) -> list[TokenizedPair]:
    """Refuse (or drop, too_long='drop') examples whose prompt + longest continuation exceeds max_length."""
    kept = []
    for ex in examples:
        if ex.longest() > max_length:
            if too_long == "drop":
                continue
            raise ex.row.error(None, f"{ex.longest()} tokens (prompt + longest completion) > max_length={max_length} "
                               "(raise max_length or set too_long=drop)")
        kept.append(ex)
    if not kept:
        raise UserError(f"every example is longer than max_length={max_length}")
    return kept


def split(examples: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded random `eval_fraction` of the rows held out, the rest in file order."""
    import torch

    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + 7)).tolist()
    n_eval = int(len(examples) * eval_fraction)
    held = set(order[:n_eval])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def load_split(tok, data: str, eval_data: str = "", eval_fraction: float = 0.0, seed: int = 0,
               max_length: int = 1024, too_long: str = "error", unpaired_ok: bool = False,
               unpair_train: bool = False, scored: bool = False) -> tuple[list[TokenizedPair], list[TokenizedPair]]:
    """Validated, tokenized (train, eval) examples; everything is checked before any model loads.

    `unpair_train` (KTO): training pairs become unpaired examples; held-out pairs stay pairs, so the
    preference accuracy is measured the same way for every loss. `scored` (reward models): sequences as a
    sequence classifier reads them (`render_scored`)."""
    examples = load_preference(data, unpaired_ok, seed)
    check_template(tok, [e.row for e in examples])
    if eval_data:
        train, held = examples, load_preference(eval_data, unpaired_ok, seed)
    else:
        train, held = split(examples, eval_fraction, seed)
    if unpair_train and train and isinstance(train[0], Pair):
        train = unpair(train)
    train_tok = check_lengths(tokenize(tok, train, scored), max_length, too_long)
    held_tok = check_lengths(tokenize(tok, held, scored), max_length, too_long) if held else []
    return train_tok, held_tok
