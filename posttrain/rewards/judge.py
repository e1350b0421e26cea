"""`reward=judge`: an LLM judge as the reward (RLAIF; Bai et al. 2022, "Constitutional AI", and Lee et al.
2023, "RLAIF"), over any OpenAI-compatible endpoint — `posttrain serve` makes a local model one.

    posttrain rl reward=judge 'reward_args={judge: {base_url: http://127.0.0.1:8000/v1, rubric_file: constitution.md}}'

mode=score (default): the judge rates each completion from 1 to 10 against the rubric (or a written
constitution: pass its file as `rubric_file`) with the frozen `score_prompt`; the reward is (s − 1) / 9 ∈ [0, 1].
mode=pairwise: the completion is compared with the row's `reference` column in both orders (position
swap); the reward is 1 (win), 0.5 (tie: the two orders disagree) or 0 (loss).

Batched: the distinct (prompt, completion) pairs of a call that are not cached are sent `concurrency` at a
time (`posttrain serve` decodes concurrent calls together). Cached on disk (SQLite) by sha256 of the
judge's identity (model, prompt version and text, temperature, max_tokens, seed, rubric), the mode, the
prompt, the completion (and the reference); only successful verdicts are stored. A completion the judge
still cannot rate after its retries is None (left out of the baseline and the loss, counted in
`rewards/judge/none` and `failed`) with on_failure=none, or stops the run with on_failure=raise; it is
never turned into a number. `last_metrics`: questions, cache_hits, calls, retries, malformed, timeouts,
failed, prompt/completion tokens, cost_usd (from the `price_*_per_mtok` options), latency mean/max, seconds.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path

from pydantic import Field, ValidationError

from posttrain.errors import UserError
from posttrain.judge.client import Judge, JudgeSettings, JudgeStats
from posttrain.rewards.base import RewardError, completion_text, register


class JudgeRewardOptions(JudgeSettings):
    """Options of `reward=judge` (reward_args={judge: {...}}): the judge's settings plus these."""

    mode: str = Field("score", pattern="^(score|pairwise)$", description="score: rubric rating 1-10 -> (s-1)/9; pairwise: against the `reference` column, 1 / 0.5 / 0")
    rubric: str = Field("", description="rubric or constitution text ('' = the prompt's default rubric)")
    rubric_file: str = Field("", description="file holding the rubric or a written constitution")
    cache: str = Field("auto", description="SQLite file of cached verdicts; auto = $POSTTRAIN_HOME/judge_cache.sqlite (~/.cache/posttrain); '' = no cache")
    price_in_per_mtok: float = Field(0.0, ge=0, description="USD per million prompt tokens (for cost_usd)")
    price_out_per_mtok: float = Field(0.0, ge=0, description="USD per million completion tokens")
    on_failure: str = Field("none", pattern="^(none|raise)$", description="a completion the judge cannot rate: none (reward None, counted) | raise (stop the run)")
    check: bool = Field(True, description="ask the endpoint's /models when the reward is built (refuse an unreachable judge before training)")


class VerdictCache:
    """sha256 key -> JSON verdict, in one SQLite file (safe across threads and processes)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), timeout=30, check_same_thread=False)
        with self._lock, self._db:
            self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, value TEXT NOT NULL)")

    def get_many(self, keys: list[str]) -> dict[str, dict]:
        out: dict[str, dict] = {}
        with self._lock:
            for k0 in range(0, len(keys), 500):
                chunk = keys[k0:k0 + 500]
                rows = self._db.execute(f"SELECT key, value FROM verdicts WHERE key IN ({','.join('?' * len(chunk))})", chunk)
                out.update({k: json.loads(v) for k, v in rows})
        return out

    def put_many(self, items: dict[str, dict]) -> None:
        if items:
            with self._lock, self._db:
                self._db.executemany("INSERT OR REPLACE INTO verdicts VALUES (?, ?)", [(k, json.dumps(v)) for k, v in items.items()])


def _options(options: dict) -> JudgeRewardOptions:
    try:
        return JudgeRewardOptions(**options)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise UserError(f"reward 'judge': {msgs} (options: {', '.join(JudgeRewardOptions.model_fields)})") from None


def _rubric(opts: JudgeRewardOptions) -> str:
    if opts.rubric and opts.rubric_file:
        raise UserError("reward 'judge': give rubric or rubric_file, not both")
    if opts.rubric_file:
        path = Path(opts.rubric_file).expanduser()
        if not path.is_file():
            raise UserError(f"reward 'judge': rubric_file not found: {opts.rubric_file}")
        text = path.read_text(encoding="utf-8").strip()
        if not text:
            raise UserError(f"reward 'judge': rubric_file {opts.rubric_file} is empty")
        return text
    return opts.rubric


class JudgeReward:
    """The configured reward (module docstring); TRL's signature."""

    __name__ = "judge"

    def __init__(self, **options):
        self.opts = _options(options)
        if not self.opts.base_url:
            raise UserError("reward 'judge' needs options: reward_args={judge: {base_url: http://HOST:PORT/v1, ...}} "
                            "(an OpenAI-compatible endpoint; `posttrain serve` makes one)")
        self.rubric = _rubric(self.opts)
        settings = JudgeSettings(**{k: getattr(self.opts, k) for k in JudgeSettings.model_fields})
        self.judge = Judge(settings)
        if self.opts.check:
            self.judge.connect()
        if self.opts.cache == "auto":
            from posttrain.models.builtin import cache_dir  # torch: this module stays torch-free

            self.cache = VerdictCache(cache_dir() / "judge_cache.sqlite")
        else:
            self.cache = VerdictCache(self.opts.cache) if self.opts.cache else None
        self.last_metrics: dict = {}

    def _key(self, identity: str, prompt, text: str, reference: str | None) -> str:
        blob = json.dumps([identity, self.opts.mode, prompt, text, reference], ensure_ascii=False, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def _judge(self, items: list[tuple]) -> list[tuple[float | None, str | None]]:
        """(value, error) per (prompt, completion[, reference]) item."""
        if self.opts.mode == "pairwise":
            return [(v.preference, v.error) for v in self.judge.compare_many(items)]
        return [(None if v.score is None else (v.score - 1) / 9, v.error) for v in self.judge.score_many(items, self.rubric)]

    def __call__(self, prompts, completions, reference=None, **columns) -> list[float | None]:
        t0 = time.perf_counter()
        n = len(completions)
        prompts = list(prompts) if prompts is not None else [None] * n
        if self.opts.mode == "pairwise" and reference is None:
            raise ValueError("reward 'judge' with mode=pairwise needs a `reference` column (the answer each completion is compared with)")
        texts = [completion_text(c) for c in completions]
        refs = [completion_text(r) for r in reference] if reference is not None else [None] * n
        if not self.judge.model:
            self.judge.connect()
        identity = self.judge.identity(self.rubric)
        keys = [self._key(identity, prompts[i], texts[i], refs[i]) for i in range(n)]
        known = self.cache.get_many(sorted(set(keys))) if self.cache else {}
        todo = list(dict.fromkeys(k for k in keys if k not in known))  # distinct misses, first-seen order
        first = {k: keys.index(k) for k in todo}
        self.judge.stats = JudgeStats()  # this call's counters
        items = [(prompts[first[k]], texts[first[k]]) + ((refs[first[k]],) if self.opts.mode == "pairwise" else ()) for k in todo]
        results = dict(zip(todo, self._judge(items))) if todo else {}
        if self.cache:
            self.cache.put_many({k: {"value": v} for k, (v, err) in results.items() if err is None})
        values, errors = [], []
        for i, k in enumerate(keys):
            v, err = (known[k]["value"], None) if k in known else results[k]
            values.append(v if err is None else None)
            if err is not None:
                errors.append((i, err))
        self._log(n, sum(k in known for k in keys), time.perf_counter() - t0)
        if errors and self.opts.on_failure == "raise":
            raise RewardError("judge", errors, values, samples=completions)
        return values

    def _log(self, n: int, hits: int, seconds: float) -> None:
        st = self.judge.stats.as_dict()
        self.last_metrics = {
            "samples": n, "cache_hits": hits,
            **{k: st[k] for k in ("questions", "calls", "retries", "malformed", "timeouts", "http_errors", "failed",
                                  "prompt_tokens", "completion_tokens", "latency_mean_s", "latency_max_s")},
            "cost_usd": st["prompt_tokens"] * self.opts.price_in_per_mtok / 1e6 + st["completion_tokens"] * self.opts.price_out_per_mtok / 1e6,
            "seconds": seconds,
        }


def _unconfigured(prompts, completions, **columns):
    raise UserError("reward 'judge' needs options: reward_args={judge: {base_url: http://HOST:PORT/v1}}")


_unconfigured.needs_options = True  # the registry builds it with the factory even without options (refused at build)

register("judge", factory=JudgeReward,
         description="LLM judge over an OpenAI-compatible endpoint: rubric score (s-1)/9, or pairwise vs `reference`")(_unconfigured)
