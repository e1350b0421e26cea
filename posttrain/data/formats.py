"""Dataset formats (the ecosystem's conventions, same keys as TRL) and their validation.

    language modelling     {"text"} | {"messages"}
    prompt-only            {"prompt"}
    prompt-completion      {"prompt", "completion"}
    preference             {"prompt", "chosen", "rejected"} | implicit prompt {"chosen", "rejected"}
    unpaired preference    {"prompt", "completion", "label"}

Sources (`read_rows`): files, `datasets` folders, built-in tasks, Hub datasets and mixtures (data/sources.py).
Each text field is a plain string or a conversation `[{"role", "content"}, ...]`. Extra columns
(e.g. `answer`, `tests`) are kept and flow to reward functions as keyword arguments. Every row is
checked before training; a problem raises DataError naming file, row and field.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data import sources, tasks
from posttrain.errors import DataError, UserError

ROLES = ("system", "user", "assistant", "tool")

# format name -> required keys (checked in this order: the first whose keys are all present wins)
FORMATS: dict[str, tuple[str, ...]] = {
    "preference": ("prompt", "chosen", "rejected"),
    "implicit_preference": ("chosen", "rejected"),
    "unpaired_preference": ("prompt", "completion", "label"),
    "prompt_completion": ("prompt", "completion"),
    "conversation": ("messages",),
    "text": ("text",),
    "prompt_only": ("prompt",),
}
TEXT_FIELDS = ("text", "messages", "prompt", "completion", "chosen", "rejected")


@dataclass
class Row:
    """One dataset row with where it came from (for error messages)."""

    data: dict[str, Any]
    source: str
    number: int  # 1-based: the line in a JSONL file, the row index + 1 elsewhere

    def error(self, field: str | None, problem: str) -> DataError:
        return DataError(self.source, self.number, field, problem)


# ---------------------------------------------------------------- reading


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # \ud800-\udfff written in JSON


def _utf8(raw: bytes, path: Path, line: int, offset: int) -> str:
    """One line's bytes as text (a UTF-8 byte-order mark on the first line is dropped); offset: the line's first byte."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(str(path), line, None, f"not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset {offset + e.start} "
                        "of the file; save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT)") from None
    return text[1:] if line == 1 and text.startswith("\ufeff") else text


def _lone_surrogate(value: Any, where: str = "") -> tuple[str, str] | None:
    """(field path, the escape) of the first string holding a lone surrogate, which JSON allows and Unicode does not."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return where, f"\\u{ord(value[e.start]):04x}"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        hit = _lone_surrogate(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else str(k))
        if hit:
            return hit
    return None


def _check_text(data: Any, source: str, line: int | None, escapes: bool) -> None:
    """`escapes`: the row's JSON text has a surrogate escape (without one no string can hold a lone surrogate)."""
    if escapes and (hit := _lone_surrogate(data)):
        raise DataError(source, line, hit[0] or None, f"a lone surrogate escape {hit[1]} (not valid Unicode; no tokenizer "
                        "can encode it): fix or drop the text (a surrogate pair such as \\ud83d\\ude00 is fine)")


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _utf8(raw, path, number, offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(str(path), number, None, f"invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(data, dict):
                raise DataError(str(path), number, None, f"each line must be a JSON object, got {type(data).__name__}")
            _check_text(data, str(path), number, _SURROGATE_ESCAPE.search(line) is not None)
            rows.append(Row(data, str(path), number))
    return rows


def _read_json(path: Path) -> list[Row]:
    """A .json file: a list of objects (row i = element i, 1-based)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(str(path), None, None, f"not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset {e.start} (line "
                        f"{line}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        hint = " (one object per line? name the file .jsonl)" if e.msg == "Extra data" else ""
        raise DataError(str(path), None, None, f"invalid JSON ({e.msg} at line {e.lineno}, column {e.colno}){hint}") from None
    if not isinstance(data, list):
        raise DataError(str(path), None, None, f"a .json dataset must be a list of objects, got {type(data).__name__}"
                        + (" (JSON lines? name the file .jsonl)" if isinstance(data, dict) else ""))
    escapes = _SURROGATE_ESCAPE.search(text) is not None  # else no string can hold a lone surrogate
    for i, r in enumerate(data):
        if not isinstance(r, dict):
            raise DataError(str(path), i + 1, None, f"each element must be a JSON object, got {type(r).__name__}")
        _check_text(r, str(path), i + 1, escapes)
    return _read_table(data, str(path))


def _read_table(records: list[dict], source: str) -> list[Row]:
    return [Row(dict(r), source, i + 1) for i, r in enumerate(records)]


def read_rows(source: str | Path, seed: int = 0) -> list[Row]:
    """Rows of a JSONL/JSON/Parquet file, an HF `datasets` folder (save_to_disk), a built-in task, a Hub dataset
    (`org/name[:config]:split`, through `datasets.load_dataset`, from its cache offline) or a weighted mixture of
    these (`a.jsonl:0.7,org/name:0.3`, subsampled with `seed`): data/sources.py."""
    name = str(source)
    if not name.strip():  # `data=` left empty (the recipe's default for data it cannot guess)
        raise UserError("data= is required: give a .jsonl/.json/.parquet file, a datasets folder, a Hub dataset "
                        f"(org/name[:split]) or a task ({', '.join(tasks.TASKS)}); formats in docs/data.md")
    if sources.is_mixture(name):
        return _read_mixture(name, seed)
    if name in tasks.TASKS or name.split(":", 1)[0] in tasks.TASKS:
        return _read_table(tasks.generate(name), f"task:{name}")
    path = Path(name)
    if not path.exists() and sources.is_hub_dataset(name):
        return _read_table(sources.load_hub(name), name)
    if not path.exists():
        raise UserError(f"data '{name}' not found: give a .jsonl/.parquet file, a datasets folder, a Hub dataset "
                        f"(org/name[:split]) or a task ({', '.join(tasks.TASKS)})")
    if path.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # report what datasets said
            files = sorted(p.name for p in path.iterdir() if p.suffix.lower() in (".jsonl", ".ndjson", ".json", ".parquet"))
            hint = f"; to read a file in it, name it: data={path / files[0]}" if files else ""
            raise UserError(f"{path}: not a datasets folder saved with save_to_disk ({e}){hint}") from None
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return _read_table(ds.to_list(), str(path))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return _read_table(pq.read_table(path).to_pylist(), str(path))
    raise UserError(f"{path}: unsupported data file type '{suffix}' (use .jsonl, .json, .parquet or a datasets folder)")


def _read_mixture(spec: str, seed: int) -> list[Row]:
    parts = sources.parse_mixture(spec)
    tables = [read_rows(source, seed) for source, _ in parts]
    for (source, _), rows in zip(parts, tables):
        if not rows:
            raise UserError(f"data mixture '{spec}': '{source}' has no rows")
    return sources.mix(tables, [w for _, w in parts], seed)


def check_not_input(output: str | Path, inputs: dict[str, str | Path], key: str = "output") -> None:
    """Refuse an output file that is one of the command's input files (`inputs`: key -> path): writing it would
    replace what the command reads, finished work included."""
    if not str(output):
        return
    out = Path(output).resolve()
    for name, path in inputs.items():
        if path and Path(path).is_file() and Path(path).resolve() == out:
            raise UserError(f"{key}={output} is the {name} file itself: writing it would replace that input; "
                            f"choose another {key}= path")


# ---------------------------------------------------------------- validation


def detect_format(row: Row, allowed: tuple[str, ...] | None = None) -> str:
    """The first format (of `allowed`, in FORMATS order) whose keys the row has."""
    candidates = [f for f in FORMATS if allowed is None or f in allowed]
    for name in candidates:
        if all(k in row.data for k in FORMATS[name]):
            return name
    wanted = sorted({k for f in candidates for k in FORMATS[f]} - set(row.data))
    near = [(k, m[0]) for k in sorted(row.data) if k not in wanted and (m := difflib.get_close_matches(k, wanted, n=1, cutoff=0.8))]
    hint = "".join(f"; did you mean '{want}' for '{have}'?" for have, want in near[:2])
    raise row.error(None, f"no usable format: the row has keys {sorted(row.data)}; expected "
                    + " or ".join("{" + ", ".join(FORMATS[f]) + "}" for f in candidates) + hint)


def check_conversation(row: Row, field: str, messages: Any, need_assistant: bool = False) -> None:
    if not isinstance(messages, list) or not messages:
        raise row.error(field, "a conversation must be a non-empty list of {role, content} messages")
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise row.error(where, f"a message must be an object, got {type(m).__name__}")
        if "role" not in m:
            raise row.error(where, "missing key 'role'")
        if "content" not in m:
            raise row.error(where, "missing key 'content'")
        if m["role"] not in ROLES:
            raise row.error(f"{where}.role", f"unknown role {m['role']!r} (allowed: {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise row.error(f"{where}.content", f"content must be a string, got {type(m['content']).__name__}")
        if m["role"] == "assistant" and not m["content"].strip():
            raise row.error(f"{where}.content", "empty assistant turn (nothing to learn from)")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise row.error(field, "the conversation has no assistant turn to train on")


def check_text_field(row: Row, field: str, need_assistant: bool = False) -> None:
    value = row.data[field]
    if isinstance(value, str):
        if field != "prompt" and not value.strip():
            raise row.error(field, "empty text")
        return
    if isinstance(value, list):
        check_conversation(row, field, value, need_assistant=need_assistant)
        return
    raise row.error(field, f"must be a string or a list of messages, got {type(value).__name__}")


def validate(rows: list[Row], allowed: tuple[str, ...] | None = None, source: str = "data") -> str:
    """Check every row; all rows must share one format (returned). `allowed` limits the formats."""
    if not rows:
        raise UserError(f"{source}: the dataset is empty (no rows): give a file with at least one row")
    fmt = detect_format(rows[0], allowed)
    keys = FORMATS[fmt]
    for row in rows:
        for k in keys:
            if k not in row.data:
                raise row.error(k, f"missing key (the dataset's format is '{fmt}', from its first row)")
        for k in keys:
            if k in TEXT_FIELDS:
                check_text_field(row, k, need_assistant=(k == "messages"))
        if fmt == "unpaired_preference" and not isinstance(row.data["label"], bool):
            raise row.error("label", f"must be true or false, got {row.data['label']!r}")
    return fmt


def load(source: str | Path, allowed: tuple[str, ...] | None = None, seed: int = 0) -> tuple[list[Row], str]:
    rows = read_rows(source, seed)
    return rows, validate(rows, allowed, str(source))


def completion_text(completion: Any) -> str:
    """Plain string, or the content of the last assistant message of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, list):
        for msg in reversed(completion):
            if isinstance(msg, dict) and msg.get("role", "assistant") == "assistant":
                content = msg.get("content", "")
                if isinstance(content, list):  # multimodal parts: keep the text ones
                    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
                return str(content)
        return ""
    return "" if completion is None else str(completion)
