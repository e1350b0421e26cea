"""metrics.jsonl, always (one object per step, stable names); tensors become floats here, once. The same
writer hands each row's numbers to the sinks named in `report_to` (monitor/sinks.py: TensorBoard, W&B, ...)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from posttrain.outputs import to_json


def to_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def scalar_values(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a row for the sinks: numbers and one-element tensors as floats (NaN and inf kept as
    they are); strings, lists, None and larger tensors are left to metrics.jsonl."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)):  # bool included: 0 / 1
            out[key] = float(value)
    return out


class MetricsWriter:
    """Appends `{"step": N, ...}` lines to metrics.jsonl. On resume, lines past `step` are dropped.
    `sinks` (monitor/sinks.py) receive each row's numbers at the same step. `path=None` (ranks other than
    0 of a sharded run) writes nothing and returns the rows."""

    def __init__(self, path: str | Path | None, resume_step: int | None = None, sinks: Sequence = ()):
        self.path = Path(path) if path is not None else None
        self.sinks = list(sinks)
        if self.path is None:
            return
        if resume_step is not None and self.path.exists():
            keep = [l for l in self.path.read_text().splitlines() if l and json.loads(l).get("step", 0) <= resume_step]
            self.path.write_text("".join(l + "\n" for l in keep))
        elif resume_step is None:
            self.path.write_text("")

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": step, **{k: to_python(v) for k, v in metrics.items()}}
        if self.path is None:
            return row
        with self.path.open("a") as f:
            f.write(to_json(row) + "\n")
        if self.sinks:
            values = scalar_values(metrics)
            for sink in list(self.sinks):
                try:
                    sink.log(step, values)
                except Exception as e:  # a tracker's outage must not end a run: metrics.jsonl has every row
                    self.sinks.remove(sink)
                    print(f"warning: {type(sink).__name__} failed at step {step} ({type(e).__name__}: {e}); "
                          f"it gets no more metrics, {self.path} keeps them all", file=sys.stderr)
        return row

    def close(self) -> None:
        """Finish the sinks' runs (metrics.jsonl needs nothing: every line is written when logged)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl. A last line cut short (a run killed mid-write: no closing newline) is left out;
    a malformed line before it is refused naming the file and line."""
    from posttrain.errors import DataError

    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines) and not text.endswith("\n"):
                break  # the write the kill interrupted
            raise DataError(str(path), number, None, f"invalid JSON ({e.msg} at column {e.colno}); "
                            "fix or delete this line to rebuild the report") from None
    return rows


class PhaseTimer:
    """Wall time per named phase of a step: `with timer("generate"): ...`; `timer.pop()` -> {time/generate: s}."""

    def __init__(self):
        self.times: dict[str, float] = {}

    def __call__(self, name: str):
        import time
        from contextlib import contextmanager

        @contextmanager
        def span():
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

        return span()

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.times.items()}
        self.times = {}
        return out
