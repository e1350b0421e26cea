"""`report.html` and PNG plots for a run directory, from metrics.jsonl and a summary dict."""

from __future__ import annotations

import html
import json
import math
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


def svg_plot(name: str, xs: list[int], ys: list[float], width: int = 300, height: int = 150) -> str:
    """One metric against step as an inline SVG line chart (title, min/max of y, first/last step): drawn
    in Python, no plotting library, so a report of 24 metrics costs milliseconds."""
    pts = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    left, right, top, bottom = 46, 8, 20, 22
    w, h = width - left - right, height - top - bottom
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="10">',
             f'<text x="{width / 2}" y="13" text-anchor="middle" font-size="11">{html.escape(name)}</text>',
             f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>']
    if pts:
        x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
        y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
        sx = w / (x1 - x0) if x1 > x0 else 0.0
        sy = h / (y1 - y0) if y1 > y0 else 0.0
        xy = [(left + (x - x0) * sx if sx else left + w / 2, top + h - (y - y0) * sy if sy else top + h / 2) for x, y in pts]
        parts.append('<polyline fill="none" stroke="#1f77b4" stroke-width="1.3" points="'
                     + " ".join(f"{a:.1f},{b:.1f}" for a, b in xy) + '"/>')
        if len(xy) < 30:
            parts += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2" fill="#1f77b4"/>' for a, b in xy]
        parts += [f'<text x="{left - 3}" y="{top + 8}" text-anchor="end">{y1:.4g}</text>',
                  f'<text x="{left - 3}" y="{top + h}" text-anchor="end">{y0:.4g}</text>',
                  f'<text x="{left}" y="{height - 6}">{x0}</text>',
                  f'<text x="{left + w}" y="{height - 6}" text-anchor="end">step {x1}</text>']
    return "".join(parts) + "</svg>"


def plot_metrics(rows: list[dict], max_plots: int = 24) -> list[str]:
    """Inline SVG charts of the numeric metrics with more than one value (eval/* always): PREFERRED first."""
    series = _series(rows)
    names = [k for k in PREFERRED if k in series] + sorted(k for k in series if k not in PREFERRED)
    names = [n for n in names if len(series[n][0]) > 1 or n.startswith("eval/")][:max_plots]
    return [svg_plot(n, *series[n]) for n in names]


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
    sections as tables, then `images` (PNG files in run_dir, e.g. a probe's plots), then one chart per metric
    (inline SVG)."""
    run_dir = Path(run_dir)

    rows = read_metrics(run_dir / "metrics.jsonl")
    grid = plot_dashboard(rows, run_dir / "dashboard.png")
    plots = plot_metrics(rows)
    samples = run_dir / "samples.jsonl"
    sample_html = ""
    if samples.exists():
        lines = [json.loads(l) for l in samples.read_text().splitlines()[-6:] if l.strip()]
        sample_html = "<h2>Latest samples</h2>" + "".join(
            f"<div class=s><b>step {s.get('step')}</b><pre>{html.escape(str(s.get('prompt', '')))[-600:]}</pre>"
            f"<pre class=c>{html.escape(str(s.get('completion', '')))}</pre></div>" for s in lines
        )
    body = "".join(f"<h2>{html.escape(name)}</h2>{_table(data)}" for name, data in sections.items() if data)
    imgs = "".join(plots)
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
