"""`posttrain data export data=SPEC output=FILE.jsonl [seed=N]`: write any `data=` source as JSON lines.

SPEC is whatever a recipe's `data=` takes: a built-in task (`arithmetic:200`), a file, a datasets folder, a
Hub dataset (`org/name:split`) or a mixture (`a.jsonl:0.7,org/name:0.3`, drawn with `seed` as a recipe with
that seed draws it). The file has the same rows the recipe would read, in TRL's columns for the built-in
tasks (`prompt` + `completion`, `messages`, `answer`), so it is also a dataset for TRL's trainers
(`load_dataset("json", data_files=FILE)`).
"""

from __future__ import annotations

from pydantic import Field

from posttrain.config import Config, parse_args
from posttrain.errors import UserError
from posttrain.outputs import atomic_open, check_output_file, to_json


class DataExportConfig(Config):
    """Write the rows of a `data=` source to a JSONL file."""

    data: str = Field("", description="a task (arithmetic:200), file, datasets folder, Hub dataset (org/name[:config]:split) or mixture (a.jsonl:0.7,org/name:0.3)")
    output: str = Field("", description="output .jsonl, one row per line")
    seed: int = Field(0, description="a mixture's draw (use the recipe's seed to get the rows it trains on)")


def export(cfg: DataExportConfig) -> dict:
    from posttrain.data import formats

    out = check_output_file(cfg.output)
    rows = formats.read_rows(cfg.data, cfg.seed)
    if not rows:
        raise UserError(f"data '{cfg.data}': no rows")
    with atomic_open(out) as f:
        for row in rows:
            f.write(to_json(row.data, ensure_ascii=False) + "\n")
    sources: dict[str, int] = {}
    for row in rows:
        sources[row.source] = sources.get(row.source, 0) + 1
    return {"rows": len(rows), "format": formats.detect_format(rows[0]), "sources": sources}


USAGE = "usage: posttrain data export data=SPEC output=FILE.jsonl [seed=N]   (`posttrain data export --help`: the keys)"


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if argv[0] != "export":
        raise UserError(f"unknown data command '{argv[0]}'; {USAGE}")
    cfg = parse_args(DataExportConfig, argv[1:], prog="posttrain data export")
    for key in ("data", "output"):
        if not getattr(cfg, key):
            raise UserError(f"missing key '{key}': posttrain data export data=SPEC output=FILE.jsonl")
    res = export(cfg)
    per = ", ".join(f"{n} from {s}" for s, n in res["sources"].items())
    print(f"{res['rows']} rows ({res['format']}) -> {cfg.output}: {per}")
