"""`posttrain eval contamination mode=completion model=… eval=…`: a memorisation probe. Each evaluation item's text
is cut after a `prefix` share of its tokens (0.5: the first half); the model continues the prefix greedily for as
many tokens as the rest has, and the continuation is compared with the rest:

    exact    the continuation is the rest (whitespace-normalised text equal)
    near     token edit similarity 1 − Lev(continuation, rest) / max(|continuation|, |rest|) ≥ `threshold` (0.8)

A model that saw the benchmark in training tends to reproduce it verbatim from a prefix (Carlini et al. 2023,
"Quantifying Memorization Across Neural Language Models", extraction from a prefix; applied to benchmark
contamination by e.g. Golchin & Surdeanu 2024, "Time Travel in LLMs"). Reported: the exact and near match rates
over the probed items with Wilson intervals, the mean similarity, and the `worst` items (highest similarity).
Items shorter than `min_tokens` tokens are skipped (counted). Read the rates against a baseline: text every item
shares (a template such as "Answer with just the number.") is continued correctly by any model that read the
prompt, so probe fields that differ per item, or compare with a model that cannot have seen the set.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.eval import stats


def row_texts(value) -> list[str]:
    """Every string inside a row (nested lists and dicts), in order; `role` keys skipped. eval/contamination.py
    (the n-gram mode, which dispatches mode=completion here) reads rows with it too."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() if k != "role" for t in row_texts(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in row_texts(v)]
    return []


def edit_distance(a: list, b: list) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one element, each cost 1). O(|a|·|b|)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def edit_similarity(a: list, b: list) -> float:
    """1 − Lev(a, b) / max(|a|, |b|) in [0, 1]; 1 for two empty sequences."""
    m = max(len(a), len(b))
    return 1.0 if m == 0 else 1.0 - edit_distance(a, b) / m


def item_text(row: dict, fields: tuple[str, ...]) -> str:
    """The probed text of a row: its `fields` (every string in them, e.g. a conversation's contents), one per line."""
    picked = {k: row[k] for k in fields if k in row} or row
    return "\n".join(t for t in row_texts(picked) if t.strip())


def split_ids(tok, text: str, prefix: float) -> tuple[list[int], list[int]]:
    """(prompt ids: the tokenizer's leading special tokens + the first ⌈prefix·T⌉ − … tokens, the rest's ids); T = the
    text's tokens without special tokens; the cut keeps at least one token on each side."""
    plain = tok.encode(text, add_special_tokens=False)
    full = tok.encode(text, add_special_tokens=True)
    lead = full[:len(full) - len(plain)] if len(full) > len(plain) and full[len(full) - len(plain):] == plain else []
    cut = min(max(1, round(prefix * len(plain))), len(plain) - 1)
    return lead + plain[:cut], plain[cut:]


def _norm(text: str) -> str:
    return " ".join(text.split())


def probe(texts: list[str], ids: list, tok, generate, prefix: float = 0.5, threshold: float = 0.8, min_tokens: int = 8,
          worst: int = 10, confidence: float = 0.95) -> dict:
    """Run the probe. `generate([(prompt_ids, max_new_tokens)]) -> [continuation ids]` (greedy); `ids[i]` names item i."""
    jobs, probed, skipped = [], [], 0
    for i, text in enumerate(texts):
        if len(tok.encode(text, add_special_tokens=False)) < min_tokens:
            skipped += 1
            continue
        head, rest = split_ids(tok, text, prefix)
        jobs.append((head, len(rest)))
        probed.append((i, head, rest))
    conts = generate(jobs) if jobs else []
    items = []
    for (i, head, rest), cont in zip(probed, conts):
        cont = list(cont)[:len(rest)]
        sim = edit_similarity(cont, rest)
        rest_text, cont_text = tok.decode(rest), tok.decode(cont)
        items.append({"index": i, "id": ids[i], "prefix": tok.decode(head, skip_special_tokens=True), "rest": rest_text,
                      "continuation": cont_text, "rest_tokens": len(rest), "similarity": sim,
                      "exact": _norm(cont_text) == _norm(rest_text), "near": sim >= threshold})
    out = {"mode": "completion", "prefix": prefix, "threshold": threshold, "items_probed": len(items),
           "items_skipped": skipped, "min_tokens": min_tokens, "confidence": confidence, "items": items}
    for key in ("exact", "near"):
        hits = sum(it[key] for it in items)
        low, high = stats.wilson_interval(hits, len(items), confidence) if items else (0.0, 1.0)
        out[f"{key}_rate"] = {"value": hits / len(items) if items else 0.0, "low": low, "high": high, "count": hits}
    out["mean_similarity"] = sum(it["similarity"] for it in items) / len(items) if items else 0.0
    out["worst"] = sorted(items, key=lambda it: (-it["similarity"], it["index"]))[:worst]
    return out


def engine_generate(backend):
    """The probe's `generate` over a posttrain generation backend: greedy, one sample per prompt."""
    from posttrain.rollout.types import Request, SamplingParams

    def run(jobs):
        reqs = [Request(head, SamplingParams(n=1, temperature=0.0, max_new_tokens=max(1, m)), request_id=i)
                for i, (head, m) in enumerate(jobs)]
        outs = backend.generate(reqs)
        return [list(o.samples[0].token_ids) if o.samples else [] for o in outs]

    return run


def run_completion(cfg) -> dict:
    """mode=completion from a ContaminationConfig: rows, model, probe, print."""
    from posttrain.data.formats import read_rows
    from posttrain.errors import UserError
    from posttrain.models.loading import load_tokenizer
    from posttrain.rollout.cli import GenerateConfig, make_backend

    if not cfg.eval or not cfg.model:
        raise UserError("usage: posttrain eval contamination mode=completion model=MODEL eval=EVAL [prefix=0.5] "
                        "[threshold=0.8] [output=probe.json]")
    rows = [r.data for r in read_rows(cfg.eval)]
    if not rows:
        raise UserError(f"{cfg.eval}: no evaluation rows to probe")
    texts = [item_text(r, tuple(cfg.fields)) for r in rows]
    tok = load_tokenizer(cfg.model)
    backend = make_backend(GenerateConfig(model=cfg.model, backend=cfg.backend, dtype=cfg.dtype, device=cfg.device,
                                          max_model_len=cfg.max_model_len), tok)
    rep = probe(texts, [r.get("id", i + 1) for i, r in enumerate(rows)], tok, engine_generate(backend), cfg.prefix,
                cfg.threshold, cfg.min_tokens, cfg.worst)
    print_probe(rep, cfg.model, cfg.eval)
    if cfg.output:
        Path(cfg.output).write_text(json.dumps({"model": cfg.model, "eval": cfg.eval, **rep}, indent=1, ensure_ascii=False))
    return rep


def print_probe(rep: dict, model: str, source: str) -> None:
    pct = round(100 * rep["confidence"])
    print(f"memorisation probe of {model} on {source}: {rep['items_probed']} items, first {rep['prefix']:.0%} of each "
          f"as the prompt, greedy continuation vs the rest" + (f" ({rep['items_skipped']} shorter than {rep['min_tokens']} "
                                                                 "tokens skipped)" if rep["items_skipped"] else ""))
    for key, what in (("exact", "exact match"), ("near", f"near match (edit similarity >= {rep['threshold']:g})")):
        r = rep[f"{key}_rate"]
        print(f"  {what}: {r['value']:.3f} [{r['low']:.3f}, {r['high']:.3f}] {pct}% Wilson ({r['count']} items)")
    print(f"  mean edit similarity {rep['mean_similarity']:.3f}; most similar items:")
    for it in rep["worst"]:
        print(f"    item {it['id']}: similarity {it['similarity']:.2f}{' (exact)' if it['exact'] else ''}: "
              f"{it['prefix'][-40:]!r} -> {it['continuation'][:60]!r} (rest {it['rest'][:60]!r})")
