"""What a run measured, written next to what the planner predicted: `output_dir/plan.json`.

    {"predicted": {... predict() ...}, "measured": {... Measured.as_dict() ..., or null while running},
     "comparison": {"peak_rss_growth_over_predicted": ..., "tokens_per_step_over_predicted": ...}}

How a recipe uses it (pass micro_batch= when it accumulates gradients over several forward passes):

    from posttrain.plan import predict
    from posttrain.plan.measure import Measured, write_measured, write_plan

    measured = Measured()                 # before the model is loaded: RSS baseline, peak reset
    prediction = predict(cfg.model, "sft", batch=cfg.batch_size, seq_len=cfg.max_len, dtype="fp32")
    write_plan(cfg.output_dir, prediction)
    model = load_model(cfg.model)
    for step in range(cfg.max_steps):
        with measured.phase("update"):
            ...                               # forward, backward, optimizer step
        measured.add_step(tokens=int(batch["loss_mask"].numel()), generated_tokens=0)
    write_measured(cfg.output_dir, measured, flops_per_token=prediction["flops_per_token"])

Predicted peak for a small CPU run (`prediction["peak_bytes_estimate"]`, dtype="fp32"): model states
16 B per trained parameter (weights 4 + grads 4 + Adam m, v 8) and 4 B per frozen one, plus the largest
transient: activations of one forward/backward (see `cost.activation_bytes`: 4 × tokens ×
[L·(8h + 4i + 2·kv_dim) + 3h + 3V] for the HF loss, plus the embedding's dense V×h gradient), the rollout
KV cache, or AdamW's 4 B/param sqrt(v) buffer. Compare it with `peak_rss_growth_bytes` = peak RSS − RSS when `Measured()` was created. The prediction
counts live tensors; glibc keeps some freed blocks (those under its 32 MiB mmap threshold) resident, so
measured/predicted ran 0.92–1.2 on CPU runs of 15M–135M parameters and up to 1.4 where a V×h matrix is
just under 32 MiB. Below ~0.3 GB predicted (tiny-random: 25 MB) allocator noise (±35 MB) dominates:
compare tokens and FLOPs there, not memory. docs/planner.md has the measurements.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def _status_bytes(field: str) -> int | None:
    """A `VmRSS`/`VmHWM` line of /proc/self/status in bytes (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Resident memory now (Linux VmRSS); None where /proc is missing."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: VmHWM, else `getrusage` ru_maxrss (kB on Linux, bytes on macOS)."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: write 5 to /proc/self/clear_refs), so a peak measured
    afterwards belongs to this run, not to whatever the process did before. False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Measured:
    """Accumulates what a run did: steps, tokens (all / generated), wall time per phase, peak RSS growth."""

    def __init__(self) -> None:
        self.peak_reset = reset_peak_rss()
        self.rss_start = rss_bytes() or peak_rss_bytes()
        self.t0 = time.perf_counter()
        self.steps = 0
        self.tokens = 0
        self.generated_tokens = 0
        self.phase_seconds: dict[str, float] = {}

    def add_step(self, tokens: int, generated_tokens: int = 0) -> None:
        """Count one optimizer step: tokens through the trained model, and how many of them were generated."""
        if tokens < 0 or generated_tokens < 0:
            raise ValueError("token counts must be ≥ 0")
        self.steps += 1
        self.tokens += int(tokens)
        self.generated_tokens += int(generated_tokens)

    @contextmanager
    def phase(self, name: str):
        """Time a named phase (generate / reward / reference / update); seconds add up across steps."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.perf_counter() - start

    def as_dict(self, flops_per_token: float | None = None, peak_flops: float | None = None) -> dict:
        """Totals; with the predicted FLOPs per token, achieved FLOP/s (and MFU against `peak_flops`)."""
        seconds = time.perf_counter() - self.t0
        peak = peak_rss_bytes()
        out = {
            "steps": self.steps,
            "tokens": self.tokens,
            "generated_tokens": self.generated_tokens,
            "tokens_per_step": self.tokens / self.steps if self.steps else None,
            "seconds": seconds,
            "seconds_per_step": seconds / self.steps if self.steps else None,
            "tokens_per_second": self.tokens / seconds if seconds > 0 else None,
            "phase_seconds": dict(self.phase_seconds),
            "rss_start_bytes": self.rss_start,
            "peak_rss_bytes": peak,
            "peak_rss_growth_bytes": peak - self.rss_start,
            "peak_reset": self.peak_reset,  # False: the peak may predate this run
        }
        if flops_per_token is not None and seconds > 0:
            out["flops"] = flops_per_token * self.tokens
            out["achieved_flops_per_second"] = out["flops"] / seconds
            if peak_flops:
                out["mfu"] = out["achieved_flops_per_second"] / peak_flops
        return out


def write_plan(run_dir: str | Path, prediction: dict) -> Path:
    """Write `run_dir/plan.json` with the prediction and `measured: null` (filled by `write_measured`)."""
    path = Path(run_dir) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"predicted": prediction, "measured": None}, indent=2))
    return path


def write_measured(run_dir: str | Path, measured: Measured | dict, flops_per_token: float | None = None,
                   peak_flops: float | None = None) -> Path:
    """Fill `measured` in `run_dir/plan.json` and add predicted-vs-measured ratios."""
    path = Path(run_dir) / "plan.json"
    data = json.loads(path.read_text()) if path.is_file() else {"predicted": None}
    pred = data.get("predicted") or {}
    flops_per_token = flops_per_token if flops_per_token is not None else pred.get("flops_per_token")
    m = measured.as_dict(flops_per_token, peak_flops) if isinstance(measured, Measured) else dict(measured)
    data["measured"] = m
    comparison = {}
    if pred.get("peak_bytes_estimate") and m.get("peak_rss_growth_bytes") is not None:
        comparison["peak_rss_growth_over_predicted"] = m["peak_rss_growth_bytes"] / pred["peak_bytes_estimate"]
    if pred.get("tokens_per_step") and m.get("tokens_per_step"):
        comparison["tokens_per_step_over_predicted"] = m["tokens_per_step"] / pred["tokens_per_step"]
    if pred.get("seconds_per_step") and m.get("seconds_per_step"):
        comparison["seconds_per_step_over_predicted"] = m["seconds_per_step"] / pred["seconds_per_step"]
    peak = (pred.get("hardware") or {}).get("peak_flops")
    if peak and m.get("achieved_flops_per_second"):  # the MFU the run reached, against the planner's assumption
        comparison["achieved_mfu"] = m["achieved_flops_per_second"] / peak
    data["comparison"] = comparison
    path.write_text(json.dumps(data, indent=2))
    return path
