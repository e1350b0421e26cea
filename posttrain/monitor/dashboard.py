"""One grid of grouped, labelled plots for a run (metrics.jsonl rows): the figure a report opens with.

Each panel groups the metrics that answer one question (is it learning? is it drifting? where does
the time go?); a panel is drawn only when the run logged at least one of its metrics, so the same
grid serves RL, PPO, SFT and DPO runs. `plot_dashboard(rows, path)` writes one PNG.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    lines: tuple[tuple[str, str], ...]  # (metric, legend label) on the left axis
    right: tuple[tuple[str, str], ...] = ()  # on a second axis
    right_label: str = ""
    x: str = "step"  # "step" | "minutes" (cumulative wall time of the logged steps)
    logy: bool = False
    interval: tuple[str, ...] = field(default_factory=tuple)  # metrics drawn with their _low/_high bars
    note_zeros: bool = False  # name the metrics that were logged but 0 at every step (e.g. no clipping on-policy)


PANELS = [
    Panel("Learning: training reward and held-out pass@1", "fraction", (("reward/mean", "train reward (mean)"),
          ("eval/pass@1", "held-out pass@1")), interval=("eval/pass@1",)),
    Panel("The same against wall time", "fraction", (("reward/mean", "train reward (mean)"),
          ("eval/pass@1", "held-out pass@1")), x="minutes", interval=("eval/pass@1",)),
    Panel("Loss", "loss", (("loss", "train loss"), ("eval/loss", "eval loss"), ("vf/loss", "value loss"))),
    Panel("KL drift and entropy", "nats / token", (("kl", "KL to reference"), ("kl_start", "KL to the start (β = 0 probe)"),
          ("approx_kl", "KL to old policy")),
          right=(("entropy", "entropy"),), right_label="entropy (nats / token)"),
    Panel("Response length", "tokens", (("response_length/mean", "mean"), ("response_length/max", "max")),
          right=(("response_length/clipped_frac", "cut at max_new_tokens"),), right_label="fraction"),
    Panel("Clipping and groups without signal", "fraction", (("clip_frac/low", "ratio clipped low"),
          ("clip_frac/high", "ratio clipped high"), ("groups/zero_adv_frac", "groups with zero advantage"),
          ("vf/clip_frac", "value clipped")), note_zeros=True),
    Panel("Train–inference gap (sampler vs trainer log-probs)", "nats / token",
          (("consistency/kl_behaviour_trainer", "KL(sampler ‖ trainer)"), ("consistency/dlogp_mean", "mean |Δ log p|")),
          logy=True),
    Panel("Optimizer", "gradient norm", (("grad_norm", "grad norm (before clipping)"),),
          right=(("lr", "learning rate"),), right_label="learning rate"),
    Panel("Time per step by phase", "seconds", (("time/generate", "generate"), ("time/reward", "reward"),
          ("time/reference", "reference"), ("time/critic", "critic"), ("time/update", "update"), ("time/eval", "held-out eval"))),
]


def _values(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metric; empty when it is absent or exactly 0 throughout (e.g. KL without a
    reference, clipping in a strictly on-policy step): a flat zero line would only add clutter."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    if all(p[1] == 0 for p in pts):
        return [], []
    return [p[0] for p in pts], [p[1] for p in pts]


def _all_zero(rows: list[dict], key: str) -> bool:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return bool(values) and all(v == 0 for v in values)


def step_minutes(rows: list[dict]) -> dict[int, float]:
    """Cumulative wall time (minutes) at the end of each logged step, from the per-phase times."""
    total, out = 0.0, {}
    for r in rows:
        total += sum(v for k, v in r.items() if k.startswith("time/") and isinstance(v, (int, float)))
        out[r["step"]] = total / 60
    return out


def active_panels(rows: list[dict]) -> list[Panel]:
    return [p for p in PANELS if any(_values(rows, k)[0] for k, _ in p.lines + p.right)]


def _draw(ax, panel: Panel, rows: list[dict], minutes: dict[int, float]) -> None:
    if not any(_values(rows, k)[0] for k, _ in panel.lines):  # only the right-axis metrics: draw them on the left
        panel = Panel(panel.title, panel.right_label, panel.right, x=panel.x, logy=panel.logy)
    xmap = (lambda s: minutes.get(s, 0.0)) if panel.x == "minutes" else (lambda s: s)
    for key, label in panel.lines:
        xs, ys = _values(rows, key)
        if not xs:
            continue
        xs = [xmap(s) for s in xs]
        if key in panel.interval:
            lo, hi = _values(rows, key + "_low")[1], _values(rows, key + "_high")[1]
            err = [[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]] if len(lo) == len(ys) == len(hi) else None
            ax.errorbar(xs, ys, yerr=err, marker="o", markersize=4, capsize=3, linewidth=1.5, label=label + " (95% CI)")
        else:
            ax.plot(xs, ys, marker="o" if len(xs) < 25 else None, markersize=3, linewidth=1.3, label=label)
    if panel.right:
        twin = ax.twinx()
        for key, label in panel.right:
            xs, ys = _values(rows, key)
            if xs:
                twin.plot([xmap(s) for s in xs], ys, linestyle="--", color="0.45", linewidth=1.1, label=label)
        twin.set_ylabel(panel.right_label, fontsize=8)
        twin.tick_params(labelsize=7)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1]
        ax.legend(handles, labels, fontsize=7, loc="best")
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    if panel.logy and any(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
        ax.set_yscale("log")
    ax.set_title(panel.title, fontsize=9.5)
    xlabel = "wall time (minutes)" if panel.x == "minutes" else "optimizer step"
    zeros = [label for key, label in panel.lines if panel.note_zeros and _all_zero(rows, key)]
    ax.set_xlabel(xlabel + (f"\n(0 at every step: {', '.join(zeros)})" if zeros else ""), fontsize=8)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def plot_dashboard(rows: list[dict], path: str | Path, columns: int = 3) -> Path | None:
    """Write the grid of active panels to `path` (PNG); None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = active_panels(rows)
    if not rows or not panels:
        return None
    n_rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(n_rows, columns, figsize=(5.0 * columns, 3.3 * n_rows), dpi=100, squeeze=False)
    minutes = step_minutes(rows)
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, panel, rows, minutes)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    # fixed margins in inches (tight_layout measured every label: most of the report's time); room for a
    # right-hand twin axis label and a two-line x label
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.75 / width, bottom=0.75 / height, top=1 - 0.35 / height,
                        wspace=0.42, hspace=0.5)
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
