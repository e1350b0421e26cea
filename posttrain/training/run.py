"""Run directory, seeding and the progress bar shared by the training recipes."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

from posttrain.config import save_yaml
from posttrain.errors import UserError
from posttrain.systems.dist import init_from_env

# the run directory of the run in progress in this process (the CLI names it when the run is interrupted)
CURRENT: dict[str, Path] = {}


def setup_run(cfg, resume: bool, write: bool = True) -> Path:
    """Create output_dir (when `write`: rank 0 of a sharded run); refuse to overwrite a finished run unless
    resuming (on every rank)."""
    out = Path(cfg.output_dir)
    CURRENT["run_dir"] = out
    if out.exists() and not resume and any(out.glob("checkpoints/step-*")):
        raise UserError(f"{out} already holds a run with checkpoints: pass resume=true, or choose another output_dir")
    if write:
        out.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, out / "config.yaml")
    return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def progress(total: int, initial: int, desc: str, enabled: bool = True):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled or os.environ.get("POSTTRAIN_NO_PROGRESS") == "1",
                file=sys.stderr, dynamic_ncols=True, leave=True)


def init_ranks(refusals=(), hint: str = ""):
    """torchrun's ranks (world size 1 without torchrun). Under torchrun, refuses the first of `refusals`,
    (on, what) pairs naming what a sharded run cannot do yet, that is on: "what: not supported under torchrun
    yet (world size W)", then `hint`."""
    info = init_from_env()
    if info.world > 1:
        for on, what in refusals:
            if on:
                raise UserError(f"{what}: not supported under torchrun yet (world size {info.world})"
                                + (f"; {hint}" if hint else ""))
    return info
