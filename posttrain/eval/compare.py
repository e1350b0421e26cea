"""`posttrain eval compare A/results.json B/results.json`: is B's score different from A's?

It answers the question a benchmark asks first: would B beat A on problems like these? Problems are the
unit (paired by item id), so the tests over problems lead:
- paired bootstrap over problems (`stats.paired_bootstrap`): the difference B − A of the metric, its
  interval and p-value;
- sign-flip randomization test over problems (`stats.sign_flip_test`): each problem's difference is as
  likely to have either sign under "same model"; exact for few problems.
"significant" is decided by the bootstrap over problems.

Then, labelled as conditional on these problems: exact McNemar over paired samples (pass@1 only): sample
j of problem i under A paired with sample j of problem i under B; b = A right and B wrong, c = the
reverse. Given the problems, samples are independent draws, so under "same model" each discordant pair
falls either way with probability 1/2: a test of the two models *on these very problems*, whose p-value
shrinks with the samples drawn per problem (27 problems x 16 samples: p = 3e-84 beside the bootstrap's
1e-4); it says nothing about other problems.

Protocols (data, chat template, system prompt, few-shot, sampling, n, reward, extraction) must
match: a difference is refused, or with `allow_protocol_diff=true` reported as a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from posttrain.config import Config, parse_args, split_args
from posttrain.data.formats import check_not_input
from posttrain.errors import UserError
from posttrain.eval import protocol as P
from posttrain.eval import stats
from posttrain.outputs import check_output_file, write_json


class CompareConfig(Config):
    """posttrain eval compare A/results.json B/results.json: difference B − A with interval and p-values."""

    metric: str = Field("pass@1", description="per-problem metric to compare (pass@k, cons@k, pass^k, mean@n)")
    allow_protocol_diff: bool = Field(False, description="compare even when the protocols differ (the differences are printed as warnings)")
    confidence: float = Field(0.95, gt=0, lt=1, description="interval coverage; 'significant' means p < 1 − confidence")
    bootstrap: int = Field(10000, ge=100, description="paired bootstrap resamples over problems")
    seed: int = Field(0, description="bootstrap seed")
    output: str = Field("", description="also write the comparison as JSON to this file")
    curve: bool = Field(False, description="also overlay pass@k of A and B at every k up to the smallest n (unbiased estimator), "
                                           "the paired interval of B − A at each k, and say sharpening / expanding / unclear")
    report: str = Field("", description="curve=true: also write the overlay as an HTML page (inline SVG) to this file")


def load_results(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise UserError(f"{path}: no such results file (posttrain eval writes OUTPUT_DIR/results.json)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or not str(doc.get("format", "")).startswith("posttrain.eval/"):
        raise UserError(f"{path}: not a posttrain eval results file (no 'format': 'posttrain.eval/…')")
    check_results(doc, path)
    doc["_path"] = str(path)
    return doc


def _short(value, width: int = 60) -> str:
    text = repr(value).replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 1] + "…"


def check_results(doc: dict, path: Path) -> None:
    """The parts of a results file a comparison reads: refused naming the first one missing or malformed."""
    proto = doc.get("protocol")
    if not isinstance(proto, dict) or not isinstance(proto.get("model"), dict):
        raise UserError(f"{path}: no 'protocol' with its 'model' (a results.json of posttrain eval has both); rerun the "
                        "evaluation, or restore the file")
    items = doc.get("items")
    if not isinstance(items, list) or not items:
        raise UserError(f"{path}: no 'items' (the per-problem outcomes a comparison pairs); rerun the evaluation, or restore the file")
    for i, it in enumerate(items):
        if not isinstance(it, dict) or "id" not in it:
            raise UserError(f"{path}: items[{i}] has no 'id' (problems are paired by id)")
    if doc.get("unscored"):
        raise UserError(f"{path}: no sample of this evaluation was scored ({doc['unscored']}): there is nothing to compare")


def paired_items(a: dict, b: dict, allow: bool) -> tuple[list[dict], list[dict], list[str]]:
    ia, ib = {it["id"]: it for it in a["items"]}, {it["id"]: it for it in b["items"]}
    common = [i for i in ia if i in ib]
    warnings = []
    if len(common) != len(ia) or len(common) != len(ib):
        msg = f"the results hold different problems ({len(ia)} and {len(ib)}, {len(common)} in common)"
        if not allow or not common:
            raise UserError(msg + ("" if common else "; nothing to pair"))
        warnings.append(msg + ": comparing the common ones")
    return [ia[i] for i in common], [ib[i] for i in common], warnings


def mcnemar_counts(xa: list[dict], xb: list[dict]) -> tuple[int, int] | None:
    """(b, c) over paired samples, or None when the per-sample outcomes do not pair (different n)."""
    b = c = 0
    for ia, ib in zip(xa, xb):
        ra, rb = ia.get("correct"), ib.get("correct")
        if ra is None or rb is None or len(ra) != len(rb) or not ra:
            return None
        b += sum(1 for x, y in zip(ra, rb) if x and not y)
        c += sum(1 for x, y in zip(ra, rb) if y and not x)
    return b, c


def compare(a: dict, b: dict, metric: str = "pass@1", allow_protocol_diff: bool = False, confidence: float = 0.95,
            resamples: int = 10000, seed: int = 0, curve: bool = False) -> dict:
    """The comparison of results B against A (dicts as written by `posttrain eval`); `curve`: add pass@k at every k
    with the sharpening / expanding verdict (eval/curve.py)."""
    diffs = P.differences(a["protocol"], b["protocol"])
    if diffs and not allow_protocol_diff:  # one line: the keys, then each difference cut short
        what = "; ".join(f"{k}: {_short(va)} vs {_short(vb)}" for k, va, vb in diffs)
        raise UserError(f"the protocols differ in {', '.join(k for k, _, _ in diffs)}, so the scores are not comparable "
                        f"({what}); pass allow_protocol_diff=true to compare anyway")
    warnings = [f"protocol differs: {k}: {va!r} vs {vb!r}"[:300] for k, va, vb in diffs]
    xa, xb, more = paired_items(a, b, allow_protocol_diff)
    warnings += more
    if metric not in xa[0] or metric not in xb[0]:
        have = sorted(k for k in xa[0] if k in xb[0] and ("@" in k or "^" in k))
        raise UserError(f"metric '{metric}' is not in both results (both have: {', '.join(have)})")
    va, vb = [it[metric] for it in xa], [it[metric] for it in xb]
    boot = stats.paired_bootstrap(va, vb, confidence, resamples, seed)
    _, nlow, nhigh = stats.normal_interval([y - x for x, y in zip(va, vb)], confidence)
    out = {"metric": metric, "a": {"path": a.get("_path"), "model": a["protocol"]["model"]["name"], "seed": a["protocol"]["seed"],
                                   "value": sum(va) / len(va)},
           "b": {"path": b.get("_path"), "model": b["protocol"]["model"]["name"], "seed": b["protocol"]["seed"], "value": sum(vb) / len(vb)},
           "confidence": confidence, "bootstrap": boot, "normal": {"low": nlow, "high": nhigh}, "warnings": warnings}
    out["sign_flip"] = stats.sign_flip_test([y - x for x, y in zip(va, vb)], resamples, seed)
    counts = mcnemar_counts(xa, xb) if metric == "pass@1" else None
    if counts is not None:
        out["mcnemar"] = {"b": counts[0], "c": counts[1], "pairs": sum(len(it["correct"]) for it in xa),
                          "p_value": stats.mcnemar_exact(*counts), "conditional_on": "these problems",
                          "scope": "samples paired within each problem: the two models on these very problems, "
                                   "not problems like these"}
    alpha = 1 - confidence
    out["significant"] = boot["p_value"] < alpha  # over problems: the question a benchmark asks
    if curve:
        from posttrain.eval.curve import curve_compare

        out["curve"] = curve_compare(xa, xb, str(a.get("_path", "A")), str(b.get("_path", "B")), confidence, resamples, seed)
    return out


def print_comparison(r: dict) -> None:
    pct = round(100 * r["confidence"])
    for w in r["warnings"]:
        print(f"warning: {w}")
    for side in ("a", "b"):
        s = r[side]
        print(f"{side.upper()}: {s['path']}  {r['metric']} = {s['value']:.4f}  (model {s['model']}, seed {s['seed']})")
    bt, sf = r["bootstrap"], r["sign_flip"]
    print(f"over problems (the unit; generalises to problems like these, {bt['items']} of them):")
    print(f"  B − A = {bt['diff']:+.4f}  {pct}% paired bootstrap interval [{bt['low']:+.4f}, {bt['high']:+.4f}], "
          f"p = {bt['p_value']:.4g} ({bt['resamples']} resamples)")
    print(f"  sign-flip test over problems p = {sf['p_value']:.4g} ({sf['method']}, {sf['nonzero']} problems differ)")
    print(f"  normal interval over problems [{r['normal']['low']:+.4f}, {r['normal']['high']:+.4f}]")
    if "mcnemar" in r:
        m = r["mcnemar"]
        print("conditional on these problems (samples paired within each problem; says nothing about other problems):")
        print(f"  exact McNemar over {m['pairs']} paired samples: A right/B wrong {m['b']}, A wrong/B right {m['c']}, "
              f"p = {m['p_value']:.4g}")
    verdict = "significantly different" if r["significant"] else "not significantly different"
    print(f"=> {verdict} over problems at α = {1 - r['confidence']:.2g} (paired bootstrap)")
    if "curve" in r:
        from posttrain.eval.curve import print_curve

        print_curve(r["curve"])


def _is_path(arg: str, keys: set[str]) -> bool:
    """A `word=...` argument that is a path: an existing file or folder, or a key part no option has ('/' in it)."""
    key = arg.split("=", 1)[0].lstrip("-")
    return "=" in arg and key not in keys and ("/" in key or Path(arg).exists())


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        parse_args(CompareConfig, ["--help"], prog="posttrain eval compare A/results.json B/results.json")
    rest, paths = split_args(CompareConfig, argv)  # `--metric pass@4` is a key and its value, not a path
    keys = set(CompareConfig.model_fields)
    paths += [a for a in rest if _is_path(a, keys)]  # runs/lr=1e-4/results.json is a path, not key=value
    rest = [a for a in rest if not _is_path(a, keys)]
    if len(paths) != 2:
        got = f" (got {len(paths)}: {' '.join(paths)})" if paths else ""
        raise UserError("usage: posttrain eval compare A/results.json B/results.json [allow_protocol_diff=true] "
                        f"[metric=pass@1]: give two results files or eval folders{got}")
    cfg = parse_args(CompareConfig, rest, prog="posttrain eval compare A/results.json B/results.json")
    files = {side: Path(p) / "results.json" if Path(p).is_dir() else Path(p) for side, p in zip("AB", paths)}
    check_not_input(cfg.output, {f"results {k}": v for k, v in files.items()})
    check_not_input(cfg.report, {f"results {k}": v for k, v in files.items()}, "report")
    if cfg.output:
        check_output_file(cfg.output)
    result = compare(load_results(paths[0]), load_results(paths[1]), cfg.metric, cfg.allow_protocol_diff,
                     cfg.confidence, cfg.bootstrap, cfg.seed, curve=cfg.curve)
    print_comparison(result)
    if cfg.report:
        if not cfg.curve:
            raise UserError("report= writes the pass@k overlay: give curve=true with it")
        from posttrain.eval.curve import write_curve_html

        print(f"report: {write_curve_html(cfg.report, result)}")
    if cfg.output:
        write_json(cfg.output, result)
    return 0
