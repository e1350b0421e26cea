"""Activation memory measured on the model itself, for the planner's peak-memory prediction.

The planner's closed form for activations (plan.cost.activation_bytes) counts the values a llama decoder
saves for backward. What a real step holds differs by precision and by what is trained: under bf16
autocast the norms and the residual stream stay fp32 while every linear saves a bf16 copy of its input;
under LoRA a frozen linear saves no input at all but each use of a frozen weight saves its own bf16 cast
(autocast caches casts only of weights that require grad; where bf16 matmuls run as fp32 GEMMs, ops.linear,
each use of a trained weight saves its own float32 widening); backward adds the gradients of a layer's
activations on top. Rather than a table per case, a recipe that holds its model measures it:

    bytes(T) = fixed + per_token · T        (T = tokens in one forward/backward)

from two small forward/backward passes of the recipe's own loss path (T₁ < T₂ tokens), each the peak of
CPU bytes allocated above the start (torch profiler memory events), with the parameter gradients
allocated beforehand (the planner counts those as model state). `fixed` is what does not grow with T (weight
casts, the head's tiles); `per_token` the slope. Cost: two passes of a few hundred tokens (~1 s for a
135M model on 2 cores). CPU only (on CUDA the caching allocator's statistics would be the tool; the
probe is skipped there, as under FSDP, and the closed form is used).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import torch

from posttrain.ops.host_memory import release_freed_memory
from posttrain.ops.linear import forget_casts, route_any_rows


def peak_allocated(fn: Callable[[], None]) -> int:
    """Peak CPU bytes allocated by `fn()` above what was allocated when it started."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto prints profiler_start/stop lines to stderr otherwise
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # every allocation and free is a "[memory]" record with signed bytes; their running sum is what is allocated
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, delta in deltas:
        running += delta
        peak = max(peak, running)
    return peak


def pass_bytes(model: torch.nn.Module, step: Callable[[], torch.Tensor]) -> int:
    """Activation bytes of one forward/backward: `step()` returns the loss. Gradients are allocated before
    the pass (the planner counts them as model state, and backward then accumulates in place) and dropped
    afterwards (set to None), so the run starts exactly as before."""
    fresh = [p for p in model.parameters() if p.requires_grad and p.grad is None]
    for p in fresh:
        p.grad = torch.zeros_like(p)
    forget_casts()
    try:
        return peak_allocated(lambda: step().backward())
    finally:
        forget_casts()
        for p in fresh:
            p.grad = None


def activation_fit(model: torch.nn.Module, make_step: Callable[[int], tuple[int, Callable[[], torch.Tensor]]],
                   sizes: tuple[int, int] = (96, 288)) -> dict | None:
    """{'fixed': bytes, 'per_token': bytes} from two passes; `make_step(n)` -> (tokens T of the pass,
    step). None when the probe does not apply (a model off the CPU) or measures nothing sensible."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return None
    (t1, s1), (t2, s2) = make_step(sizes[0]), make_step(sizes[1])
    with route_any_rows():  # both passes take the matmul path of a full-size step (ops.linear.MIN_ROWS)
        b1, b2 = pass_bytes(model, s1), pass_bytes(model, s2)
    gc.collect()  # the profiler's event records sit in reference cycles
    release_freed_memory()  # the probe's blocks would otherwise stay in the heap beside the run's own
    if t2 <= t1 or b2 <= b1:
        return None
    per_token = (b2 - b1) / (t2 - t1)
    return {"fixed": max(b1 - per_token * t1, 0.0), "per_token": per_token, "probe_tokens": [t1, t2]}
