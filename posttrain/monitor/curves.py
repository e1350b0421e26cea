"""Inline SVG of two pass@k curves over k (log2 axis) with interval bars, and of their difference B − A with its
paired interval band: the overlay `posttrain eval compare curve=true` draws, in its HTML and the quickstart report.
Drawn in Python like monitor/report.py's svg_plot (no plotting library).

    svg_overlay(rows, "A", "B")   rows: [{k, a: {value, low, high}, b: {…}, diff: {value, low, high}}]
"""

from __future__ import annotations

import html
import math

COLORS = ("#1f77b4", "#d62728")


def _frame(title: str, width: int, height: int, box: tuple[int, int, int, int]) -> list[str]:
    left, top, w, h = box
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="10">',
            f'<text x="{width / 2}" y="13" text-anchor="middle" font-size="11">{html.escape(title)}</text>',
            f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>']


def _axes(ks: list[int], y0: float, y1: float, box, height: int) -> tuple[list[str], callable, callable]:
    left, top, w, h = box
    lx0, lx1 = math.log2(ks[0]), math.log2(ks[-1])
    fx = (lambda k: left + (math.log2(k) - lx0) / (lx1 - lx0) * w) if lx1 > lx0 else (lambda k: left + w / 2)
    fy = lambda y: top + h - (y - y0) / (y1 - y0) * h if y1 > y0 else top + h / 2
    ticks = [k for k in ks if k & (k - 1) == 0 or k == ks[-1]]  # powers of two and the last k
    parts = [f'<text x="{fx(k):.1f}" y="{height - 6}" text-anchor="middle">{k}</text>' for k in ticks]
    parts += [f'<text x="{left - 3}" y="{top + 8}" text-anchor="end">{y1:.3g}</text>',
              f'<text x="{left - 3}" y="{top + h}" text-anchor="end">{y0:.3g}</text>']
    return parts, fx, fy


def _series(rows: list[dict], key: str, fx, fy, color: str, dx: float = 0.0) -> list[str]:
    pts = [(fx(r["k"]) + dx, fy(r[key]["value"])) for r in rows]
    parts = ['<polyline fill="none" stroke="' + color + '" stroke-width="1.4" points="' + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>']
    for r, (x, y) in zip(rows, pts):
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{fy(r[key]["low"]):.1f}" y2="{fy(r[key]["high"]):.1f}" stroke="{color}" stroke-opacity="0.6"/>')
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{color}"/>')
    return parts


def svg_overlay(rows: list[dict], name_a: str = "A", name_b: str = "B", width: int = 420, height: int = 230) -> str:
    """pass@k of A and B against k, each with its interval bar (B drawn 2 px to the right so bars do not hide)."""
    box = (40, 20, width - 40 - 110, height - 20 - 24)
    ks = [r["k"] for r in rows]
    parts = _frame("pass@k (unbiased estimator), interval bars", width, height, box)
    ticks, fx, fy = _axes(ks, 0.0, 1.0, box, height)
    parts += ticks
    for key, color, dx in zip(("a", "b"), COLORS, (0.0, 2.0)):
        parts += _series(rows, key, fx, fy, color, dx)
    for i, (name, color) in enumerate(zip((name_a, name_b), COLORS)):
        y = box[1] + 12 + 14 * i
        parts.append(f'<text x="{box[0] + box[2] + 8}" y="{y}" fill="{color}">{html.escape(name[:18])}</text>')
    return "".join(parts) + "</svg>"


def svg_difference(rows: list[dict], width: int = 420, height: int = 230) -> str:
    """B − A in pass@k against k with its paired interval at each k, and the zero line."""
    box = (46, 20, width - 46 - 110, height - 20 - 24)
    ks = [r["k"] for r in rows]
    lo = min(0.0, *(r["diff"]["low"] for r in rows))
    hi = max(0.0, *(r["diff"]["high"] for r in rows))
    parts = _frame("B − A in pass@k, paired interval", width, height, box)
    ticks, fx, fy = _axes(ks, lo, hi if hi > lo else lo + 1e-9, box, height)
    parts += ticks
    parts.append(f'<line x1="{box[0]}" x2="{box[0] + box[2]}" y1="{fy(0.0):.1f}" y2="{fy(0.0):.1f}" stroke="#999" stroke-dasharray="3,3"/>')
    parts += _series(rows, "diff", fx, fy, "#2ca02c")
    return "".join(parts) + "</svg>"
