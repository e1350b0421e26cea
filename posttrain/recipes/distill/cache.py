"""The top-k teacher cache of logit-level distillation: computed once, memory-mapped, reused.

For every loss token of the data (a target the student is trained to predict), in data order:

    ids    (N, k)     uint16 (vocabulary ≤ 65,536) or int32: the teacher's k most probable next tokens
    logps  (N, k + 1) float16 (or float32): their log-probs at the distillation temperature, then
                      log of the tail mass Σ_{v∉top-k} P(v) (the bucket that makes the KL exact on the
                      coarser partition top-k ∪ {rest}: posttrain/algos/distill.py)

Bytes per token = k × (id + value) + value: 64 × (2 + 2) + 2 = 258 B for SmolLM2's 49,152-token
vocabulary, against V × 2 = 96 KiB for its full logits in 16 bits (the planner's reference
value, docs/planner.md: top-64 ≈ 256 B/token vs 256 KB for a 128K vocabulary; the 2 extra bytes are the tail).

The folder is named by a key hashing the teacher (its files' contents), the tokenized data, k, the
temperature and the dtypes, and lives next to the run (`<output_dir>/../teacher-cache/<key>/` unless
`cache_dir` says otherwise), so a second epoch, a resumed run and any later run on the same data and
teacher read it instead of loading the teacher. It is written into a temporary folder and renamed when
complete: a half-written cache is never read. `teacher_tokens` counts the tokens this process scored
with the teacher, `read_tokens` the rows read back (the proof of reuse in the run's metrics).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from posttrain.data.packing import IGNORE, collate
from posttrain.recipes.distill.teacher import position_logits

VALUE_DTYPES = {"float16": np.float16, "float32": np.float32}


def id_dtype(vocab: int):
    return np.uint16 if vocab <= 2**16 else np.int32


def bytes_per_token(vocab: int, k: int, value_dtype: str = "float16") -> int:
    """k × (id bytes + value bytes) + value bytes (the tail)."""
    vb = np.dtype(VALUE_DTYPES[value_dtype]).itemsize
    return k * (np.dtype(id_dtype(vocab)).itemsize + vb) + vb


def cache_key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def loss_token_counts(samples) -> list[int]:
    """Loss tokens per sample, in the order `collate` lays their targets out (position t predicts t + 1)."""
    return [sum(s.loss_mask[1:]) for s in samples]


def topk_with_tail(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (M, V) -> (ids (M, k), top-k log-probs (M, k), log tail mass (M,)), fp32 throughout:
    log Σ_{v∉S} P(v) is a logsumexp over the rest, not log(1 − Σ_S P) (which cancels catastrophically)."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    k = min(k, lp.shape[-1])
    top, ids = lp.topk(k, dim=-1)
    tail = torch.logsumexp(lp.scatter(-1, ids, float("-inf")), dim=-1)  # -inf when k = V
    return ids, top, tail


class TeacherCache:
    """A complete cache folder, memory-mapped read-only."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        n, k = self.meta["tokens"], self.meta["k"]
        self.ids = np.memmap(self.path / "ids.bin", dtype=self.meta["id_dtype"], mode="r", shape=(n, k))
        self.logps = np.memmap(self.path / "logps.bin", dtype=self.meta["value_dtype"], mode="r", shape=(n, k + 1))
        self.offsets = np.concatenate([[0], np.cumsum(self.meta["counts"])]).astype(np.int64)
        self.read_tokens = 0

    @property
    def bytes_on_disk(self) -> int:
        return (self.path / "ids.bin").stat().st_size + (self.path / "logps.bin").stat().st_size

    def rows_of(self, sample_indices: list[int]) -> np.ndarray:
        """Cache row numbers of the loss tokens of these samples, in collate order  # (M,)."""
        return np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in sample_indices] or [np.zeros(0, np.int64)])

    def read(self, rows: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids (M, k) long, top-k log-probs (M, k) fp32, log tail (M,) fp32) for cache rows."""
        self.read_tokens += len(rows)
        ids = torch.from_numpy(self.ids[rows].astype(np.int64)).to(device)
        lp = torch.from_numpy(self.logps[rows].astype(np.float32)).to(device)
        return ids, lp[:, :-1], lp[:, -1]


def build(path: Path, teacher, samples, *, k: int, temperature: float, value_dtype: str, vocab: int,
          pad_id: int, mixed_precision: str, token_budget: int, device) -> tuple[TeacherCache, int, float]:
    """Score every sample's loss tokens with the teacher and write the cache folder atomically.
    Returns (cache, tokens scored, seconds)."""
    counts = loss_token_counts(samples)
    n = sum(counts)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ids = np.memmap(tmp / "ids.bin", dtype=id_dtype(vocab), mode="w+", shape=(max(n, 1), k))
    logps = np.memmap(tmp / "logps.bin", dtype=VALUE_DTYPES[value_dtype], mode="w+", shape=(max(n, 1), k + 1))
    t0, row, was_training = time.perf_counter(), 0, teacher.training
    teacher.eval()
    for chunk in _chunks(samples, token_budget):
        batch = collate([[s] for s in chunk], pad_id, packed=False).to(device)
        sel = (batch.targets != IGNORE).reshape(-1).nonzero().squeeze(1)  # row-major: sample by sample
        top_ids, top, tail = topk_with_tail(position_logits(teacher, batch, mixed_precision, sel), k, temperature)
        m = len(sel)
        ids[row : row + m] = top_ids.cpu().numpy().astype(ids.dtype)
        logps[row : row + m, :k] = top.cpu().numpy()
        logps[row : row + m, k] = tail.cpu().numpy()
        row += m
    teacher.train(was_training)
    assert row == n, (row, n)
    ids.flush()
    logps.flush()
    del ids, logps
    meta = {"tokens": n, "k": k, "counts": counts, "temperature": temperature, "vocab": vocab,
            "id_dtype": np.dtype(id_dtype(vocab)).name, "value_dtype": value_dtype,
            "bytes_per_token": bytes_per_token(vocab, k, value_dtype)}
    (tmp / "meta.json").write_text(json.dumps(meta))
    seconds = time.perf_counter() - t0
    if path.exists():  # another run finished the same cache first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(path)
    return TeacherCache(path), n, seconds


def _chunks(samples, token_budget: int):
    out, used = [], 0
    for s in samples:
        if out and used + len(s) > token_budget:
            yield out
            out, used = [], 0
        out.append(s)
        used += len(s)
    if out:
        yield out


def open_cache(path: Path) -> TeacherCache | None:
    """The complete cache at `path`, or None (absent, or a different layout)."""
    return TeacherCache(path) if (Path(path) / "meta.json").is_file() else None
