"""The quickstart's report.html: the before/after result with its test on top, then the training grid,
alarms, predicted vs measured cost and the same prompts answered before and after.

Built only from files in the quickstart folder (eval_before/results.json, rl/metrics.jsonl, rl/plan.json,
rl/summary.json, eval_after/results.json, compare.json), so `posttrain report runs/quickstart` redoes it.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from posttrain.monitor.dashboard import plot_dashboard, step_minutes
from posttrain.monitor.metrics import read_metrics

STYLE = """body{font-family:system-ui,sans-serif;margin:20px auto;max-width:1540px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 10px} h2{font-size:17px;margin:22px 0 8px;border-bottom:1px solid #ddd}
.head{display:flex;gap:28px;align-items:center;background:#f5f8ff;border:1px solid #cbd8f0;padding:12px 18px;border-radius:6px}
.big{font-size:34px;font-weight:600} .arrow{font-size:28px;color:#666} .ci{color:#555;font-size:14px}
.verdict{font-size:15px;line-height:1.5} .ok{background:#eefbee} .bad{background:#fdeeee}
table{border-collapse:collapse;font-size:13px;margin:4px 0} th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
pre{margin:1px 0;white-space:pre-wrap;font-size:12px;padding:1px 4px} img{max-width:100%;border:1px solid #eee}
.muted{color:#666;font-size:13px}"""


def machine() -> str:
    """`AMD EPYC 9R14, 2 threads` (CPU model from /proc/cpuinfo, torch's thread count), or the GPU's name."""
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    name = platform.processor() or platform.machine()
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
        name = line.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _pct(m: dict) -> str:
    return f"<span class=big>{m['value']:.2f}</span> <span class=ci>[{m['low']:.2f}, {m['high']:.2f}]</span>"


def headline(before: dict, after: dict, cmp: dict, rows: list[dict], hardware: str) -> str:
    b1, a1 = before["metrics"]["pass@1"], after["metrics"]["pass@1"]
    bt = cmp["bootstrap"]
    conf = round(100 * cmp["confidence"])
    mc = cmp.get("mcnemar")
    sf = cmp.get("sign_flip")
    sf_text = f", sign-flip test over problems p = {sf['p_value']:.2g}" if sf else ""
    mc_text = (f"<br><span class=muted>conditional on these {bt['items']} problems (samples paired within each problem, "
               f"not a test for other problems): exact McNemar over {mc['pairs']} paired samples p = {mc['p_value']:.2g}</span>"
               if mc else "")
    verdict = "significant" if cmp["significant"] else "<b>not</b> significant"
    others = ", ".join(f"{k} {before['metrics'][k]['value']:.2f} → {after['metrics'][k]['value']:.2f}"
                       for k in after["metrics"] if k.startswith(("pass@", "pass^")) and k not in ("pass@1", "pass^1") and k in before["metrics"])
    proto = before["protocol"]
    minutes = step_minutes(rows)
    train = f"{len(rows)} GRPO steps in {max(minutes.values(), default=0):.1f} min" if rows else "no training steps logged"
    return (f"<div class=head><div>held-out pass@1<br>{_pct(b1)}</div><div class=arrow>→</div><div>after GRPO<br>{_pct(a1)}</div>"
            f"<div class=verdict>difference <b>{bt['diff']:+.3f}</b> over {bt['items']} problems, {conf}% paired bootstrap "
            f"interval [{bt['low']:+.3f}, {bt['high']:+.3f}], p = {bt['p_value']:.2g}{sf_text}: {verdict} at "
            f"α = {1 - cmp['confidence']:.2g}{mc_text}<br>"
            f"{others}<br><span class=muted>{proto['data']['items']} held-out problems ({html.escape(proto['data']['source'])}) × "
            f"{proto['n']} samples at temperature {proto['sampling']['temperature']}; {train} on {html.escape(hardware)}</span></div></div>")


def cost_table(plan: dict | None) -> str:
    if not plan or not plan.get("measured"):
        return "<p class=muted>no plan.json with measurements</p>"
    p, m = plan["predicted"], plan["measured"]
    rows = [("peak memory (GiB)", p.get("peak_bytes_estimate"), m.get("peak_rss_growth_bytes"), 2**30),
            ("tokens per step", p.get("tokens_per_step"), m.get("tokens_per_step"), 1),
            ("seconds per step", p.get("seconds_per_step"), m.get("seconds_per_step"), 1)]
    steps, timers = m.get("steps") or 0, m.get("phase_seconds") or {}
    for phase in p.get("phases") or []:  # the planner's phases beside the step timers that measure them
        measured = {"generate": timers.get("generate"), "train": timers.get("update")}.get(phase["phase"])
        if phase.get("seconds") is not None and steps:
            rows.append((f"  {phase['phase']} seconds ({phase.get('bound', 'compute')}-bound)", phase["seconds"],
                         measured / steps if measured is not None else None, 1))
    cells = []
    for name, pred, meas, unit in rows:
        ratio = f"{meas / pred:.2f}" if isinstance(pred, (int, float)) and pred and isinstance(meas, (int, float)) else "–"
        shown = [f"{v / unit:.3g}" if isinstance(v, (int, float)) else "–" for v in (pred, meas)]
        cells.append(f"<tr><th>{name}</th><td>{shown[0]}</td><td>{shown[1]}</td><td>{ratio}</td></tr>")
    return ("<table><tr><th></th><th>predicted</th><th>measured</th><th>measured / predicted</th></tr>"
            + "".join(cells) + "</table><p class=muted>memory measured as peak RSS growth over the run "
            "(see docs/planner.md); time: training at the matmul peak × MFU 0.4, decode at the roofline of the copy "
            "bandwidth and the weights' matmul peak, both measured on this CPU (best of several trials, cached: "
            "hardware=cpu); reward and eval time are not predicted; tokens counted at max_new_tokens per sample"
            + "".join(f"<br>{html.escape(n)}" for n in plan.get("notes") or []) + "</p>")


def alarms_html(summary: dict | None) -> str:
    alarms = (summary or {}).get("alarms") or {}
    if not alarms:
        return "<p>none fired</p>"
    return "<table><tr><th>alarm</th><th>what was seen</th></tr>" + "".join(
        f"<tr><th>{html.escape(name)}</th><td><pre>{html.escape(json.dumps(entry)[:600])}</pre></td></tr>"
        for name, entry in alarms.items()) + "</table><p class=muted>what each alarm means: docs/alarms.md</p>"


def _cell(item: dict, shown: int) -> str:
    samples = (item.get("samples") or [])[:shown]
    marks = item["correct"][:shown]
    body = "".join(f"<pre class={'ok' if ok else 'bad'}>{html.escape(s['text'].strip()) or '(empty)'}</pre>"
                   for s, ok in zip(samples, marks))
    return f"<td><b>{item['c']}/{item['n']}</b> correct{body}</td>"


def samples_html(before: dict, after: dict, problems: int = 6, shown: int = 3) -> str:
    by_id = {it["id"]: it for it in after["items"]}
    rows = []
    for it in before["items"][:problems]:
        other = by_id.get(it["id"])
        if other is None:
            continue
        rows.append(f"<tr><td>{html.escape(str(it['question']))}<br><span class=muted>gold: {html.escape(str(it.get('answer')))}</span></td>"
                    f"{_cell(it, shown)}{_cell(other, shown)}</tr>")
    return ("<table><tr><th>problem</th><th>before (first samples)</th><th>after (same sample seeds)</th></tr>"
            + "".join(rows) + "</table>")


def with_start(rows: list[dict], before: dict) -> list[dict]:
    """The training rows with the base model's held-out pass@1 (the evaluation stage) as step 0."""
    m = before["metrics"]["pass@1"]
    return [{"step": 0, "eval/pass@1": m["value"], "eval/pass@1_low": m["low"], "eval/pass@1_high": m["high"]}, *rows]


def curve_html(cmp: dict) -> str:
    """compare.json's pass@k overlay (eval compare curve=true): both curves, B − A with its interval, the verdict."""
    cur = cmp.get("curve")
    if not cur:
        return ""
    from posttrain.monitor.curves import svg_difference, svg_overlay

    return (f"<h2>pass@k before and after: {html.escape(cur['verdict'])}</h2><p class='verdict'>{html.escape(cur['reason'])}</p>"
            f"{svg_overlay(cur['rows'], 'before', 'after')} {svg_difference(cur['rows'])}<p class='muted'>{html.escape(cur['method'])}</p>")


def equal_tokens_html(cmp: dict) -> str:
    """compare.json's `equal_tokens`: best-of-N (verifier: an oracle) and majority on the base model against the
    trained model, per budget of generated tokens per problem (eval/selection.equal_tokens)."""
    et = cmp.get("equal_tokens")
    if not et:
        return ""
    f = lambda m: f"{m['value']:.3f} [{m['low']:.3f}, {m['high']:.3f}]"
    d = lambda m: f"{m['value']:+.3f} [{m['low']:+.3f}, {m['high']:+.3f}]"
    rows = "".join(f"<tr><td>{r['budget']}</td><td>{r['a']['samples']:.1f} / {r['a']['tokens']:.0f}</td><td>{f(r['a']['best_of_n'])}</td>"
                   f"<td>{f(r['a']['majority'])}</td><td>{r['b']['samples']:.1f} / {r['b']['tokens']:.0f}</td><td>{f(r['b']['majority'])}</td>"
                   f"<td>{d(r['b_maj_minus_a_maj'])}</td><td>{d(r['b_maj_minus_a_best_of_n'])}</td></tr>" for r in et["rows"])
    return ("<h2>RL against sampling more from the base model, at equal generated tokens</h2><table><tr><th>tokens per problem</th>"
            "<th>base: samples / tokens</th><th>base best-of-N (verifier: oracle)</th><th>base majority</th>"
            "<th>trained: samples / tokens</th><th>trained majority</th><th>trained maj − base maj</th>"
            f"<th>trained maj − base best-of-N</th></tr>{rows}</table><p class='muted'>{html.escape(et['method'])}</p>")


def write_quickstart_report(out: str | Path) -> Path:
    out = Path(out)
    before, after, cmp = (_load(out / p) for p in ("eval_before/results.json", "eval_after/results.json", "compare.json"))
    if not (before and after and cmp):
        raise FileNotFoundError(f"{out} has no finished quickstart (eval_before/, eval_after/ and compare.json are needed)")
    rows = read_metrics(out / "rl" / "metrics.jsonl") if (out / "rl" / "metrics.jsonl").is_file() else []
    plan, summary = _load(out / "rl" / "plan.json"), _load(out / "rl" / "summary.json")
    hw_text = (_load(out / "quickstart.json") or {}).get("machine") or machine()
    grid = plot_dashboard(with_start(rows, before), out / "training.png")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>posttrain quickstart</title><style>{STYLE}</style></head>
<body><h1>posttrain quickstart: GRPO on {html.escape(before['protocol']['model']['name'].split('/')[-1])}, evaluated on held-out problems</h1>
{headline(before, after, cmp, rows, str(hw_text))}
{curve_html(cmp)}
{equal_tokens_html(cmp)}
<h2>Training</h2>{f'<img src="{grid.name}" alt="training curves">' if grid else '<p>no metrics</p>'}
<h2>Health alarms</h2>{alarms_html(summary)}
<h2>Predicted vs measured cost (GRPO stage)</h2>{cost_table(plan)}
<h2>The same held-out prompts, before and after</h2>{samples_html(before, after)}
<h2>Details</h2><p><a href="rl/report.html">GRPO run report</a> · <a href="eval_before/report.html">evaluation before</a> ·
<a href="eval_after/report.html">evaluation after</a> · <a href="compare.json">compare.json</a> · <a href="rl/config.yaml">GRPO config</a></p>
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path
