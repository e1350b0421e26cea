"""Where posttrain writes: output paths checked before any work, JSON that strict parsers read, atomic files.

Every command that writes checks its output path first (`check_output_dir`, `check_output_file`), so a path
that is a file, lies under a file or cannot be written is refused before a model loads or a judge is called.
Every JSON document goes through `to_json` (NaN and ±inf become null: `json.dumps` would write bare `NaN`,
which strict parsers such as `jq` or JavaScript's `JSON.parse` reject). Files a long step produces are written
atomically (`atomic_open`, `write_json`): into a temporary file beside the target, renamed when complete, so an
interruption leaves the previous file, never half a new one.

    out = check_output_dir(cfg.output_dir)                       # UserError naming output_dir=... and what to do
    path = check_output_file(cfg.output, key="output")           # a folder, or a file under a file: refused
    with atomic_open(path) as f: f.write(...)                    # renamed onto `path` when the block ends
    write_json(out / "summary.json", summary)                    # NaN -> null, atomic
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from posttrain.errors import UserError


def _nearest_existing(path: Path) -> Path:
    """`path` itself or its closest ancestor that exists."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_parent_chain(path: Path, key: str) -> None:
    """Refuse when an ancestor of `path` is a file, or the closest existing folder cannot be written."""
    existing = path if path.is_dir() else _nearest_existing(path.parent)
    if existing.exists() and not existing.is_dir():
        raise UserError(f"{key}={path}: {existing} is a file, not a folder: choose a path outside it")
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{key}={path}: cannot write in {existing} (permission denied): choose a folder you can write to")


def check_output_dir(path: str | Path, key: str = "output_dir") -> Path:
    """A folder the command may create or write into; refused (UserError) when it is a file, lies under a file
    or cannot be written. Creates nothing."""
    path = Path(path)
    if str(path).strip() == "":
        raise UserError(f"{key} is empty: give a folder, e.g. {key}=runs/my-run")
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}={path} is a file, not a folder: choose a folder (an absent one is created)")
    _check_parent_chain(path, key)
    return path


def check_output_file(path: str | Path, key: str = "output") -> Path:
    """A file the command may write; refused (UserError) when it is a folder, lies under a file or cannot be
    written. Creates nothing."""
    path = Path(path)
    if str(path).strip() == "" or str(path).endswith(("/", os.sep)):
        raise UserError(f"{key}={path!s}: give a file name, e.g. {key}=out.jsonl")
    if path.is_dir():
        raise UserError(f"{key}={path} is a folder: give a file name, e.g. {key}={path / 'out.jsonl'}")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{key}={path}: the file cannot be written (permission denied): choose another path")
    _check_parent_chain(path, key)
    return path


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, ±inf) replaced by None, through dicts, lists and tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def to_json(obj: Any, **kwargs) -> str:
    """`json.dumps` that strict parsers read: NaN and ±inf written as null (a not-measured value). `default`
    (e.g. `str`) converts objects JSON lacks; numpy scalars become Python numbers first."""
    default = kwargs.pop("default", None)

    def convert(o: Any) -> Any:
        item = getattr(o, "item", None)  # numpy / torch scalars
        if callable(item) and getattr(o, "ndim", 1) == 0:
            return finite(item())
        if default is None:
            raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")
        return finite(default(o))

    return json.dumps(finite(obj), allow_nan=False, default=convert, **kwargs)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str = "utf-8") -> Iterator[IO]:
    """Write `path` through a temporary file in its folder, renamed onto it when the block ends without an
    exception (the folder is created); on an exception the temporary file is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # "x": created here, the umask's mode
    try:
        with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else encoding) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: str | Path, obj: Any, indent: int | None = 1, **kwargs) -> Path:
    """`to_json(obj)` written atomically to `path`."""
    with atomic_open(path) as f:
        f.write(to_json(obj, indent=indent, **kwargs))
    return Path(path)
