"""`posttrain report DIR`: rebuild report.html from the files a run left in DIR (nothing is recomputed).

A quickstart folder (eval_before/, eval_after/, compare.json) gets the quickstart page; any other run
directory with metrics.jsonl gets the run page (grid of training plots, summary.json, plan vs measured).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from posttrain.errors import UserError
from posttrain.monitor.quickstart_report import write_quickstart_report
from posttrain.monitor.report import write_report


def rebuild(run_dir: str | Path) -> Path:
    d = Path(run_dir)
    if not d.is_dir():
        raise UserError(f"{d}: no such folder" + (" (a file: give the run's folder)" if d.exists() else "")
                        + "; posttrain report RUN_DIR rebuilds the report of a run or quickstart folder")
    if (d / "compare.json").is_file() and (d / "eval_before").is_dir():
        return write_quickstart_report(d)
    if not (d / "metrics.jsonl").is_file():
        hint = ("; it holds an evaluation's results.json, whose report.html posttrain eval writes (rerun the evaluation "
                "to rebuild it)") if (d / "results.json").is_file() else ""
        raise UserError(f"{d}: no metrics.jsonl (nor a quickstart's compare.json): not a run directory{hint}")
    sections = {}
    for name, file in (("summary", "summary.json"), ("plan vs measured", "plan.json")):
        data = _section(d / file)
        if data is not None:
            sections[name] = data.get("comparison", {}) if file == "plan.json" else data
    return write_report(d, f"run — {d}", sections)


def _section(path: Path) -> dict | None:
    """A JSON object the run page shows, or None when absent; an unreadable one (a run killed while writing it) is
    left out of the page with a warning, not a reason to lose the rest of the report."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        print(f"warning: {path}: not readable JSON ({e}); the page is built without it", file=sys.stderr)
        return None
    if not isinstance(data, dict):
        print(f"warning: {path}: not a JSON object; the page is built without it", file=sys.stderr)
        return None
    return data


def main(argv: list[str]) -> None:
    dirs = [a for a in argv if not a.startswith("-")]
    if len(dirs) != 1 or any(a in ("-h", "--help") for a in argv):
        raise UserError("usage: posttrain report RUN_DIR   (rebuilds RUN_DIR/report.html from its files)")
    print(f"report: {rebuild(dirs[0]).resolve()}")
