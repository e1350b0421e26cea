"""From per-sample outcomes to per-item values, benchmark metrics with intervals, and results.json.

Intervals (all at `confidence`): pass@1 uses the Wilson interval at the effective sample size of
clustered samples (`stats.clustered_wilson`); pass@k for k > 1, pass^k, cons@k and mean@n use the
percentile bootstrap over items (`stats.bootstrap_interval`, seeded), except when every item has
the same value 0 or 1 (nothing to resample): then Wilson's interval over the items. Problems the backend refused
count as failures (every value 0) and are listed under `counts.refused`.
"""

from __future__ import annotations

from posttrain.eval import metrics as M
from posttrain.eval import stats
from posttrain.eval.runner import ItemResult


def item_values(r: ItemResult, n: int, ks: list[int], cons: bool, max_subsets: int = 1000, seed: int = 0) -> dict:
    """{"c", "n", "pass@k", "pass^k", "cons@k" (when `cons`), "mean@n"} of one problem; a problem the
    backend refused has every value 0."""
    refused = bool(r.error) or not r.samples
    m, c = (n, 0) if refused else (len(r.samples), sum(r.correct))
    out: dict = {"c": c, "n": m}
    for k in ks:
        out[f"pass@{k}"] = 0.0 if refused else M.pass_at_k(m, c, k)
    for k in ks:
        out[f"pass^{k}"] = 0.0 if refused else M.pass_hat_k(m, c, k)
    if cons:
        for k in ks:
            out[f"cons@{k}"] = 0.0 if refused else M.cons_at_k(r.classes, r.correct, k, max_subsets, seed)
    out["mean@n"] = 0.0 if refused else M.mean_at_n([s.score for s in r.samples])
    return out


def unscored(results: list[ItemResult]) -> str | None:
    """Why no sample has a reward at all (every prompt refused, the reward failed or gave None on every sample), or
    None when at least one was scored: then the metrics mean something."""
    if any(s.score is not None for r in results for s in r.samples):
        return None
    refused = [r.error for r in results if r.error]
    if len(refused) == len(results):
        return f"the backend refused all {len(results)} prompts (first: {refused[0]})"
    errors = [s.error for r in results for s in r.samples if s.error]
    if errors:
        return f"the reward failed on every sample ({len(errors)} errors; first: {errors[0]})"
    return "the reward returned None (no value) for every sample"


def metric_names(values: list[dict]) -> list[str]:
    return [k for k in values[0] if k not in ("c", "n")]


def summarize(values: list[dict], n: int, confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> dict:
    """{metric: {value, low, high, interval}} over the items' values."""
    out = {}
    for name in metric_names(values):
        xs = [v[name] for v in values]
        if name == "pass@1":
            mean, low, high = stats.clustered_wilson(xs, n, confidence)
            n_eff = stats.effective_size(xs, n)
            method = f"wilson, effective n = {n_eff:.1f} of {len(xs) * n} samples"
        elif name.startswith(("bon@", "maj@")):  # the kept answer's verdict, 0/1 per problem: a proportion over problems
            mean = sum(xs) / len(xs)
            low, high = stats.wilson_interval(sum(xs), len(xs), confidence)
            method = f"wilson over {len(xs)} problems (one kept answer each)"
        elif len(set(xs)) == 1 and xs[0] in (0.0, 1.0):  # no spread for the bootstrap to resample
            mean = xs[0]
            low, high = stats.wilson_interval(mean * len(xs), len(xs), confidence)
            method = f"wilson over {len(xs)} items (every item {mean:g}: the bootstrap has no spread)"
        else:
            mean, low, high = stats.bootstrap_interval(xs, confidence, resamples, seed)
            method = f"percentile bootstrap over {len(xs)} items, {resamples} resamples"
        out[name] = {"value": mean, "low": low, "high": high, "interval": method}
    return out


def curve(summary: dict, ks: list[int]) -> list[dict]:
    """[{k, "pass@k": {value, low, high}, "cons@k": …, "pass^k": …}] for the report's plot."""
    rows = []
    for k in ks:
        row: dict = {"k": k}
        for family, sep in (("pass", "@"), ("cons", "@"), ("pass", "^")):
            if f"{family}{sep}{k}" in summary:
                row[f"{family}{sep}k"] = summary[f"{family}{sep}{k}"]
        rows.append(row)
    return rows


def item_record(r: ItemResult, values: dict, save_samples: bool) -> dict:
    prompt = r.item.data["prompt"]
    question = prompt if isinstance(prompt, str) else next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
    rec = {"index": r.item.index, "id": r.item.id, "question": question, "prompt": r.item.prompt_text,
           "answer": r.item.data.get("answer"), **values}
    if r.error:
        rec["error"] = r.error
    if r.classes is not None:
        rec["answers"] = [s.answer for s in r.samples]
        rec["classes"] = r.classes
    rec["correct"] = [int(s.correct) for s in r.samples]
    rec["scores"] = [s.score for s in r.samples]
    errors = [s.error for s in r.samples if s.error]
    if errors:
        rec["reward_errors"] = errors
    if save_samples:
        rec["samples"] = [{"text": s.text, "tokens": s.tokens, "finish_reason": s.finish_reason} for s in r.samples]
    return rec


def print_metrics(doc: dict) -> None:
    """One line per metric: value [low, high] at the results' confidence (and the interval's method)."""
    pct = round(100 * doc["confidence"])
    for name, m in doc["metrics"].items():
        how = f"  ({m['interval']})" if "interval" in m else ""
        print(f"  {name:10s} {m['value']:.4f}  [{m['low']:.4f}, {m['high']:.4f}] {pct}%{how}")
