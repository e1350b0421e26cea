"""report.html of an evaluation: metrics with intervals, the pass@k curve, the protocol, a per-problem
table and a few problems' samples (tables rendered by posttrain.monitor.report's helper)."""

from __future__ import annotations

import html
from collections import Counter
from pathlib import Path

from posttrain.monitor.report import _table

STYLE = """body{font-family:sans-serif;margin:24px;max-width:1400px} table{border-collapse:collapse;margin-bottom:16px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top;font-size:13px} pre{margin:0;white-space:pre-wrap}
img{margin:4px;border:1px solid #eee} .s{border:1px solid #ddd;margin:6px 0;padding:6px} .ok{background:#f4fff4} .bad{background:#fff4f4}"""


def plot_curve(doc: dict, out_dir: Path) -> str | None:
    """pass@k (and cons@k, pass^k) against k with interval bars -> passk.png."""
    rows = doc["curve"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.4), dpi=100)
    for name, marker in (("pass@k", "o"), ("cons@k", "s"), ("pass^k", "^")):
        pts = [(r["k"], r[name]) for r in rows if name in r]
        if not pts:
            continue
        ks = [k for k, _ in pts]
        vals = [m["value"] for _, m in pts]
        err = [[v - m["low"] for v, (_, m) in zip(vals, pts)], [m["high"] - v for v, (_, m) in zip(vals, pts)]]
        ax.errorbar(ks, vals, yerr=err, marker=marker, markersize=4, capsize=3, linewidth=1.2, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["k"] for r in rows], [str(r["k"]) for r in rows])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("k", fontsize=9)
    ax.set_title(f"{round(100 * doc['confidence'])}% intervals, n = {doc['protocol']['n']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "passk.png")
    plt.close(fig)
    return "passk.png"


def metrics_table(doc: dict) -> str:
    head = "<tr><th>metric</th><th>value</th><th>low</th><th>high</th><th>interval</th></tr>"
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{m['value']:.4f}</td><td>{m['low']:.4f}</td><td>{m['high']:.4f}</td>"
                   f"<td>{html.escape(m['interval'])}</td></tr>" for k, m in doc["metrics"].items())
    return f"<table>{head}{rows}</table>"


def _items_table(doc: dict) -> str:
    head = "<tr><th>id</th><th>question</th><th>answer</th><th>correct / n</th><th>pass@1</th><th>most frequent answer</th><th>note</th></tr>"
    rows = []
    for it in doc["items"]:
        answers = [a for a in it.get("answers", []) if a is not None]
        top = Counter(answers).most_common(1)[0][0] if answers else ""
        note = it.get("error") or ("; ".join(it.get("reward_errors", [])[:1]))
        cls = "ok" if it["c"] * 2 >= it["n"] else "bad"
        rows.append(f"<tr class={cls}><td>{html.escape(str(it['id']))}</td><td>{html.escape(str(it['question']))[:300]}</td>"
                    f"<td>{html.escape(str(it.get('answer', '')))}</td><td>{it['c']} / {it['n']}</td><td>{it['c'] / max(it['n'], 1):.3f}</td>"
                    f"<td>{html.escape(str(top))}</td><td>{html.escape(note or '')}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _samples(doc: dict, count: int) -> str:
    parts = []
    for it in doc["items"][:count]:
        samples = it.get("samples") or []
        body = "".join(f"<pre class={'ok' if ok else 'bad'}>{html.escape(s['text'])}</pre>"
                       for s, ok in zip(samples, it["correct"]))
        parts.append(f"<div class=s><b>problem {html.escape(str(it['id']))}</b> (gold: {html.escape(str(it.get('answer')))})"
                     f"<pre>{html.escape(it['prompt'][-600:])}</pre>{body}</div>")
    return "".join(parts)


def _unscored(doc: dict) -> str:
    why = doc.get("unscored")
    return f"<p class=bad><b>No sample was scored</b>, so there is no metric: {html.escape(why)}</p>" if why else ""


def write_eval_report(out_dir: str | Path, doc: dict, samples: int = 3) -> Path:
    out_dir = Path(out_dir)
    plot = plot_curve(doc, out_dir)
    proto = {k: v for k, v in doc["protocol"].items() if k != "chat_template"}
    proto["chat_template"] = {k: v for k, v in doc["protocol"]["chat_template"].items() if k != "text"}
    title = f"eval — {doc['protocol']['model']['name']} on {doc['protocol']['data']['source']}"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{STYLE}</style></head>
<body><h1>{html.escape(title)}</h1><h2>Metrics</h2>{_unscored(doc)}{metrics_table(doc)}{f'<img src="{plot}" alt="pass@k">' if plot else ''}
<h2>Counts and timing</h2>{_table({**doc['counts'], **doc['timing']})}<h2>Protocol</h2>{_table(proto)}
<h2>Problems</h2>{_items_table(doc)}<h2>Samples</h2>{_samples(doc, samples)}</body></html>"""
    path = out_dir / "report.html"
    path.write_text(page)
    return path
