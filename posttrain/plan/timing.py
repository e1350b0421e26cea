"""Seconds of each phase of a step: compute-bound passes at the FLOP rate, decode at the roofline.

    compute pass   s = FLOPs run / (peak[compute dtype] × MFU)          training, reference, value, prefill
    decode step    s = max(bytes read / (bandwidth × MBU), FLOPs / (peak[weights dtype] × MFU))
                   bytes read = weights W·b_w + KV of the b sequences in flight, b·kv_token·context
                   FLOPs      = 2·N·b (one token for each sequence in flight)
    generate       = waves × new tokens × decode step (context: its mean over the completion) + prefill

"FLOPs run" is what the trainer computes, not the model FLOPs of `flops_per_step`: with a shared prefix
each group's prompt runs once ((G − 1)·P fewer tokens per group), so MFU is taken over the work done.
Without a bandwidth (peak_flops given alone) every phase is FLOPs / (peak × MFU), generation included.
"""

from __future__ import annotations

import math


def compute_seconds(flops: float, peak: float, mfu: float) -> float:
    return flops / (peak * mfu)


def decode_seconds(weight_bytes: float, kv_bytes_per_token: float, params: float, sequences: int, batch: int,
                   context: float, new_tokens: int, bandwidth: float, peak: float, mfu: float, mbu: float) -> dict:
    """Decode of `sequences` sequences, `batch` at a time, `new_tokens` each, at mean `context` tokens.
    Worked example (SmolLM2-135M fp32, 32 sequences in flight, context 56): bytes 0.54 GB + 32 × 46 KB × 56
    = 0.62 GB per step; FLOPs 2 × 134.5M × 32 = 8.6 GFLOP; at 15 GB/s × 0.5 and 0.2 TFLOP/s × 0.4 the step
    takes max(0.083, 0.108) = 0.108 s: compute-bound at this batch, memory-bound below b ≈ 24."""
    b = max(min(batch, sequences), 1)
    waves = math.ceil(sequences / b)
    step_bytes = weight_bytes + b * kv_bytes_per_token * context
    memory_s, compute_s = step_bytes / (bandwidth * mbu), 2 * params * b / (peak * mfu)
    step = max(memory_s, compute_s)
    return {"seconds": waves * new_tokens * step, "decode_steps": waves * new_tokens, "step_seconds": step,
            "bytes_per_decode_step": step_bytes, "bound": "memory" if memory_s >= compute_s else "compute"}


def phase_seconds(phases: list[dict], rates: dict, shape: dict) -> list[dict]:
    """Seconds of each planner phase (the entries of `predict()["phases"]`), given

    rates  {peak, decode_peak, bandwidth (None: FLOPs only), mfu, mbu}
    shape  {tokens_per_step, executed_tokens (the trained forward's tokens), sequences, decode_batch,
            generated_per_seq, prompt_tokens_per_seq, prefill_tokens, gen_params, gen_weight_bytes,
            gen_kv_bytes_per_token}
    -> [{phase, seconds, flops_run, bound[, decode]}]
    """
    out = []
    for p in phases:
        flops = p["flops_per_step"]
        if flops is None:
            out.append({"phase": p["phase"], "seconds": None})
            continue
        if p["phase"] == "generate" and rates.get("bandwidth") and shape.get("gen_params"):
            out.append(_generate(rates, shape, p["phase"]))
            continue
        # Training and scoring passes run over the trainer's tokens; generation without a bandwidth: all tokens.
        run = flops if p["phase"] == "generate" else flops * shape["executed_tokens"] / max(shape["tokens_per_step"], 1)
        out.append({"phase": p["phase"], "seconds": compute_seconds(run, rates["peak"], rates["mfu"]), "flops_run": run,
                    "bound": "compute"})
    return out


def _generate(rates: dict, shape: dict, name: str) -> dict:
    n, new = shape["gen_params"], shape["generated_per_seq"]
    decode = decode_seconds(shape["gen_weight_bytes"], shape["gen_kv_bytes_per_token"] or 0.0, n, shape["sequences"],
                            shape["decode_batch"], shape["prompt_tokens_per_seq"] + new / 2, new, rates["bandwidth"],
                            rates["decode_peak"], rates["mfu"], rates["mbu"])
    prefill_flops = 2 * n * shape["prefill_tokens"]
    prefill = compute_seconds(prefill_flops, rates["decode_peak"], rates["mfu"])
    return {"phase": name, "seconds": decode["seconds"] + prefill, "flops_run": 2 * n * shape["sequences"] * new + prefill_flops,
            "bound": decode["bound"], "decode": decode, "prefill_seconds": prefill}
