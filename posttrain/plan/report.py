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


def _g(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _savers(p: dict) -> str:
    """LoRA (rank, targets, adapter size) and gradient checkpointing, as the plan used them."""
    parts = []
    lo = p.get("lora")
    if lo:
        targets = lo["targets"] if isinstance(lo["targets"], str) else ",".join(lo["targets"])
        names = f" ({','.join(lo['target_names'])})" if lo.get("target_names") and isinstance(lo["targets"], str) else ""
        size = "size unknown" if lo["params"] is None else f"{human_count(lo['params'])} trainable" + (
            f" = {100 * lo['fraction_of_base']:.2f}% of the base" if lo.get("fraction_of_base") is not None else "")
        parts.append(f"LoRA r={lo['r']} on {targets}{names}: {size}")
    if p.get("gradient_checkpointing"):
        parts.append("gradient checkpointing (layer inputs kept, one layer recomputed; +2 FLOPs/param/token)")
    return "; ".join(parts) or "none (full fine-tuning, activations kept)"


def render(p: dict) -> str:
    """Sections: model, models in memory, per-step tokens and FLOPs, time, method extras, then notes."""
    rows = [*_model_rows(p), ("", ""), *_memory_rows(p), ("", ""), *_compute_rows(p), *_extra_rows(p), *_note_rows(p)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" if k or v else "" for k, v in rows)


def _model_rows(p: dict) -> list[tuple[str, str]]:
    opts, active = p["options"], p.get("active_params")
    moe = f" ({human_count(active)} active per token)" if active is not None and active != p["params"] else ""
    shown = {"β": opts["beta"], "reward": opts["reward"], "value model": opts["value_model"] or None,
             "precomputed reference": opts["precompute_ref"], "distill": opts["distill"]}
    return [("model", f"{p['model']['name']} ({p['model']['source']}), {human_count(p['params'])} params{moe}"),
            ("method", "  ".join([p["method"], *(f"{k}={v}" for k, v in shown.items() if v is not None)])),
            ("memory savers", _savers(p))]


def _memory_rows(p: dict) -> list[tuple[str, str]]:
    rows = []
    for m in p["models"]:
        state = "train" if m["trainable"] else "frozen"
        size = "shared with the policy (adapter disabled)" if m.get("shared_with") else human_bytes(m["bytes"])
        rows.append((f"  {m['role']}", f"{human_count(m['params'])} params, {state}: {size}"))
    rows.append(("models in memory", f"{p['models_in_memory']}, model states {human_bytes(p['memory_bytes_total'])}"))
    arch = p["model"]["architecture"] or {}
    sliding = f" ({arch['sliding_layers']} of {arch['num_hidden_layers']} layers keep at most {arch['sliding_window']:,} tokens)" \
        if arch.get("sliding_layers") else ""
    rows.append(("KV per token", human_bytes(p["kv_bytes_per_token"]) + sliding))
    if p["kv_bytes_step"] is not None:
        rows.append(("KV for the step", f"{human_bytes(p['kv_bytes_step'])} (all {p['sequences_per_step']:,} sequences in flight)"))
    ckpt = "gradient checkpointing" if p.get("gradient_checkpointing") else "no checkpointing"
    source = ", measured on the model" if p.get("activation_source") == "measured" else ""
    rows.append(("activations", f"{human_bytes(p['activation_bytes'])} (micro-batch of {p['micro_batch']:,} sequences, {ckpt}{source})"))
    rows.append(("peak estimate", human_bytes(p["peak_bytes_estimate"])))
    return rows


def _compute_rows(p: dict) -> list[tuple[str, str]]:
    active = p.get("active_params")
    n = "N" if active is None or active == p["params"] else "N_active"
    rows = [("sequences / step", f"{p['sequences_per_step']:,} (group {p['group']})"),
            ("tokens / step", f"{human_count(p['tokens_per_step'])} ({human_count(p['generated_tokens_per_step'])} generated)"),
            ("FLOPs / token", f"{_g(p['flops_per_token'])} = {_g(p['flops_per_token_over_params'])}{n}")]
    for ph in p["phases"]:
        rows.append((f"  {ph['phase']}", f"{_g(ph['flops_per_step'])} FLOPs on the {ph['role']} "
                     f"({ph['flops_per_param']:.3g}/param/token)"))
    rows.append(("FLOPs / step", _g(p["flops_per_step"])))
    hw = p["hardware"]
    if hw and hw["peak_flops"]:
        rows.append(("hardware", f"{hw['name'] or 'custom'}: {hw['peak_flops']:.3g} FLOP/s × MFU {hw['mfu']} × {hw['devices']} device(s)"))
    rows.append(("time / step", human_seconds(p["seconds_per_step"])))
    if p.get("devices_for_memory") is not None:
        rows.append(("devices for states", f"{p['devices_for_memory']} × {human_bytes(hw['device_memory'])}"))
    if p["run"]:
        run = p["run"]
        rows.append(("run", f"{human_count(run['tokens'])} tokens, {run['steps']:,.1f} steps, {_g(run['flops'])} FLOPs"))
        if "gpu_hours" in run:
            rows.append(("run time", f"{human_seconds(run['seconds'])} wall, {run['gpu_hours']:,.1f} device-hours"))
    return rows


def _extra_rows(p: dict) -> list[tuple[str, str]]:
    """Agent trajectories, distillation's teacher logits and cache, the BoN bound, an eval interval."""
    rows = []
    if "agent" in p:
        a = p["agent"]
        rows.append(("agent context", f"{a['context_tokens']:,} tokens per trajectory, {a['generated_tokens']:,} generated "
                     f"({100 * a['generated_share']:.1f}%)"))
        rows.append(("cost / useful token", f"{a['cost_per_useful_token']:.2f}× single-turn; prefill {a['prefill_tokens_no_cache']:,} "
                     f"without prefix cache vs {a['prefill_tokens_prefix_cache']:,} with"))
    if "distill" in p:
        d = p["distill"]
        rows.append(("teacher logits", f"full vocabulary {human_bytes(d['logit_bytes_per_token_full'])}/token, "
                     f"top-{d['top_k']} {human_bytes(d['logit_bytes_per_token_topk'])}/token"))
        if "cache_bytes_per_token" in d:
            size = f"; {human_bytes(d['cache_bytes'])} for {human_count(d['cache_tokens'])} tokens, teacher forward " \
                   f"{_g(d['teacher_flops_once'])} FLOPs once" if "cache_bytes" in d else ""
            rows.append(("teacher cache", f"top-{d['top_k']} + tail {human_bytes(d['cache_bytes_per_token'])}/token{size}"))
    if "bon_kl_nats" in p:
        rows.append(("BoN KL bound", f"log N − (N−1)/N = {p['bon_kl_nats']:.2f} nats at N = {p['group']}"))
    if "eval" in p:
        e = p["eval"]
        rows.append(("eval 95% CI", f"±{100 * e['ci95_half_width']:.2f} points at p = {e['p']}, n = {e['n']:,}"))
    return rows


def _note_rows(p: dict) -> list[tuple[str, str]]:
    """How the plan counted where not exactly (notes), and what it could not predict, with why."""
    notes = [("notes" if i == 0 else "", f"- {n}") for i, n in enumerate(p.get("notes") or [])]
    missing = [(k, why) for k, why in (p.get("unknown") or {}).items() if k != "seconds_per_step"]  # the time line says it
    unknown = [("not predicted" if i == 0 else "", f"{k}: {why}") for i, (k, why) in enumerate(missing)]
    return [*([("", "")] if notes or unknown else []), *notes, *unknown]
