"""Metric sinks. JSONL always (one object per step, stable names); tensors become floats here, once."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


def to_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class MetricsWriter:
    """Appends `{"step": N, ...}` lines to metrics.jsonl. On resume, lines past `step` are dropped."""

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            keep = [l for l in self.path.read_text().splitlines() if l and json.loads(l).get("step", 0) <= resume_step]
            self.path.write_text("".join(l + "\n" for l in keep))
        elif resume_step is None:
            self.path.write_text("")

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": step, **{k: to_python(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return row


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


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
