"""Per-step engine signals from a backend's cumulative counters (`backend.metrics()`):

    tokens_per_s         generated / (prefill s + decode s) over the window
    decode_tokens_per_s  generated / decode s
    batch_occupancy      mean running sequences / max_num_seqs over the window's decode steps
    kv_peak_frac         peak KV blocks in use during the window / KV capacity (1.0: the cache was full)
    preemptions          sequences preempted for KV blocks during the window (> 0: the cache is too small)

    window = EngineWindow()
    ... generate ...
    row.update(window.take(backend, "engine/"))     # the counters since the last take

    finish = start(backend); ... one evaluation ...; timing.update(finish("engine/"))

A backend without some counters (the HF backend has no KV cache or scheduler) reports what it has.
"""

from __future__ import annotations


def window(before: dict, after: dict) -> dict:
    """The window's signals from two snapshots of the cumulative counters (EngineStats.as_dict + kv_*)."""
    def delta(key: str) -> float | None:
        if key not in after:
            return None
        return float(after[key]) - float(before.get(key, 0.0))

    out: dict[str, float] = {}
    generated, decode_s, prefill_s = delta("generated_tokens"), delta("decode_s"), delta("prefill_s")
    if generated is not None:
        out["generated_tokens"] = generated
        busy = (decode_s or 0.0) + (prefill_s or 0.0)
        if busy > 0:  # a window without generation time has no rate (absent, not NaN: not measured)
            out["tokens_per_s"] = generated / busy
    if decode_s and prefill_s is not None and generated is not None:  # max_new_tokens=1: no decode step at all
        out["decode_tokens_per_s"] = generated / decode_s
    steps = delta("decode_steps")
    if steps is not None and "batch_occupancy" in after:  # occupancy sum = mean occupancy × decode steps
        summed = after["batch_occupancy"] * after["decode_steps"] - before.get("batch_occupancy", 0.0) * before.get("decode_steps", 0)
        if steps > 0:
            out["batch_occupancy"] = summed / steps
    if after.get("kv_capacity_mb") and "window_peak_kv_mb" in after:
        out["kv_peak_frac"] = after["window_peak_kv_mb"] / after["kv_capacity_mb"]
    preempted = delta("preemptions")
    if preempted is not None:
        out["preemptions"] = preempted
    return out


class EngineWindow:
    """Remembers a backend's counters between takes; `take` returns the signals of the window since."""

    def __init__(self) -> None:
        self.seen: dict[int, dict] = {}

    def take(self, backend, prefix: str = "engine/") -> dict:
        read = getattr(backend, "metrics", None)
        if read is None:
            return {}
        now = dict(read())
        out = window(self.seen.get(id(backend), {}), now)
        self.seen[id(backend)] = now
        reset = getattr(backend, "reset_window", None)
        if reset is not None:
            reset()
        return {prefix + k: v for k, v in out.items()}


def start(backend):
    """Begin a window on `backend` (a snapshot of its counters, the KV peak reset); -> `finish(prefix)`, which
    returns the window's signals. For one bounded piece of work: an evaluation, a batch of episodes."""
    read = getattr(backend, "metrics", None)
    if read is None:
        return lambda prefix="engine/": {}
    before = dict(read())
    reset = getattr(backend, "reset_window", None)
    if reset is not None:
        reset()
    return lambda prefix="engine/": {prefix + k: v for k, v in window(before, dict(read())).items()}
