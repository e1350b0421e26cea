"""`posttrain eval compare A B curve=true`: did RL sharpen or expand? pass@k of both runs at every k from 1 to
the smallest n, each problem's value the unbiased estimator 1 − C(n−c, k)/C(n, k) from its own n and c (so every
k ≤ n is available, not only the `k=` of the evaluation), with the paired bootstrap interval of B − A over
problems at each k (stats.paired_bootstrap, the same resamples at every k).

Verdict (K = the largest common k; d_k, [l_k, h_k] = B − A at k and its interval):
- expanding   l_1 > 0 and l_K > 0: B is better with one try and also with K tries: it solves problems that A
              does not solve even with K tries (its reach grew).
- sharpening  l_1 > 0, l_K ≤ 0 and h_K < d_1: pass@1 up while pass@K is flat (interval holds 0) or down, and its
              gain is, even at the interval's upper end, smaller than the pass@1 gain: B puts more mass on answers
              A could already reach (Yue et al. 2025, "Does Reinforcement Learning Really Incentivize Reasoning
              Capacity in LLMs Beyond the Base Model?", report this at large k).
- unclear     anything else: pass@1 not significantly up, K = 1, or an interval at K too wide to tell.
"""

from __future__ import annotations

import html
from pathlib import Path

from posttrain.errors import UserError
from posttrain.eval import stats
from posttrain.eval.metrics import pass_at_k
from posttrain.monitor.curves import svg_difference, svg_overlay


def counts(items: list[dict], path: str) -> list[tuple[int, int]]:
    """(n, c) per problem, or a clear error naming the problem without them."""
    out = []
    for it in items:
        n, c = it.get("n"), it.get("c")
        if not isinstance(n, int) or not isinstance(c, int) or not 0 <= c <= n or n < 1:
            raise UserError(f"{path}: problem {it.get('id')!r} has no valid sample counts n, c (got n={n!r}, c={c!r}); "
                            "curve=true needs results written by posttrain eval")
        out.append((n, c))
    return out


def classify(rows: list[dict]) -> tuple[str, str]:
    """(verdict, reason) from the rows' differences (module docstring)."""
    first, last = rows[0]["diff"], rows[-1]["diff"]
    K = rows[-1]["k"]
    d1 = f"pass@1 B − A = {first['value']:+.3f} [{first['low']:+.3f}, {first['high']:+.3f}]"
    dK = f"pass@{K} B − A = {last['value']:+.3f} [{last['low']:+.3f}, {last['high']:+.3f}]"
    if K == 1:
        return "unclear", f"only k = 1 is available (draw n > 1 samples per problem); {d1}"
    if first["low"] <= 0:
        how = "down" if first["high"] < 0 else "not significantly up"
        return "unclear", f"{d1}: pass@1 is {how}, so neither sharpening nor expanding; {dK}"
    if last["low"] > 0:
        return "expanding", f"{d1} and {dK}: up at large k too (B solves problems A does not solve in {K} tries)"
    if last["high"] < first["value"]:
        how = "down" if last["high"] < 0 else "flat within its interval"
        return "sharpening", f"{d1}, while {dK} is {how}: the gain is in the first tries, not in reach"
    return "unclear", f"{d1} but {dK}: the interval at k = {K} is too wide to tell flat from up"


def curve_compare(xa: list[dict], xb: list[dict], path_a: str = "A", path_b: str = "B", confidence: float = 0.95,
                  resamples: int = 10000, seed: int = 0) -> dict:
    """{"ks", "rows": [{k, a, b, diff}], "verdict", "reason"} for paired problem records of A and B."""
    ca, cb = counts(xa, path_a), counts(xb, path_b)
    kmax = min(n for n, _ in ca + cb)
    rows = []
    for k in range(1, kmax + 1):
        va = [pass_at_k(n, c, k) for n, c in ca]
        vb = [pass_at_k(n, c, k) for n, c in cb]
        boot = stats.paired_bootstrap(va, vb, confidence, resamples, seed)
        side = {}
        for key, v in (("a", va), ("b", vb)):
            mean, low, high = stats.bootstrap_interval(v, confidence, min(resamples, 2000), seed)
            side[key] = {"value": mean, "low": low, "high": high}
        rows.append({"k": k, **side, "diff": {"value": boot["diff"], "low": boot["low"], "high": boot["high"],
                                             "p_value": boot["p_value"]}})
    verdict, reason = classify(rows)
    return {"ks": list(range(1, kmax + 1)), "rows": rows, "verdict": verdict, "reason": reason, "confidence": confidence,
            "method": f"unbiased pass@k per problem; paired percentile bootstrap over {len(ca)} problems, {resamples} resamples"}


def print_curve(cur: dict) -> None:
    pct = round(100 * cur["confidence"])
    print(f"pass@k curves ({cur['method']}):")
    print(f"  {'k':>4}  {'A':>7}  {'B':>7}  {'B − A':>8}  {pct}% paired interval")
    rows = cur["rows"]
    shown = [r for r in rows if r["k"] & (r["k"] - 1) == 0 or r["k"] == rows[-1]["k"]] if len(rows) > 12 else rows
    for r in shown:
        d = r["diff"]
        print(f"  {r['k']:>4}  {r['a']['value']:7.4f}  {r['b']['value']:7.4f}  {d['value']:+8.4f}  [{d['low']:+.4f}, {d['high']:+.4f}]")
    print(f"=> {cur['verdict']}: {cur['reason']}")


def write_curve_html(path: str | Path, result: dict) -> Path:
    """A small page: the verdict, the overlay and the difference (inline SVG) and the table at every k."""
    cur = result["curve"]
    a, b = result["a"], result["b"]
    rows = "".join(f"<tr><td>{r['k']}</td><td>{r['a']['value']:.4f} [{r['a']['low']:.3f}, {r['a']['high']:.3f}]</td>"
                   f"<td>{r['b']['value']:.4f} [{r['b']['low']:.3f}, {r['b']['high']:.3f}]</td>"
                   f"<td>{r['diff']['value']:+.4f} [{r['diff']['low']:+.4f}, {r['diff']['high']:+.4f}]</td></tr>" for r in cur["rows"])
    page = (f"<!doctype html><meta charset='utf-8'><title>pass@k: A vs B</title><body style='font-family:sans-serif;margin:20px'>"
            f"<h2>{html.escape(cur['verdict'])}</h2><p>{html.escape(cur['reason'])}</p>"
            f"<p>A: {html.escape(str(a['path']))} ({html.escape(str(a['model']))})<br>B: {html.escape(str(b['path']))} "
            f"({html.escape(str(b['model']))})</p>{svg_overlay(cur['rows'], 'A', 'B')} {svg_difference(cur['rows'])}"
            f"<p style='color:#666'>{html.escape(cur['method'])}</p><table border=1 cellpadding=3 style='border-collapse:collapse'>"
            f"<tr><th>k</th><th>A pass@k</th><th>B pass@k</th><th>B − A</th></tr>{rows}</table></body>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
