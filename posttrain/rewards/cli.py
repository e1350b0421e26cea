"""`posttrain score data=FILE.jsonl reward="math:1.0,format:0.2" output=OUT.jsonl` — score offline.

Each input row is a JSON object with `completion` (a string or a `[{role, content}]` list), an
optional `prompt`, and the columns the rewards read (`answer` for math, `tests` or `stdio` for
code, `language`, ...). Each output row is the input row plus `reward` (the weighted sum) and
`rewards` ({name: value}); rows where a reward failed also get `reward_errors`. A summary (mean per
reward, None and error counts, time) is printed; a reward that failed on any row is listed per row and ends the
command with one error line naming the first (exit status 2), the output written.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from pydantic import Field

from posttrain.config import Config, parse_args
from posttrain.data.formats import check_not_input, read_rows
from posttrain.errors import DataError, UserError
from posttrain.outputs import atomic_open, check_output_file, to_json
from posttrain.rewards.pool import default_pool


class ScoreConfig(Config):
    """Score a JSONL file of completions with a reward or a weighted composition of rewards."""

    data: str = Field("", description="input .jsonl: one object per line with completion, optional prompt, and the rewards' columns")
    reward: str = Field("", description="reward name or weighted composition, e.g. 'math:1.0,format:0.2' or 'math:1.0,my_rewards.py:brevity:0.1' (a function in your file; posttrain score list=true shows names)")
    output: str = Field("", description="output .jsonl: each input row plus `reward`, `rewards` and, on failure, `reward_errors`")
    reward_args: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-reward options, e.g. \"{math: {require: answer_tag}, code: {partial: true}}\"; for a file reward ('my_rewards.py:brevity') they are extra keyword arguments of the function")
    workers: int = Field(2, ge=1, description="verifier worker processes (killable; math and code run there)")
    batch_size: int = Field(256, ge=1, description="rows scored per call of the composed reward")
    list: bool = Field(False, description="print the registered rewards and exit")


def _read_rows(path: str) -> list[dict]:
    """Rows of the input file (any format `posttrain.data.formats.read_rows` reads), tagged with their row number."""
    rows = [dict(r.data, __line__=r.number) for r in read_rows(path)]
    if not rows:
        raise UserError(f"{path}: no rows")
    return rows


def _validate(path: str, rows: list[dict], needs: dict[str, tuple]) -> None:
    from posttrain.rewards.registry import reserved_column  # loaded by now (compose came first)

    for row in rows:
        n = row["__line__"]
        c = row.get("completion")
        if c is None:
            raise DataError(path, n, "completion", "missing")
        if not isinstance(c, (str, list)) or (isinstance(c, list) and not all(isinstance(m, dict) and "content" in m for m in c)):
            raise DataError(path, n, "completion", "must be a string or a list of {role, content} messages")
        if (hit := reserved_column(row)) is not None:
            raise DataError(path, n, hit[0], f"this column name is taken by {hit[1]}")
        for reward, cols in needs.items():
            for col in cols:
                alts = col if isinstance(col, tuple) else (col,)
                if not any(a in row for a in alts):
                    raise DataError(path, n, " or ".join(alts), f"missing (needed by reward '{reward}')")
        if "tests" in row and not (isinstance(row["tests"], str) or (isinstance(row["tests"], list) and all(isinstance(t, str) for t in row["tests"]))):
            raise DataError(path, n, "tests", "must be a string or a list of strings")
        if "stdio" in row and not (isinstance(row["stdio"], list) and all(isinstance(t, dict) and "input" in t and "output" in t for t in row["stdio"])):
            raise DataError(path, n, "stdio", "must be a list of {input, output} objects")


def main(argv: list[str]) -> None:
    from posttrain.rewards import registry  # math-verify (slow): not for --help

    cfg = parse_args(ScoreConfig, argv, prog="posttrain score")
    if cfg.list:
        for name in registry.names():
            spec = registry.get(name)
            cols = ", ".join(" or ".join(c) if isinstance(c, tuple) else c for c in spec.columns) or "-"
            print(f"  {name:18s} columns: {cols:16s} {spec.description}")
        return
    for key in ("data", "reward", "output"):
        if not getattr(cfg, key):
            raise UserError(f"missing key '{key}': posttrain score data=FILE.jsonl reward=NAME output=OUT.jsonl")
    check_output_file(cfg.output)  # a folder or an unwritable path is refused before any reward runs
    check_not_input(cfg.output, {"data=": cfg.data})
    composed = registry.compose(cfg.reward, on_error="record", options=cfg.reward_args)
    rows = _read_rows(cfg.data)
    _validate(cfg.data, rows, composed.columns)
    default_pool(cfg.workers)
    t0 = time.perf_counter()
    per_reward: dict[str, list] = {n: [] for n, _ in composed.parts}
    errors: list[dict] = []
    with atomic_open(cfg.output) as out:
        for start in range(0, len(rows), cfg.batch_size):
            batch = rows[start:start + cfg.batch_size]
            col_names = {k for r in batch for k in r} - {"prompt", "completion", "__line__"}
            columns = {k: [r.get(k) for r in batch] for k in col_names}
            totals = composed([r.get("prompt") for r in batch], [r["completion"] for r in batch], **columns)
            row_errors: dict[int, list] = {}
            for e in composed.last_errors:
                idx = e["index"]
                rows_hit = range(len(batch)) if idx is None else [idx]
                for j in rows_hit:
                    row_errors.setdefault(j, []).append({"reward": e["reward"], "error": e["error"]})
                    errors.append({"line": batch[j]["__line__"], **e})
            for j, row in enumerate(batch):
                line = row.pop("__line__")
                vals = {n: composed.last_values[n][j] for n, _ in composed.parts}
                for n, v in vals.items():
                    per_reward[n].append(v)
                rec = dict(row, reward=totals[j], rewards=vals)
                if j in row_errors:
                    rec["reward_errors"] = row_errors[j]
                out.write(to_json(rec, ensure_ascii=False) + "\n")
                row["__line__"] = line
    dt = time.perf_counter() - t0
    print(f"scored {len(rows)} rows from {cfg.data} in {dt:.2f}s ({len(rows) / max(dt, 1e-9):.1f} rows/s) -> {cfg.output}")
    for name, w in composed.parts:
        vals = per_reward[name]
        got = [v for v in vals if v is not None]
        mean = sum(got) / len(got) if got else math.nan
        n_err = sum(1 for e in errors if e["reward"] == name)
        print(f"  {name:18s} weight {w:<6g} mean {mean:.4f}  scored {len(got)}  None {len(vals) - len(got) - n_err}  errors {n_err}")
    where = [f"{cfg.data}:{e['line']}: reward '{e['reward']}': {(e['error'].strip().splitlines() or [''])[0]}" for e in errors]
    for line in where[:20]:  # the rows, then one error line (the CLI's) naming the first
        print(f"  {line}", file=sys.stderr)
    if errors:
        raise UserError(f"{len(errors)} reward error(s), first {where[0]}; every row was written to {cfg.output}, "
                        "the failed ones marked with reward_errors")
