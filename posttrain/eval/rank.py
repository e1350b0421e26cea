"""`posttrain eval rank FILE [FILE …]`: a Bradley–Terry ranking of models from pairwise results, with intervals.

    posttrain eval rank pairs_ab.jsonl pairs_bc.jsonl [anchor=NAME] [bootstrap=1000] [output=rank.json]

Each row of a file is one comparison, in any of these forms:
- `posttrain label` output (two policies): `source` {a, b, chosen, models: {A, B}} (+ `tie: true`); a file written
  before `models` was recorded names its sides FILE:A and FILE:B. Pairs of one policy's own samples (A:0 vs
  A:1) say nothing about a ranking and are skipped (counted).
- Chatbot Arena's battles: `model_a`, `model_b`, `winner` = model_a | model_b | a | b | tie | tie (bothbad).
- soft outcomes: `model_a`, `model_b`, `preference` = P(a preferred) in [0, 1] (0.5 = tie).

The fit (eval/winrate.bradley_terry): logit P(i beats j) = β_i − β_j by maximum likelihood, ties half a win,
β_anchor = 0, Elo = 1000 + 400 β / ln 10. Intervals: percentile bootstrap over comparisons (rows resampled with
replacement and refit, seeded; Chatbot Arena's method), for each model's Elo and its rank. The models must form
one connected graph of comparisons (else their strengths are not comparable): refused, naming the groups. A
model that won (or lost) every game has an infinite MLE strength, kept finite by the fit's small L2 penalty:
flagged in the output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pydantic import Field

from posttrain.config import Config, parse_args, split_args
from posttrain.data.formats import read_rows
from posttrain.errors import UserError

WINNER = {"model_a": 1.0, "a": 1.0, "model_b": 0.0, "b": 0.0, "tie": 0.5, "tie (bothbad)": 0.5}


class RankConfig(Config):
    """posttrain eval rank FILE…: Bradley–Terry ranking with bootstrap intervals from pairwise results."""

    anchor: str = Field("", description="model whose strength is 0 (Elo 1000); '' = the one in most comparisons")
    bootstrap: int = Field(1000, ge=0, description="bootstrap resamples over comparisons (0 = no intervals)")
    confidence: float = Field(0.95, gt=0, lt=1, description="interval coverage")
    seed: int = Field(0, description="bootstrap seed")
    output: str = Field("", description="also write the ranking as JSON to this file")


def _label_row(d: dict, row, stem: str) -> tuple[str, str, float] | None:
    """A `posttrain label` row -> (model of side a, model of side b, P(a preferred)); None for a within-policy pair."""
    src = d["source"]
    a, b, chosen = src.get("a"), src.get("b"), src.get("chosen")
    if not all(isinstance(x, str) for x in (a, b)):
        raise row.error("source", "needs `a` and `b` (the labels of the two responses, e.g. A:0 and B:0)")
    pa, pb = a.split(":")[0], b.split(":")[0]
    if pa == pb:
        return None
    names = src.get("models") or {}
    ma, mb = names.get(pa) or f"{stem}:{pa}", names.get(pb) or f"{stem}:{pb}"
    if d.get("tie"):
        return ma, mb, 0.5
    if chosen not in (a, b):
        raise row.error("source.chosen", f"must be one of the pair's labels ({a!r}, {b!r}), got {chosen!r}")
    return ma, mb, 1.0 if chosen == a else 0.0


def comparison(d: dict, row, stem: str) -> tuple[str, str, float] | None:
    """One row -> (model_i, model_j, P(i preferred)), a clear error naming file, row and field, or None (skipped)."""
    if isinstance(d.get("source"), dict) and "chosen" in d:
        return _label_row(d, row, stem)
    for key in ("model_a", "model_b"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise row.error(key, "missing: a row needs model_a and model_b with winner (a | b | tie) or preference in [0, 1], "
                                 "or is a `posttrain label` output row (prompt, chosen, rejected, source)")
    if d["model_a"] == d["model_b"]:
        raise row.error("model_b", f"the same model as model_a ({d['model_a']!r}): a model cannot be compared with itself")
    if "winner" in d:
        w = str(d["winner"]).strip().lower()
        if w not in WINNER:
            raise row.error("winner", f"must be one of {', '.join(WINNER)}, got {d['winner']!r}")
        return d["model_a"], d["model_b"], WINNER[w]
    p = d.get("preference")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1 or math.isnan(p):
        raise row.error("preference" if "preference" in d else "winner",
                        f"give winner (a | b | tie) or preference = P(model_a preferred) in [0, 1], got {p!r}")
    return d["model_a"], d["model_b"], float(p)


def read_comparisons(paths: list[str]) -> tuple[list[tuple[str, str, float]], int]:
    """Every comparison of the files, and how many within-policy rows were skipped."""
    comps, skipped = [], 0
    for path in paths:
        if not Path(path).is_file():
            raise UserError(f"{path}: no such file (give the .jsonl files `posttrain label` wrote, or rows with model_a, model_b, winner)")
        rows = read_rows(path)
        if not rows:
            raise UserError(f"{path}: no comparisons in it")
        for row in rows:
            c = comparison(row.data, row, Path(path).stem)
            if c is None:
                skipped += 1
            else:
                comps.append(c)
    if not comps:
        raise UserError(f"no comparison between two different models in {', '.join(paths)} ({skipped} rows compare a "
                        "policy with itself: label two policies, policy_a and policy_b)")
    return comps, skipped


def components(comps: list[tuple[str, str, float]]) -> list[list[str]]:
    """Connected groups of models (union-find over the comparisons), largest first."""
    parent: dict[str, str] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j, _ in comps:
        parent[find(i)] = find(j)
    groups: dict[str, list[str]] = {}
    for m in sorted(parent):
        groups.setdefault(find(m), []).append(m)
    return sorted(groups.values(), key=len, reverse=True)


def rank(comps: list[tuple[str, str, float]], anchor: str = "", resamples: int = 1000, confidence: float = 0.95,
         seed: int = 0) -> dict:
    """The Bradley–Terry fit with percentile-bootstrap intervals of Elo and rank (module docstring)."""
    import numpy as np

    from posttrain.eval.winrate import bradley_terry

    groups = components(comps)
    if len(groups) > 1:
        shown = "; ".join("{" + ", ".join(g[:5]) + (", …" if len(g) > 5 else "") + "}" for g in groups)
        raise UserError(f"the comparisons form {len(groups)} separate groups of models ({shown}): strengths in different "
                        "groups are not comparable; add comparisons between the groups")
    games: dict[str, int] = {}
    for i, j, _ in comps:
        games[i], games[j] = games.get(i, 0) + 1, games.get(j, 0) + 1
    anchor = anchor or max(sorted(games), key=lambda m: games[m])
    if anchor not in games:
        raise UserError(f"anchor='{anchor}' is in no comparison (models: {', '.join(sorted(games))})")
    fit = bradley_terry(comps, anchor=anchor)
    models = [r["model"] for r in fit["ranking"]]
    out = {"anchor": anchor, "comparisons": len(comps), "ranking": fit["ranking"], "win_prob": fit["win_prob"],
           "confidence": confidence, "resamples": resamples}
    for r in out["ranking"]:
        r["undefeated_or_winless"] = r["losses"] + r["ties"] == 0 or r["wins"] + r["ties"] == 0
    if resamples:
        rng = np.random.default_rng(seed)
        elos = {m: [] for m in models}
        ranks = {m: [] for m in models}
        for _ in range(resamples):
            sample = [comps[k] for k in rng.integers(0, len(comps), len(comps))]
            present = {m for i, j, _ in sample for m in (i, j)}
            if present != set(models) or anchor not in present or len(components(sample)) > 1:
                continue  # a resample that lost a model or split the graph cannot place everyone: skipped, counted
            got = {r["model"]: r for r in bradley_terry(sample, anchor=anchor)["ranking"]}
            order = sorted(models, key=lambda m: -got[m]["elo"])
            for m in models:
                elos[m].append(got[m]["elo"])
                ranks[m].append(order.index(m) + 1)
        a = (1 - confidence) / 2
        out["resamples_used"] = len(elos[models[0]])
        for r in out["ranking"]:
            e, k = elos[r["model"]], ranks[r["model"]]
            if e:
                r["elo_low"], r["elo_high"] = (float(x) for x in np.quantile(e, [a, 1 - a]))
                r["rank_low"], r["rank_high"] = (int(x) for x in np.quantile(k, [a, 1 - a], method="nearest"))
    return out


def print_ranking(r: dict, skipped: int) -> None:
    pct = round(100 * r["confidence"])
    boot = (f"{pct}% percentile bootstrap over comparisons ({r.get('resamples_used', 0)} of {r['resamples']} resamples used)"
            if r["resamples"] else "no intervals (bootstrap=0)")
    print(f"Bradley–Terry over {r['comparisons']} comparisons of {len(r['ranking'])} models (ties count half; "
          f"anchor {r['anchor']} = 1000 Elo); {boot}" + (f"; {skipped} within-policy rows skipped" if skipped else ""))
    width = max(len(x["model"]) for x in r["ranking"])
    print(f"  rank  {'model'.ljust(width)}  {'Elo':>7}  interval          rank range  wins  ties  losses")
    for n, x in enumerate(r["ranking"], 1):
        iv = f"[{x['elo_low']:7.1f}, {x['elo_high']:7.1f}]" if "elo_low" in x else " " * 18
        rr = f"{x['rank_low']}–{x['rank_high']}" if "rank_low" in x else ""
        flag = "  (won or lost every game: strength unbounded, held by the L2 penalty)" if x["undefeated_or_winless"] else ""
        print(f"  {n:>4}  {x['model'].ljust(width)}  {x['elo']:7.1f}  {iv}  {rr:>10}  {x['wins']:4g}  {x['ties']:4d}  {x['losses']:6g}{flag}")


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        parse_args(RankConfig, ["--help"], prog="posttrain eval rank FILE [FILE ...]")
    rest, paths = split_args(RankConfig, argv)
    if not paths:
        raise UserError("usage: posttrain eval rank FILE [FILE ...] [anchor=MODEL] [bootstrap=1000] [output=rank.json] "
                        "(files from `posttrain label`, or rows with model_a, model_b, winner)")
    cfg = parse_args(RankConfig, rest, prog="posttrain eval rank FILE [FILE ...]")
    comps, skipped = read_comparisons(paths)
    result = rank(comps, cfg.anchor, cfg.bootstrap, cfg.confidence, cfg.seed)
    result["skipped_within_policy"] = skipped
    print_ranking(result, skipped)
    if cfg.output:
        Path(cfg.output).write_text(json.dumps(result, indent=1))
    return 0
