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
import math
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from posttrain.ops.host_memory import release_freed_memory
from posttrain.outputs import write_json


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
    afterwards belongs to this run, not to whatever the process did before. The heap's free pages go back to
    the OS first (the process keeps freed memory, ops/host_memory.py): a run that reused them would not show
    them in its peak. False where unsupported."""
    release_freed_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cuda_in_use():
    """torch.cuda when this process has initialised CUDA (a run on a GPU), else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda


class Measured:
    """Accumulates what a run did: steps, tokens (all / generated), wall time per phase, peak RSS growth
    (and on CUDA the peak of torch.cuda.max_memory_allocated over what was allocated at the start)."""

    def __init__(self) -> None:
        self.peak_reset = reset_peak_rss()
        self.rss_start = rss_bytes() or peak_rss_bytes()
        cuda = cuda_in_use()
        if cuda is not None:
            cuda.reset_peak_memory_stats()
        self.cuda_start = cuda.memory_allocated() if cuda is not None else 0
        self.t0 = time.perf_counter()
        self.steps = 0
        self.tokens = 0
        self.generated_tokens = 0
        self.phase_seconds: dict[str, float] = {}
        self.step_ends: list[float] = []  # perf_counter at each add_step: the steady-state step time

    def add_step(self, tokens: int, generated_tokens: int = 0) -> None:
        """Count one optimizer step: tokens through the trained model, and how many of them were generated."""
        if tokens < 0 or generated_tokens < 0:
            raise ValueError("token counts must be ≥ 0")
        self.steps += 1
        self.step_ends.append(time.perf_counter())
        self.tokens += int(tokens)
        self.generated_tokens += int(generated_tokens)

    def add_phases(self, seconds: dict) -> None:
        """Add a step's phase timings: the `time/<phase>` keys of a row (PhaseTimer.pop()); other keys ignored."""
        for key, value in seconds.items():
            if key.startswith("time/") and isinstance(value, (int, float)) and math.isfinite(value):
                name = key[len("time/"):]
                self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + float(value)

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
            # from the second step on (model load, planning, the first step's one-time costs left out); one step: all
            "seconds_per_step": steady_step_seconds(self.step_ends) or (seconds / self.steps if self.steps else None),
            "seconds_per_step_with_setup": seconds / self.steps if self.steps else None,
            "tokens_per_second": self.tokens / seconds if seconds > 0 else None,
            "phase_seconds": dict(self.phase_seconds),
            "rss_start_bytes": self.rss_start,
            "peak_rss_bytes": peak,
            "peak_rss_growth_bytes": peak - self.rss_start,
            "peak_reset": self.peak_reset,  # False: the peak may predate this run
        }
        cuda = cuda_in_use()
        if cuda is not None:  # a GPU run: the device's allocations are the memory that can run out
            out["cuda_peak_allocated_bytes"] = cuda.max_memory_allocated()
            out["cuda_peak_growth_bytes"] = out["cuda_peak_allocated_bytes"] - self.cuda_start
            out["memory_source"] = "torch.cuda.max_memory_allocated"
        else:
            out["memory_source"] = "peak RSS (VmHWM)"
        if flops_per_token is not None and seconds > 0:
            out["flops"] = flops_per_token * self.tokens
            out["achieved_flops_per_second"] = out["flops"] / seconds
            if peak_flops:
                out["mfu"] = out["achieved_flops_per_second"] / peak_flops
        return out


def steady_step_seconds(step_ends: list[float]) -> float | None:
    """Mean seconds between consecutive step ends (steps 2..N); None with fewer than two steps."""
    if len(step_ends) < 2:
        return None
    return (step_ends[-1] - step_ends[0]) / (len(step_ends) - 1)


def write_plan(run_dir: str | Path, prediction: dict) -> Path:
    """Write `run_dir/plan.json` with the prediction and `measured: null` (filled by `write_measured`)."""
    path = Path(run_dir) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"predicted": prediction, "measured": None}, indent=2)
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
    comparison, notes = compare(pred, m)
    data["notes"] = notes
    data["comparison"] = comparison
    write_json(path, data, indent=2)
    return path


# The planner's phases and the timers that measure them: (name, timer names summed, planner phases summed).
# RL's `update` holds PPO's value training too; SFT times forward_backward and the optimizer's update apart.
PHASES = (("generate", ("generate", "sample"), ("generate",)),
          ("train", ("update", "forward_backward", "sft"), ("train", "value_train")),
          ("reference", ("reference",), ("reference",)), ("value", ("critic",), ("value",)))


def compare(pred: dict, m: dict) -> tuple[dict, list[str]]:
    """Measured over predicted: memory, tokens, seconds per step and per phase; the MFU the compute phases
    reached (FLOPs run / their measured seconds / peak). An MFU above 1 is impossible: it is not reported as
    a number but as a note naming the likely measurement error."""
    out: dict = {}
    notes: list[str] = []
    if pred.get("peak_bytes_estimate"):
        if m.get("cuda_peak_growth_bytes") is not None:
            out["peak_memory_over_predicted"] = m["cuda_peak_growth_bytes"] / pred["peak_bytes_estimate"]
        if m.get("peak_rss_growth_bytes") is not None:
            out["peak_rss_growth_over_predicted"] = m["peak_rss_growth_bytes"] / pred["peak_bytes_estimate"]
    tokens_ratio = m["tokens_per_step"] / pred["tokens_per_step"] if pred.get("tokens_per_step") and m.get("tokens_per_step") else None
    if tokens_ratio is not None:
        out["tokens_per_step_over_predicted"] = tokens_ratio
    if pred.get("seconds_per_step") and m.get("seconds_per_step"):
        out["seconds_per_step_over_predicted"] = m["seconds_per_step"] / pred["seconds_per_step"]
    steps = m.get("steps") or 0
    by_phase = {p["phase"]: p for p in pred.get("phases") or []}
    ratios, compute = {}, [0.0, 0.0]  # [FLOPs run, measured seconds] of the compute-bound phases
    for name, timers, planned in PHASES:
        seconds = sum((m.get("phase_seconds") or {}).get(t, 0.0) for t in timers)
        entries = [by_phase[p] for p in planned if p in by_phase and by_phase[p].get("seconds")]
        if not seconds or not entries or not steps:
            continue
        ratios[name] = seconds / steps / sum(e["seconds"] for e in entries)
        if all(e.get("bound") == "compute" and e.get("flops_run") for e in entries):
            compute[0] += sum(e["flops_run"] for e in entries) * steps * (tokens_ratio or 1.0)
            compute[1] += seconds
    if ratios:
        out["phase_seconds_over_predicted"] = ratios
    peak = (pred.get("hardware") or {}).get("peak_flops")
    if peak and not compute[1] and pred.get("flops_run_per_step") and m.get("seconds"):  # no phase timings: the whole step
        compute = [pred["flops_run_per_step"] * steps * (tokens_ratio or 1.0), m["seconds"]]
    if peak and compute[1] > 0 and compute[0] > 0:
        mfu = compute[0] / compute[1] / peak
        if mfu <= 1:
            out["achieved_mfu"] = mfu
        else:
            out["achieved_mfu"] = None
            notes.append(f"measurement error: the compute phases ran {compute[0]:.3g} FLOPs in {compute[1]:.3g} s, "
                         f"{mfu:.2f}x the peak of {peak:.3g} FLOP/s, and no run beats its peak (MFU > 1 is impossible). "
                         "The peak was timed low (a busy CPU when it was measured: see predicted.hardware.rates; delete "
                         f"{_rates_file()} to measure again) or a phase timer missed work")
    return out, notes


def _rates_file() -> str:
    from posttrain.plan.cpu import cache_path

    return str(cache_path())
