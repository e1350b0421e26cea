"""The CLI fuzz harness (tests/test_edges_*.py): unusual-but-reasonable invocations of every command.

Each `Case` is one `posttrain ...` command line run in-process through `posttrain.cli.main` (a subprocess per case
would cost seconds of imports; in-process cases cost milliseconds to a second on the tiny model). The case is
classified, and the classification is the test:

- **works**: exit status 0, no traceback, and the case's `check` (if any) finds a correct result: not a silently
  degraded one (a k that was asked for and dropped, a value ignored).
- **clear error**: exit status 2, no traceback, and stderr's last line is the only one starting with `error:`; it
  names every word of `mentions` (the key, file, row or field and what to do).

Anything else fails: an exception escaping `cli.main` (a raw traceback), another exit status, an error line that
does not name what to fix. `keep=` lists files and folders of finished work (results, checkpoints, `final/`) that
the case must leave byte-identical, whether it works or not.

Placeholders in argv are filled from the `Workspace`: `{tmp}` (a fresh folder per case), `{prompts}`, `{sft}`,
`{pref}`, `{completions}`, ... (see `Workspace.files`), and `{run:NAME}` (a finished run made once per session by
`Workspace.run`; read-only) or `{copy:NAME}` (a private copy of it in `{tmp}`, for resuming).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from posttrain import cli

WORKS, ERROR = "works", "error"


@dataclass
class Case:
    id: str
    argv: list[str]
    expect: str = ERROR  # WORKS | ERROR
    mentions: tuple[str, ...] = ()  # words the error line must contain (case-insensitive)
    check: Callable[[CaseRun], None] | None = None  # for WORKS: asserts the result is right
    setup: Callable[[Path], None] | None = None  # writes the case's own files into {tmp} before it runs
    keep: tuple[str, ...] = ()  # paths (placeholders allowed) that must be unchanged afterwards
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class CaseRun:
    rc: int
    out: str
    err: str
    tmp: Path
    argv: list[str]

    def json(self, rel: str) -> dict:
        return json.loads((self.tmp / rel).read_text())


def digest(path: Path) -> str:
    """A hash of a file or of a folder's every file (names and bytes): what 'finished work is untouched' means."""
    h = hashlib.sha256()
    paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in paths:
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode())
        h.update(p.read_bytes())
    return h.hexdigest() if path.exists() else "missing"


def run_cli(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`posttrain argv` in this process -> (exit status, stdout, stderr). Exceptions propagate: a traceback."""
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse-style exits and sys.exit from inside a command
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return int(rc or 0), out.getvalue(), err.getvalue()


_PLACEHOLDER = re.compile(r"\{([a-z_]+)(?::([A-Za-z0-9_]+))?\}")


def fill(text: str, ws: Workspace, tmp: Path) -> str:
    def one(m: re.Match) -> str:
        name, arg = m.group(1), m.group(2)
        if name == "tmp":
            return str(tmp)
        if name == "run":
            return str(ws.run(arg))
        if name == "copy":  # a private copy of a finished run, for cases that resume or write into it
            dst = tmp / f"copy-{arg}"
            if not dst.exists():
                shutil.copytree(ws.run(arg), dst)
            return str(dst)
        return str(ws.file(name))

    return _PLACEHOLDER.sub(one, text)


def classify(case: Case, ws: Workspace, tmp: Path) -> CaseRun:
    """Run `case` and assert it ends as it should (module docstring). -> the run, for further checks."""
    tmp.mkdir(parents=True, exist_ok=True)
    if case.setup is not None:
        case.setup(tmp)
    argv = [fill(a, ws, tmp) for a in case.argv]
    kept = {p: digest(Path(p)) for p in (fill(k, ws, tmp) for k in case.keep)}
    rc, out, err = run_cli(argv, case.env)
    run = CaseRun(rc, out, err, tmp, argv)
    shown = f"posttrain {' '.join(argv)}\n--- exit {rc}; stderr:\n{err[-3000:]}"
    assert "Traceback" not in err, f"traceback on stderr:\n{shown}"
    for path, before in kept.items():
        assert digest(Path(path)) == before, f"finished work changed or lost: {path}\n{shown}"
    if case.expect == WORKS:
        assert rc == 0, f"expected the command to work:\n{shown}"
        if case.check is not None:
            case.check(run)
        return run
    assert rc == 2, f"expected a clear error (exit 2):\n{shown}"
    lines = [line for line in err.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], f"expected one final 'error:' line:\n{shown}"
    for word in case.mentions:
        assert word.lower() in errors[0].lower(), f"the error line does not name {word!r}:\n{shown}"
    return run


# ---------------------------------------------------------------------------------------------------------------
# The shared inputs: small files every command reads, written once per session.

def _additions(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"What is {i} + {i + 1}? Answer with the number.", "answer": str(2 * i + 1)}
            for i in range(start, start + n)]


def _conversation(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                         {"role": "assistant", "content": f"{i} + 1 = {i + 1}."}]}


def _pair(i: int) -> dict:
    return {"prompt": f"What is {i} + 1?", "chosen": f"{i + 1}", "rejected": f"I think it is {i + 7}, maybe."}


FILES: dict[str, Callable[[], list[dict] | str]] = {
    "prompts": lambda: _additions(8),  # prompt + answer: rl, eval, generate, rs
    "heldout": lambda: _additions(4, start=50),
    "sft": lambda: [_conversation(i) for i in range(8)],  # messages: sft, distill sequence
    "pref": lambda: [_pair(i) for i in range(8)],  # prompt/chosen/rejected: dpo, rm
    "completions": lambda: [{"prompt": r["prompt"], "completion": r["answer"], "answer": r["answer"]}
                            for r in _additions(4)],  # score
    "one_prompt": lambda: _additions(1),
    "empty": lambda: "",
}


class Workspace:
    """The session's shared inputs (FILES) and finished runs (RUNS), made on first use under `root`."""

    # name -> argv of a finished run that resume/keep cases start from; the output_dir is added
    RUNS: dict[str, list[str]] = {
        "sft": ["sft", "model=tiny-random", "data={sft}", "max_steps=2", "save_every=1"],
        "rl": ["rl", "model=tiny-random", "data={prompts}", "reward=math", "max_steps=2", "prompts_per_step=2",
               "group_size=2", "max_new_tokens=4", "save_every=1"],
        "eval": ["eval", "model=tiny-random", "data={prompts}", "reward=math", "n=2", "max_new_tokens=4"],
        "rm": ["rm", "model=tiny-random", "data={pref}", "max_steps=1"],  # a reward model: rm probe's input
    }

    def __init__(self, root: Path):
        self.root = root
        self._files: dict[str, Path] = {}
        self._runs: dict[str, Path] = {}

    def file(self, name: str) -> Path:
        if name not in self._files:
            if name not in FILES:
                raise KeyError(f"unknown placeholder {{{name}}}; add it to tests/edges.py FILES")
            rows = FILES[name]()
            path = self.root / "files" / f"{name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows))
            self._files[name] = path
        return self._files[name]

    def run(self, name: str) -> Path:
        """A finished run's folder (made once). Cases must not write into it unless they copy it first."""
        if name not in self._runs:
            out = self.root / "runs" / name
            argv = [fill(a, self, out) for a in self.RUNS[name]] + [f"output_dir={out}"]
            rc, _, err = run_cli(argv)
            assert rc == 0, f"workspace run {name} failed: {err[-2000:]}"
            self._runs[name] = out
        return self._runs[name]


def ids(cases: list[Case]) -> list[str]:
    seen = [c.id for c in cases]
    dup = {i for i in seen if seen.count(i) > 1}
    assert not dup, f"duplicate case ids: {dup}"
    return seen


# ---------------------------------------------------------------------------------------------------------------
# Small builders the case files share.

def write_file(name: str, text: str) -> Callable[[Path], None]:
    """A `setup` that writes `text` to {tmp}/name."""
    def setup(tmp: Path) -> None:
        (tmp / name).write_text(text, encoding="utf-8")
    return setup


def jsonl_file(name: str, rows: list) -> Callable[[Path], None]:
    return write_file(name, "".join(json.dumps(r) + "\n" for r in rows))


def asserting(check: Callable[[CaseRun], object] | None) -> Callable[[CaseRun], None] | None:
    """A check that may return False (not only raise) for a wrong result."""
    if check is None:
        return None

    def run_check(run: CaseRun) -> None:
        assert check(run) is not False, f"the result is not what was asked for (see {run.tmp})"
    return run_check
