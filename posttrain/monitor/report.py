"""`report.html` and PNG plots for a run directory, from metrics.jsonl and a summary dict."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from posttrain.monitor.dashboard import plot_dashboard
from posttrain.monitor.metrics import read_metrics

# plotted first, in this order, when present; every other numeric metric follows
PREFERRED = ["loss", "eval/loss", "lr", "grad_norm", "tokens_per_s", "padding_fraction"]


def _series(rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k == "step" or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            xs, ys = series.setdefault(k, ([], []))
            xs.append(r["step"])
            ys.append(v)
    return series


def plot_metrics(rows: list[dict], out_dir: Path, max_plots: int = 24) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(rows)
    names = [k for k in PREFERRED if k in series] + sorted(k for k in series if k not in PREFERRED)
    names = [n for n in names if len(series[n][0]) > 1 or n.startswith("eval/")][:max_plots]
    files = []
    for name in names:
        xs, ys = series[name]
        fig, ax = plt.subplots(figsize=(4.2, 2.8), dpi=100)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fname = "plot_" + name.replace("/", "_") + ".png"
        fig.savefig(out_dir / fname)
        plt.close(fig)
        files.append(fname)
    return files


def _table(data: dict[str, Any]) -> str:
    cells = []
    for k, v in data.items():
        if isinstance(v, float):
            v = f"{v:.6g}"
        elif isinstance(v, (dict, list)):
            v = json.dumps(v, indent=1)[:2000]
        cells.append(f"<tr><th>{html.escape(str(k))}</th><td><pre>{html.escape(str(v))}</pre></td></tr>")
    return "<table>" + "".join(cells) + "</table>"


def write_report(run_dir: str | Path, title: str, sections: dict[str, dict[str, Any]],
                 images: list[str] | None = None) -> Path:
    """Write run_dir/report.html: the grid of grouped training plots (monitor/dashboard.py), the summary
    sections as tables, then `images` (PNG files in run_dir, e.g. a probe's plots), then one plot per metric."""
    run_dir = Path(run_dir)

    rows = read_metrics(run_dir / "metrics.jsonl")
    grid = plot_dashboard(rows, run_dir / "dashboard.png")
    plots = plot_metrics(rows, run_dir)
    samples = run_dir / "samples.jsonl"
    sample_html = ""
    if samples.exists():
        lines = [json.loads(l) for l in samples.read_text().splitlines()[-6:] if l.strip()]
        sample_html = "<h2>Latest samples</h2>" + "".join(
            f"<div class=s><b>step {s.get('step')}</b><pre>{html.escape(str(s.get('prompt', '')))[-600:]}</pre>"
            f"<pre class=c>{html.escape(str(s.get('completion', '')))}</pre></div>" for s in lines
        )
    body = "".join(f"<h2>{html.escape(name)}</h2>{_table(data)}" for name, data in sections.items() if data)
    imgs = "".join(f'<img src="{p}" alt="{p}">' for p in plots)
    if images:
        body += "<h2>Plots</h2>" + "".join(f'<img src="{html.escape(p)}" alt="{html.escape(p)}">' for p in images)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:24px;max-width:1400px}} table{{border-collapse:collapse;margin-bottom:16px}}
th,td{{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top;font-size:13px}} pre{{margin:0;white-space:pre-wrap}}
img{{margin:4px;border:1px solid #eee}} .s{{border:1px solid #ddd;margin:6px 0;padding:6px}} .c{{background:#f4fff4}}</style></head>
<body><h1>{html.escape(title)}</h1>{f'<img src="{grid.name}" alt="training curves" style="max-width:100%">' if grid else ''}
{body}<details><summary><b>Every metric ({len(rows)} steps)</b></summary>{imgs}</details>{sample_html}</body></html>"""
    out = run_dir / "report.html"
    out.write_text(page)
    return out
