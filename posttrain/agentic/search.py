"""A mock search engine over a local document set (no network): BM25 over lower-cased word tokens.

Documents are `{"title", "text"}` records, given as a list or read from a JSONL file. A query
returns the top-k titles with a snippet each; an empty result says so. Read-only: the tool can
reach only the documents it was built with.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

from posttrain.errors import DataError, UserError

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def load_documents(source) -> list[dict]:
    """A list of {"title", "text"} or a JSONL file of them; every record is checked."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"search documents: {path} not found (a .jsonl file of {{title, text}})")
        docs = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    docs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(str(path), number, None, f"invalid JSON ({e.msg})") from None
        where = str(path)
    else:
        docs, where = list(source), "documents"
    for i, d in enumerate(docs):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str):
            raise DataError(where, i + 1, "text", "each document needs a string 'text' (and optionally 'title')")
    return docs


class MockSearch:
    """BM25 (k1 = 1.2, b = 0.75) over the documents' title + text."""

    def __init__(self, documents, top_k: int = 3, snippet_chars: int = 200, k1: float = 1.2, b: float = 0.75):
        self.docs = load_documents(documents)
        self.top_k, self.snippet_chars, self.k1, self.b = top_k, snippet_chars, k1, b
        self.tf = [Counter(words(d.get("title", "") + " " + d["text"])) for d in self.docs]
        self.lengths = [sum(c.values()) for c in self.tf]
        self.avg = sum(self.lengths) / max(len(self.lengths), 1)
        df = Counter(w for c in self.tf for w in c)
        n = len(self.docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}

    def scores(self, query: str) -> list[float]:
        q = words(query)
        out = []
        for tf, length in zip(self.tf, self.lengths):
            s = 0.0
            for w in q:
                f = tf.get(w, 0)
                if f:
                    s += self.idf[w] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * length / (self.avg or 1)))
            out.append(s)
        return out

    def __call__(self, query: str) -> str:
        scored = sorted(((s, i) for i, s in enumerate(self.scores(query)) if s > 0), key=lambda x: (-x[0], x[1]))
        if not scored:
            return f"no results for {query!r}"
        lines = []
        for rank, (_, i) in enumerate(scored[: self.top_k], start=1):
            d = self.docs[i]
            text = d["text"] if len(d["text"]) <= self.snippet_chars else d["text"][: self.snippet_chars] + "..."
            lines.append(f"[{rank}] {d.get('title', f'document {i}')}: {text}")
        return "\n".join(lines)
