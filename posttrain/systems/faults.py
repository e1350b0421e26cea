"""Fault injection for the restart tests: `POSTTRAIN_FAIL_AT=RANK:STEP` makes that rank of a torchrun run
exit abruptly (no cleanup, like a lost node) once it has finished optimizer step STEP, once per run
directory (a marker file remembers it), so that the restarted ranks resume from the last checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

EXIT_CODE = 17


def maybe_fail(rank: int, done: int, run_dir: Path) -> None:
    spec = os.environ.get("POSTTRAIN_FAIL_AT", "")
    if not spec:
        return
    want_rank, want_step = (int(x) for x in spec.split(":"))
    marker = Path(run_dir) / f".failed-rank{want_rank}-step{want_step}"
    if rank == want_rank and done == want_step and not marker.exists():
        marker.write_text("")
        print(f"POSTTRAIN_FAIL_AT: rank {rank} exits after step {done}", flush=True)
        os._exit(EXIT_CODE)
