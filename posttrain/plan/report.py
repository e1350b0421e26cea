"""The human-readable table of a plan (`posttrain plan` without --json)."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    """Decimal GB for model states (the seeds' 288 GB), binary units in brackets (KV sizes are KiB/TiB)."""
    if n is None:
        return "—"
    if n < 1024:
        return f"{n:,.0f} B"
    dec = next((f"{n / 10**e:,.2f} {u}" for e, u in ((15, "PB"), (12, "TB"), (9, "GB"), (6, "MB"), (3, "kB")) if n >= 10**e), "")
    binary = next(f"{n / 2**e:,.2f} {u}" for e, u in ((50, "PiB"), (40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")) if n >= 2**e)
    return f"{dec} ({binary})"


def human_count(n: float | None, unit: str = "") -> str:
    if n is None:
        return "—"
    for e, s in ((12, "T"), (9, "B"), (6, "M"), (3, "K")):
        if abs(n) >= 10**e:
            return f"{n / 10**e:,.2f}{s}{unit}"
    return f"{n:,.0f}{unit}" if float(n).is_integer() else f"{n:.3g}{unit}"


def human_seconds(s: float | None) -> str:
    if s is None:
        return "— (give hardware=h100 or peak_flops=...)"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:,.1f} h"


def render(p: dict) -> str:
    """Sections: model, models in memory, per-step tokens and FLOPs, time, then method extras."""
    rows: list[tuple[str, str]] = []
    add = rows.append
    opts = p["options"]
    add(("model", f"{p['model']['name']} ({p['model']['source']}), {human_count(p['params'])} params"))
    shown = {"β": opts["beta"], "reward": opts["reward"], "value model": opts["value_model"] or None,
             "precomputed reference": opts["precompute_ref"], "distill": opts["distill"]}
    add(("method", "  ".join([p["method"], *(f"{k}={v}" for k, v in shown.items() if v is not None)])))
    if p["lora"]:
        lo = p["lora"]
        add(("LoRA", f"r={lo['r']} on {','.join(lo['targets'])}: {human_count(lo['params'])} trainable "
             f"= {100 * lo['fraction_of_base']:.2f}% of the base"))
    add(("", ""))
    for m in p["models"]:
        state = "train" if m["trainable"] else "frozen"
        size = "shared with the policy (adapter disabled)" if m.get("shared_with") else human_bytes(m["bytes"])
        add((f"  {m['role']}", f"{human_count(m['params'])} params, {state}: {size}"))
    add(("models in memory", f"{p['models_in_memory']}, model states {human_bytes(p['memory_bytes_total'])}"))
    add(("KV per token", human_bytes(p["kv_bytes_per_token"])))
    if p["kv_bytes_step"] is not None:
        add(("KV for the step", f"{human_bytes(p['kv_bytes_step'])} (all {p['sequences_per_step']:,} sequences in flight)"))
    add(("activations", f"{human_bytes(p['activation_bytes'])} (micro-batch of {p['micro_batch']:,} sequences, no checkpointing)"))
    add(("peak estimate", human_bytes(p["peak_bytes_estimate"])))
    add(("", ""))
    add(("sequences / step", f"{p['sequences_per_step']:,} (group {p['group']})"))
    add(("tokens / step", f"{human_count(p['tokens_per_step'])} ({human_count(p['generated_tokens_per_step'])} generated)"))
    add(("FLOPs / token", f"{p['flops_per_token']:.3g} = {p['flops_per_token_over_params']:.3g}N"))
    for ph in p["phases"]:
        add((f"  {ph['phase']}", f"{ph['flops_per_step']:.3g} FLOPs on the {ph['role']}"))
    add(("FLOPs / step", f"{p['flops_per_step']:.3g}"))
    hw = p["hardware"]
    if hw and hw["peak_flops"]:
        add(("hardware", f"{hw['name'] or 'custom'}: {hw['peak_flops']:.3g} FLOP/s × MFU {hw['mfu']} × {hw['devices']} device(s)"))
    add(("time / step", human_seconds(p["seconds_per_step"])))
    if p.get("devices_for_memory") is not None:
        add(("devices for states", f"{p['devices_for_memory']} × {human_bytes(hw['device_memory'])}"))
    if p["run"]:
        run = p["run"]
        add(("run", f"{human_count(run['tokens'])} tokens, {run['steps']:,.1f} steps, {run['flops']:.3g} FLOPs"))
        if "gpu_hours" in run:
            add(("run time", f"{human_seconds(run['seconds'])} wall, {run['gpu_hours']:,.1f} device-hours"))
    if "agent" in p:
        a = p["agent"]
        add(("agent context", f"{a['context_tokens']:,} tokens per trajectory, {a['generated_tokens']:,} generated "
             f"({100 * a['generated_share']:.1f}%)"))
        add(("cost / useful token", f"{a['cost_per_useful_token']:.2f}× single-turn; prefill {a['prefill_tokens_no_cache']:,} "
             f"without prefix cache vs {a['prefill_tokens_prefix_cache']:,} with"))
    if "distill" in p:
        d = p["distill"]
        add(("teacher logits", f"full vocabulary {human_bytes(d['logit_bytes_per_token_full'])}/token, "
             f"top-{d['top_k']} {human_bytes(d['logit_bytes_per_token_topk'])}/token"))
        if "cache_bytes_per_token" in d:
            size = f"; {human_bytes(d['cache_bytes'])} for {human_count(d['cache_tokens'])} tokens, teacher forward " \
                   f"{d['teacher_flops_once']:.3g} FLOPs once" if "cache_bytes" in d else ""
            add(("teacher cache", f"top-{d['top_k']} + tail {human_bytes(d['cache_bytes_per_token'])}/token{size}"))
    if "bon_kl_nats" in p:
        add(("BoN KL bound", f"log N − (N−1)/N = {p['bon_kl_nats']:.2f} nats at N = {p['group']}"))
    if "eval" in p:
        e = p["eval"]
        add(("eval 95% CI", f"±{100 * e['ci95_half_width']:.2f} points at p = {e['p']}, n = {e['n']:,}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" if k or v else "" for k, v in rows)
