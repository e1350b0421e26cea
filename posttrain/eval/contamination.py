"""`posttrain eval contamination train=… eval=… [n=13]`: n-gram overlap between a training set and an
evaluation set, per evaluation item and overall (`mode=completion model=…`: the memorisation probe of
eval/memorization.py instead).

Text is normalised as in the GPT-3 contamination study (Brown et al. 2020, appendix C): lower case,
punctuation dropped, split into words. An evaluation item is *contaminated* when any of its word
n-grams (n = 13 by default) occurs anywhere in the training text; an item shorter than n words is
checked as a whole (its full word sequence must occur in a training row). Reported per item: its
n-grams found in training / its n-grams; overall: the share of contaminated items and of all
evaluation n-grams found. The text of a training row is every string in it (prompt, messages'
contents, completion, answer, …); of an evaluation row, its `prompt` (what the model is asked; every
string when it has none, or the columns named in `fields`). N-grams never cross fields or messages.
A field shorter than `min_words` (8, GPT-3's smallest N) is too short to tell anything and is skipped.
"""

from __future__ import annotations

import hashlib
import re

from pydantic import Field, field_validator

from posttrain.config import Config, parse_args
from posttrain.data.formats import check_not_input, read_rows
from posttrain.errors import UserError
from posttrain.eval.memorization import row_texts  # every string of a row, `role` keys skipped
from posttrain.outputs import check_output_file, write_json

_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def words(text: str) -> list[str]:
    """Lower-cased words, punctuation and whitespace dropped."""
    return _WORD.findall(text.lower())




def _key(gram: list[str] | tuple[str, ...]) -> bytes:
    return hashlib.blake2b(" ".join(gram).encode(), digest_size=12).digest()


def windows(ws: list[str], m: int) -> list[bytes]:
    """Hashed m-word windows of one field."""
    return [_key(ws[i:i + m]) for i in range(len(ws) - m + 1)]


def item_grams(fields: list[list[str]], n: int, min_words: int = 8) -> list[bytes]:
    """An item's distinct n-grams; a field shorter than n words counts as one gram (its whole sequence),
    one shorter than min_words not at all. Grams never cross fields."""
    grams = [g for ws in fields if len(ws) >= min(n, min_words) for g in (windows(ws, n) if len(ws) >= n else [_key(ws)])]
    return list(dict.fromkeys(grams))


def train_index(rows: list[dict], sizes: set[int]) -> set[bytes]:
    """Hashes of every window of the given sizes in the training text (n, plus the lengths of short eval fields)."""
    index: set[bytes] = set()
    for row in rows:
        for text in row_texts(row):
            ws = words(text)
            for m in sizes:
                index.update(windows(ws, m))
    return index


def overlap(train_rows: list[dict], eval_rows: list[dict], n: int = 13, fields: tuple[str, ...] = ("prompt",),
            min_words: int = 8) -> dict:
    """{"items": [{index, id, grams, found, contaminated}], "contaminated_items", "contaminated_fraction", "gram_fraction"}."""
    pick = lambda r: {k: r[k] for k in fields if k in r} or r  # a row without the fields: all of it
    eval_fields = [[words(t) for t in row_texts(pick(r))] for r in eval_rows]
    short = {len(ws) for f in eval_fields for ws in f if min(n, min_words) <= len(ws) < n}
    index = train_index(train_rows, {n} | short)
    items, total, found_all = [], 0, 0
    for i, (row, f) in enumerate(zip(eval_rows, eval_fields)):
        grams = item_grams(f, n, min_words)
        found = sum(g in index for g in grams)
        total += len(grams)
        found_all += found
        items.append({"index": i, "id": row.get("id", i + 1), "grams": len(grams), "found": found, "contaminated": found > 0})
    dirty = sum(it["contaminated"] for it in items)
    return {"n": n, "train_rows": len(train_rows), "eval_rows": len(eval_rows), "items": items, "contaminated_items": dirty,
            "contaminated_fraction": dirty / len(items) if items else 0.0, "gram_fraction": found_all / total if total else 0.0}


def _names(value):
    """fields=question or fields=question,context (a comma list) as well as a YAML list."""
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value


def check_inputs(cfg, train: list[dict], evals: list[dict]) -> None:
    """An empty side, or fields no evaluation row has, would report 0 % contamination for nothing checked."""
    for key, rows in (("train", train), ("eval", evals)):
        if not rows:
            raise UserError(f"{key}={getattr(cfg, key)}: no rows, so there is nothing to compare; give a non-empty dataset")
    if not any(f in r for r in evals for f in cfg.fields):
        columns = sorted({k for r in evals for k in r})
        raise UserError(f"fields={','.join(cfg.fields)}: no row of eval={cfg.eval} has {'this column' if len(cfg.fields) == 1 else 'these columns'} "
                        f"(its columns: {', '.join(columns)}); name the text to check, e.g. fields={columns[0] if columns else 'prompt'}")


def check_report(cfg, rep: dict) -> None:
    if rep["eval_rows"] and not any(it["grams"] for it in rep["items"]):
        raise UserError(f"no evaluation item of {cfg.eval} has a field of at least min_words={cfg.min_words} words "
                        f"(fields={','.join(cfg.fields)}): nothing was checked; lower min_words or name longer fields")


class ContaminationConfig(Config):
    """posttrain eval contamination: n-gram overlap of an evaluation set with a training set."""

    train: str = Field("", description="training data: file, datasets folder or task")
    eval: str = Field("", description="evaluation data: file, datasets folder or task")
    n: int = Field(13, ge=1, description="words per n-gram (13: GPT-3's contamination check)")
    fields: list[str] = Field(default_factory=lambda: ["prompt"], description="columns of an evaluation row to check (a row without them: every string in it); training rows: every string")
    min_words: int = Field(8, ge=1, description="fields shorter than this many words are skipped (too short to tell)")
    output: str = Field("", description="write the per-item report as JSON here")
    mode: str = Field("ngram", pattern="^(ngram|completion)$", description="ngram: n-gram overlap with train= (GPT-3); "
                      "completion: memorisation probe of model= (prefix -> greedy continuation vs the rest; eval/memorization.py)")
    model: str = Field("", description="mode=completion: the model probed (HF folder, built-in name or Hub id)")
    prefix: float = Field(0.5, gt=0, lt=1, description="mode=completion: share of each item's tokens given as the prompt")
    threshold: float = Field(0.8, gt=0, le=1, description="mode=completion: near match when token edit similarity >= this")
    min_tokens: int = Field(8, ge=2, description="mode=completion: items with fewer tokens are skipped")
    worst: int = Field(10, ge=0, description="mode=completion: how many most-similar items to print")
    backend: str = Field("auto", description="mode=completion: generation backend (auto | builtin | hf | vllm)")
    dtype: str = Field("float32", description="mode=completion: model dtype")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="mode=completion: auto | cpu | cuda | cuda:N")
    max_model_len: int = Field(2048, ge=2, description="mode=completion: prompt + continuation tokens per item")

    @field_validator("fields", mode="before")
    @classmethod
    def _fields(cls, v):
        return _names(v)


def main(argv: list[str]) -> int:
    cfg = parse_args(ContaminationConfig, argv, prog="posttrain eval contamination")
    if cfg.mode == "completion":  # the memorisation probe (eval/memorization.py)
        from posttrain.eval.memorization import run_completion

        run_completion(cfg)
        return 0
    if not cfg.train or not cfg.eval:
        raise UserError("usage: posttrain eval contamination train=TRAIN eval=EVAL [n=13] [output=contamination.json]")
    if cfg.output:
        check_output_file(cfg.output)
    check_not_input(cfg.output, {"train=": cfg.train, "eval=": cfg.eval})
    train = [r.data for r in read_rows(cfg.train)]
    evals = [r.data for r in read_rows(cfg.eval)]
    check_inputs(cfg, train, evals)
    rep = overlap(train, evals, cfg.n, tuple(cfg.fields), cfg.min_words)
    check_report(cfg, rep)
    print(f"{rep['contaminated_items']} of {rep['eval_rows']} evaluation items share a {cfg.n}-gram with the "
          f"{rep['train_rows']} training rows ({100 * rep['contaminated_fraction']:.1f}%); "
          f"{100 * rep['gram_fraction']:.1f}% of evaluation {cfg.n}-grams occur in training")
    for it in [x for x in rep["items"] if x["contaminated"]][:10]:
        print(f"  item {it['id']}: {it['found']} of {it['grams']} n-grams found")
    if cfg.output:
        write_json(cfg.output, {"train": cfg.train, "eval": cfg.eval, **rep})
    return 0
