"""Metric sinks beside metrics.jsonl: `report_to=tensorboard|wandb|trackio|mlflow` (a comma list is allowed).

metrics.jsonl is always written (monitor/metrics.py::MetricsWriter); every recipe (sft, rl, rs, dpo, rm, and
the eval hook whose metrics ride in the training rows) writes its rows through that one writer, which hands
each row's numeric values to the sinks opened here. Nothing else in the code base talks to a tracker.

Each sink is a small class behind a registry (`SINKS`), opened with the run directory, the run's config
(logged as hyper-parameters) and `resume_step` (None on a fresh run), and offline where its library allows:

    tensorboard  <run_dir>/tensorboard/ event files; on resume, events past the checkpoint are purged
    wandb        WANDB_MODE (default offline, files under <run_dir>/wandb/); run id kept in <run_dir>/wandb_run_id
    trackio      local store, TRACKIO_DIR (default <run_dir>/trackio when trackio is first imported here)
    mlflow       MLFLOW_TRACKING_URI (default a SQLite store, <run_dir>/mlflow.db); run id kept in <run_dir>/mlflow_run_id

A missing library is reported when the config is parsed (before any model loads), naming the extra to install:
the `report_to` key's names and checks (`ReportTo`, `SINK_REQUIREMENTS`) are in posttrain/config.py, where every
recipe config gets the key.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol


def sink_names(report_to: str) -> list[str]:
    return [] if report_to in ("", "none") else report_to.split(",")


class Sink(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass
class SinkContext:
    run_dir: Path
    config: dict  # the run's config (model_dump(mode="json")), logged as hyper-parameters
    resume_step: int | None  # None: a fresh run; N: rows up to step N are already logged

    @property
    def name(self) -> str:
        return self.run_dir.resolve().name

    def run_id(self, file: str, new: Callable[[], str]) -> str:
        """The tracker's run id kept in <run_dir>/<file>: reused on resume, made anew on a fresh run."""
        path = self.run_dir / file
        if self.resume_step is not None and path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        run_id = new()
        path.write_text(run_id + "\n")
        return run_id


SINKS: dict[str, Callable[[SinkContext], Sink]] = {}


def register(name: str):
    def deco(cls):
        SINKS[name] = cls
        return cls

    return deco


def open_sinks(report_to: str, run_dir: str | Path, config: dict, resume_step: int | None) -> list[Sink]:
    ctx = SinkContext(Path(run_dir), config, resume_step)
    return [SINKS[name](ctx) for name in sink_names(report_to)]


def flat_config(config: dict, prefix: str = "") -> dict[str, str]:
    """{'optim': {'lr': 1e-5}} -> {'optim.lr': '1e-05'}: hyper-parameters for trackers that take flat strings."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, str) else json.dumps(v)
    return out


@register("tensorboard")
class TensorBoardSink:
    """Event files under <run_dir>/tensorboard (`tensorboard --logdir <run_dir>`). One scalar per metric name."""

    def __init__(self, ctx: SinkContext):
        from torch.utils.tensorboard import SummaryWriter

        logdir = ctx.run_dir / "tensorboard"
        if ctx.resume_step is None:  # a fresh run replaces an earlier one, as metrics.jsonl does
            for old in logdir.glob("events.out.tfevents.*"):
                old.unlink()
        # purge_step: TensorBoard hides events at steps >= purge_step written before this restart
        purge = None if ctx.resume_step is None else ctx.resume_step + 1
        self.writer = SummaryWriter(str(logdir), purge_step=purge)
        if ctx.resume_step is None:
            self.writer.add_text("config", "```\n" + json.dumps(ctx.config, indent=1) + "\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crashed run keeps every step it logged

    def close(self) -> None:
        self.writer.close()


@register("wandb")
class WandbSink:
    """Weights & Biases, offline unless WANDB_MODE says otherwise (`wandb sync <run_dir>/wandb/offline-run-*`)."""

    def __init__(self, ctx: SinkContext):
        import wandb

        run_id = ctx.run_id("wandb_run_id", lambda: secrets.token_hex(4))
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "posttrain"), name=ctx.name, id=run_id,
                              resume="allow", dir=str(ctx.run_dir), config=ctx.config,
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


@register("trackio")
class TrackioSink:
    """Trackio's local store (`trackio show`). TRACKIO_DIR is read when trackio is imported: unless set, the first
    run of a process to import it here points it at <run_dir>/trackio."""

    def __init__(self, ctx: SinkContext):
        if "trackio" not in sys.modules and "TRACKIO_DIR" not in os.environ:
            os.environ["TRACKIO_DIR"] = str((ctx.run_dir / "trackio").resolve())
        import trackio

        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "posttrain"), name=ctx.name, config=ctx.config,
                                resume="never" if ctx.resume_step is None else "allow", embed=False)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. :/]")  # the characters MLflow accepts in a metric or param name


def mlflow_key(name: str) -> str:
    """'eval/pass@1' -> 'eval/pass_at_1': MLflow refuses '@' and other characters in names."""
    return MLFLOW_KEY.sub("_", name.replace("@", "_at_"))


@register("mlflow")
class MlflowSink:
    """MLflow through its client (no global active run): MLFLOW_TRACKING_URI, else a SQLite store in the run
    directory (`mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`; MLflow 3 refuses new ./mlruns file
    stores). Experiment: MLFLOW_EXPERIMENT_NAME, else 'posttrain'."""

    def __init__(self, ctx: SinkContext):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(ctx.run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "posttrain")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        fresh = []

        def new_run() -> str:
            fresh.append(True)
            return self.client.create_run(exp_id, run_name=ctx.name).info.run_id

        self.run_id = ctx.run_id("mlflow_run_id", new_run)
        if fresh:
            params = [Param(mlflow_key(k), str(v)[:6000]) for k, v in flat_config(ctx.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
