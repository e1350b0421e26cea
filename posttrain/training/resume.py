"""The resume contract: a resumed run continues exactly the run it resumes, or refuses before touching anything.

Every key of a recipe's config changes the run's trajectory (the samples drawn, the updates made) except the
ones in `FREE` (where output goes, how often it is saved, logged or evaluated, alarms) and `EXTENDABLE` (how
far the run goes: raised, never below the checkpoint's step). `resume=true` compares the new config with the
one the checkpoint was written under (kept in its state.json; older checkpoints: the run's config.yaml) and
refuses with the list of differences; `resume=force` takes the new values (printed) and continues. The data
file's bytes are compared the same way (a file that changed under the same name). What a checkpoint cannot
hold whatever is forced (another model, LoRA turned on, a value model it lacks) is refused when it loads
(posttrain/systems/checkpoint.py).

    diffs = differences(old_config, new_config)     # [("optim.lr", 1e-6, 1e-5), ...]
    check(cfg, checkpoint_dir)                      # UserError, or the notes of resume=force
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from posttrain.errors import UserError

# keys (a leaf name, matched at any depth, or a dotted prefix) that never change what a run computes
FREE = ("output_dir", "resume", "progress", "report_to", "device", "save_every", "keep_checkpoints", "samples_per_log",
        "samples_per_round", "sample_every", "sample_count", "sample_max_tokens", "eval_every", "eval.every",
        "eval_tasks.every", "alarms")
# keys that say how far the run goes: a resumed run may raise them (max_steps below the checkpoint is refused)
EXTENDABLE = ("max_steps", "epochs", "rounds")


def _matches(key: str, names: tuple[str, ...]) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return any(key == n or leaf == n or key.startswith(n + ".") or key.endswith("." + n) for n in names)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-6}} -> {"optim.lr": 1e-6}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + str(k)] = v
    return out


def differences(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """Trajectory keys whose value differs between two config dumps (keys one side lacks are skipped: a
    config written by another version of posttrain)."""
    a, b = flatten(old), flatten(new)
    return [(k, a[k], b[k]) for k in sorted(a.keys() & b.keys())
            if not _matches(k, FREE + EXTENDABLE) and a[k] != b[k]]


def data_digest(data: str) -> str | None:
    """sha256 of the data file's bytes (None for a built-in task, a Hub dataset, a mixture or a folder)."""
    path = Path(str(data))
    if not data or not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run_record(cfg) -> dict:
    """What a checkpoint keeps of the run that wrote it (state.json "run"): its config and its data's digest."""
    return {"config": cfg.model_dump(mode="json"), "data_sha256": data_digest(getattr(cfg, "data", ""))}


def checkpoint_step(path: Path) -> int:
    return int(path.name.split("-")[1])


def saved_record(checkpoint: Path, run_dir: Path) -> dict:
    """The run record of `checkpoint` (state.json), or for older checkpoints the run's config.yaml."""
    state = json.loads((checkpoint / "state.json").read_text()) if (checkpoint / "state.json").is_file() else {}
    if isinstance(state.get("run"), dict):
        return state["run"]
    return config_record(run_dir)


def config_record(run_dir: Path) -> dict:
    """The run record of `run_dir`'s config.yaml (no data digest): for runs whose state has none (rs rounds,
    distill's own keys around the RL run it drives, checkpoints of older versions)."""
    config = run_dir / "config.yaml"
    loaded = yaml.safe_load(config.read_text()) if config.is_file() else None
    return {"config": loaded if isinstance(loaded, dict) else {}, "data_sha256": None}


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_steps(cfg, step: int, checkpoint: Path) -> None:
    """max_steps below the checkpoint's step cannot continue that run."""
    max_steps = getattr(cfg, "max_steps", None)
    if max_steps is not None and max_steps < step:
        raise UserError(f"resume: max_steps={max_steps} is below the checkpoint's step {step} ({checkpoint}): "
                        f"give max_steps >= {step}, or start a new run in another output_dir")


def check(cfg, checkpoint: Path, run_dir: Path) -> list[str]:
    """Refuse to resume `checkpoint` with a config that changes the run (UserError listing every difference);
    with resume=force, the notes saying what was overridden."""
    given = cfg.model_fields_set
    epochs_decide = "epochs" in type(cfg).model_fields and cfg.epochs is not None and (
        "epochs" in given or "max_steps" not in given)
    if not epochs_decide:  # epochs= sets max_steps later, from the data (RunLifecycle.restore checks it then)
        check_steps(cfg, checkpoint_step(checkpoint), checkpoint)
    return check_record(cfg, saved_record(checkpoint, run_dir), run_dir, f"checkpoint {checkpoint.name}")


def check_record(cfg, saved: dict, run_dir: Path, what: str) -> list[str]:
    """`saved` ({"config", "data_sha256"}) against `cfg`: [] when equal, the notes of resume=force, else UserError."""
    new = run_record(cfg)
    diffs = differences(saved.get("config") or {}, new["config"])
    if saved.get("data_sha256") and saved["data_sha256"] == new["data_sha256"]:  # the same file by another path
        diffs = [d for d in diffs if d[0] != "data"]
    if saved.get("data_sha256") and new["data_sha256"] and saved["data_sha256"] != new["data_sha256"]:
        diffs.append((f"data (the contents of {cfg.data})", f"sha256 {saved['data_sha256'][:12]}",
                      f"sha256 {new['data_sha256'][:12]}"))
    if not diffs:
        return []
    listed = "; ".join(f"{k}: {_shown(a)} -> {_shown(b)}" for k, a, b in diffs)
    if cfg.resume != "force":
        raise UserError(f"resume=true would change the run in {run_dir} ({what}): {listed}. Resume with the run's "
                        "values (its config.yaml), pass resume=force to continue with the new ones, or start a new "
                        "run in another output_dir")
    return [f"resume=force: continuing {run_dir} ({what}) with {listed}"]
