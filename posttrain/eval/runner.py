"""Run evaluation items through a generation backend and the verifiers: per-sample outcomes.

    results, timing = generate_and_score(backend, items, reward_fn, sampling, n, seed, threshold, extraction)

With the built-in engine the verifier scores while the engine decodes: the engine hands each
problem's output over as soon as its last sample finishes (`Engine.generate(on_output=...)`), a
scoring thread sends it to the verifier's worker pool, and only the last batch is scored after
generation ends. The HF and vLLM backends generate everything first, then score.

For cons@k the final answer of every sample is extracted the way the math reward does it (same
mode / required format), and the answers of one problem are grouped by the verifier's equivalence
in a pool worker (`metrics.cluster_answers`); a grouping that times out falls back to exact
(normalised) string equality and is counted.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from posttrain.eval.prompts import Item
from posttrain.rewards.answers import MATH_REQUIRE, cluster_answers, exact_classes, extract_answer, extraction_settings  # noqa: F401 - re-exported
from posttrain.rollout import signals
from posttrain.rollout.cli import GenerateConfig
from posttrain.rollout.cli import make_backend as generate_backend
from posttrain.rollout.settings import SamplingSettings
from posttrain.rollout.types import Request, RequestOutput


@dataclass
class Sample:
    text: str
    tokens: int
    finish_reason: str
    score: float | None = None
    correct: bool = False
    answer: str | None = None
    error: str | None = None


@dataclass
class ItemResult:
    item: Item
    samples: list[Sample] = field(default_factory=list)
    classes: list[int | None] | None = None  # answer class per sample (cons@k); None without extraction
    error: str | None = None  # the backend refused the prompt

    @property
    def correct(self) -> list[bool]:
        return [s.correct for s in self.samples]


# ---------------------------------------------------------------- scoring one batch of outputs


def score_outputs(reward_fn, pairs: list[tuple[ItemResult, RequestOutput]], threshold: float, ex: dict | None,
                  pool=None) -> dict:
    """Fill the samples of each (item result, output) pair with reward, verdict, answer and classes.
    Returns counters (reward errors, cluster fallbacks)."""
    counts = {"reward_errors": 0, "cluster_fallbacks": 0}
    flat: list[tuple[ItemResult, Sample]] = []
    ids: list[list[int]] = []
    for res, out in pairs:
        if out.error:
            res.error = out.error
            continue
        res.samples = [Sample(c.text or "", len(c.token_ids), c.finish_reason) for c in out.samples]
        flat += [(res, s) for s in res.samples]
        ids += [list(c.token_ids) for c in out.samples]
    if not flat:
        return counts
    rows = [res.item.data for res, _ in flat]
    keys = {k for r in rows for k in r if k not in ("prompt", "messages")}
    columns = {k: [r.get(k) for r in rows] for k in keys}  # dataset columns per sample (TRL convention)
    columns["completion_ids"] = ids
    values = reward_fn([r["prompt"] for r in rows], [s.text for _, s in flat], **columns)
    for e in getattr(reward_fn, "last_errors", []):
        hit = range(len(flat)) if e["index"] is None else [e["index"]]
        for j in hit:
            flat[j][1].error = f"reward '{e['reward']}': {e['error'].strip().splitlines()[0] if e['error'].strip() else e['error']}"
    for (res, s), v in zip(flat, values):
        s.score = v
        s.correct = v is not None and v >= threshold
        counts["reward_errors"] += s.error is not None
        if ex is not None:
            s.answer = extract_answer(s.text, res.item.data["prompt"], ex)
    if ex is not None:
        counts["cluster_fallbacks"] = _cluster([res for res, out in pairs if not out.error], ex, pool)
    return counts


def _cluster(results: list[ItemResult], ex: dict, pool) -> int:
    """Answer classes per item, in the verifier's pool; string equality where that fails."""
    answers = [[s.answer for s in r.samples] for r in results]
    jobs = [(a, ex["use_math_verify"]) for a in answers]
    outcomes = pool.map(cluster_answers, jobs, timeout=30.0) if pool is not None and jobs else []
    fallbacks = 0
    for r, a, o in zip(results, answers, outcomes or [None] * len(results)):
        if o is not None and o.ok:
            r.classes = o.value
        else:
            fallbacks += 1
            r.classes = exact_classes(a)
    return fallbacks


# ---------------------------------------------------------------- generation with overlapped scoring


class _Scorer(threading.Thread):
    """Scores batches of finished outputs while the engine decodes (the verifier works in its pool)."""

    def __init__(self, results, reward_fn, threshold, ex, pool):
        super().__init__(daemon=True)
        self.results, self.reward_fn, self.threshold, self.ex, self.pool = results, reward_fn, threshold, ex, pool
        self.queue: queue.Queue = queue.Queue()
        self.counts = {"reward_errors": 0, "cluster_fallbacks": 0, "scoring_batches": 0}
        self.error: BaseException | None = None
        self.busy_s = 0.0

    def run(self) -> None:
        done = False
        while not done:
            batch = [self.queue.get()]
            while True:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None
            outs = [o for o in batch if o is not None]
            if not outs or self.error is not None:
                continue
            t = time.perf_counter()
            try:
                pairs = [(self.results[self._index(o)], o) for o in outs]
                c = score_outputs(self.reward_fn, pairs, self.threshold, self.ex, self.pool)
                for k, v in c.items():
                    self.counts[k] += v
                self.counts["scoring_batches"] += 1
            except BaseException as e:  # re-raised in the caller's thread
                self.error = e
            self.busy_s += time.perf_counter() - t

    @staticmethod
    def _index(out: RequestOutput) -> int:
        return int(out.request_id)


def requests_for(items: list[Item], sampling: SamplingSettings, n: int, seed: int) -> list[Request]:
    """Problem i samples with seed + i (the seeding of `posttrain generate`, so both draw the same samples)."""
    return [Request(it.prompt_ids, sampling.params(n=n, seed=seed + i), request_id=i) for i, it in enumerate(items)]


def generate_and_score(backend, items: list[Item], reward_fn, sampling: SamplingSettings, n: int, seed: int,
                       threshold: float = 1.0, ex: dict | None = None, pool=None) -> tuple[list[ItemResult], dict]:
    """Sample n completions of every item and verify them; returns per-item results and timing."""
    from posttrain.rollout.engine import Engine  # torch: this module stays torch-free

    results = [ItemResult(it) for it in items]
    requests = requests_for(items, sampling, n, seed)
    scorer = _Scorer(results, reward_fn, threshold, ex, pool)
    scorer.start()
    engine_window = signals.start(backend)
    t0 = time.perf_counter()
    try:
        if isinstance(backend, Engine):
            outs = backend.generate(requests, on_output=scorer.queue.put)
        else:
            outs = backend.generate(requests)
            for o in outs:
                scorer.queue.put(o)
    finally:
        t_gen = time.perf_counter() - t0
        scorer.queue.put(None)
        scorer.join()
    wall = time.perf_counter() - t0
    if scorer.error is not None:
        raise scorer.error
    tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
    timing = {"generate_s": t_gen, "wall_s": wall, "scoring_after_generation_s": wall - t_gen,
              "scoring_busy_s": scorer.busy_s, "generated_tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
              "samples_per_s": len(items) * n / wall if wall else 0.0, **engine_window("engine/")}
    return results, {**timing, **scorer.counts}


def template_file(option: str) -> str:
    """The tokenizer's template override of an eval `chat_template` option ('none' renders without one)."""
    return "" if option == "none" else option


def make_backend(cfg, tok):
    """The generation backend an eval config names (backend, dtype, device, engine sizes): rollout.cli's builder."""
    gen = GenerateConfig(model=cfg.model, backend=cfg.backend, chat_template=template_file(getattr(cfg, "chat_template", "")),
                         chat_template_args=getattr(cfg, "chat_template_args", {}),
                         dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
                         max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, kv_cache_mb=cfg.kv_cache_mb)
    return generate_backend(gen, tok)
