"""LLM-as-judge over any OpenAI-compatible chat endpoint (OpenAI, vLLM, `posttrain serve`, ...).

    judge = Judge(JudgeSettings(base_url="http://127.0.0.1:8000/v1"))
    verdicts = judge.compare_many([(question, answer_a, answer_b), ...])   # -> PairVerdict: winner a | b | tie
    scores = judge.score_many([(question, answer), ...], rubric="...")      # -> ScoreVerdict: 1..10

Pairwise judging asks twice, once in each order (position swap, Zheng et al. 2023 "Judging LLM-as-a-Judge
with MT-Bench and Chatbot Arena"): the same winner both times is a win, two different answers are a tie
(the judge followed the position, not the content). Prompts are frozen and versioned
(`posttrain.judge.prompts`); every verdict records the version and a hash of its text.

Replies are parsed strictly (`parse_pairwise`, `parse_score`). A malformed reply, a timeout, a dropped
connection, HTTP 429 or 5xx is retried (`retries` more times; malformed replies are re-asked at
`retry_temperature` with a new seed, since a greedy judge would repeat itself); what still fails is
returned as an error with its kind and the last reply, never as a made-up verdict. HTTP 4xx other than
429 is a configuration problem and is not retried. Calls run `concurrency` at a time (threads over one
httpx client); `stats` counts calls, retries, failures by kind, tokens (from `usage`) and latency.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields

from pydantic import Field, field_validator

from posttrain.config import Config
from posttrain.data.formats import completion_text
from posttrain.errors import UserError
from posttrain.judge import prompts as judge_prompts


class JudgeSettings(Config):
    """Where the judge is and how it is asked (the `judge.*` section of `posttrain label`; `reward=judge` options)."""

    base_url: str = Field("", description="OpenAI-compatible endpoint up to /v1, e.g. http://127.0.0.1:8000/v1 (what `posttrain serve` prints)")
    model: str = Field("", description="model name sent to the endpoint; '' = the first one its /models lists")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the API key, sent as a Bearer token (unset: no key)")
    pairwise_prompt: str = Field("pairwise-v1", description="frozen pairwise prompt version (posttrain.judge.prompts): pairwise-v1 | pairwise-direct-v1")
    score_prompt: str = Field("score-v1", description="frozen rubric-scoring prompt version: score-v1 | score-direct-v1")
    temperature: float = Field(0.0, ge=0, description="judge sampling temperature of the first attempt (0 = greedy)")
    retry_temperature: float = Field(0.7, ge=0, description="temperature of the retries after a malformed reply (a greedy judge would repeat it)")
    max_tokens: int = Field(256, ge=1, description="reply length limit")
    timeout_s: float = Field(60.0, gt=0, description="seconds per HTTP call (connect + reply); past it the call is retried, then reported")
    retries: int = Field(2, ge=0, description="extra attempts after a malformed reply, a timeout, a connection error, HTTP 429 or 5xx")
    concurrency: int = Field(8, ge=1, description="HTTP calls in flight at once (`posttrain serve` batches concurrent calls)")
    seed: int = Field(0, description="sampling seed sent with each call (attempt k uses seed + k)")

    @field_validator("pairwise_prompt", "score_prompt")
    @classmethod
    def _known_prompt(cls, v, info):
        try:
            judge_prompts.get(v, "pairwise" if info.field_name == "pairwise_prompt" else "score")
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        return v


@dataclass
class Call:
    """One question to the judge after its retries: `value` parsed, or `error` ('<kind>: <detail>')."""

    value: str | float | None = None
    text: str = ""  # the last reply
    attempts: int = 0
    error: str | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class PairVerdict:
    """`winner`: 'a', 'b', 'tie' (the two orders disagree) or None when a call failed (`error`).
    `orders`: the winner each order named, in a/b terms: [a shown first, b shown first]."""

    winner: str | None
    orders: list[str | None]
    replies: list[str]
    error: str | None = None
    version: str = ""
    digest: str = ""
    model: str = ""

    @property
    def preference(self) -> float | None:
        """P(a preferred): 1, 0.5 (tie) or 0; None on error."""
        return {"a": 1.0, "tie": 0.5, "b": 0.0}.get(self.winner) if self.winner else None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ScoreVerdict:
    score: float | None  # 1..10, None on error
    reply: str
    error: str | None = None
    version: str = ""
    digest: str = ""
    model: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class JudgeStats:
    calls: int = 0  # HTTP calls made (attempts)
    questions: int = 0  # questions asked (each may take several calls)
    retries: int = 0
    malformed: int = 0  # replies that did not parse (each attempt counted)
    timeouts: int = 0
    http_errors: int = 0
    failed: int = 0  # questions still failing after the retries
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0  # summed over questions (all attempts)
    latency_max_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        d["latency_mean_s"] = self.latency_s / self.questions if self.questions else 0.0
        return d


class JudgeCallError(Exception):
    def __init__(self, kind: str, detail: str, retry: bool):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.retry = kind, retry


# ---------------------------------------------------------------- parsing


_BRACKETS = re.compile(r"\[\[\s*([^\[\]]{1,12}?)\s*\]\]")


_LETTER = re.compile(r"[\W_]*(?:(?:final\s+)?verdict\s*:\s*)?(?:response\s+|assistant\s+)?([AB])[\W_]*", re.IGNORECASE)
_LETTER_LINE = re.compile(r"[\W_]*(?:response\s+|assistant\s+)?([AB])[.)\]*]*", re.IGNORECASE)
_NUMBER = re.compile(r"\W*(?:rating\s*:\s*)?(\d+(?:\.\d+)?)(?:\s*/\s*10)?\W*", re.IGNORECASE)
_NUMBER_LINE = re.compile(r"\W*(\d+(?:\.\d+)?)(?:\s*/\s*10)?[.*]*")


def _first_line(reply: str) -> str:
    return reply.strip().split("\n", 1)[0].strip()


def parse_pairwise(reply: str) -> str | None:
    """'A' or 'B', or None when the reply is malformed. Accepted, in this order: '[[A]]' anywhere (several
    must agree); a reply that is only the letter ('B', '**A**', 'Verdict: A', 'Response B.'); a first
    line that is only the letter ('A' then an explanation). Anything else (prose such as 'A is better',
    'A: 7') is malformed."""
    found = {m.strip().upper() for m in _BRACKETS.findall(reply)}
    if found:
        return found.pop() if len(found) == 1 and found <= {"A", "B"} else None
    m = _LETTER.fullmatch(reply.strip()) or _LETTER_LINE.fullmatch(_first_line(reply))
    return m.group(1).upper() if m else None


def parse_score(reply: str, low: float = 1, high: float = 10) -> float | None:
    """The rating in [low, high], or None. Accepted, in this order: '[[7]]' anywhere (several must agree);
    a reply that is only the rating ('7', 'Rating: 7', '8/10'); a first line that is only the number."""
    found = {m.strip() for m in _BRACKETS.findall(reply)}
    if not found:
        m = _NUMBER.fullmatch(reply.strip()) or _NUMBER_LINE.fullmatch(_first_line(reply))
        found = {m.group(1)} if m else set()
    values = set()
    for text in found:
        try:
            values.add(float(text))
        except ValueError:
            return None
    if len(values) != 1:
        return None
    v = values.pop()
    return v if low <= v <= high else None


def question_text(prompt) -> str:
    """A prompt as the judge reads it: a string as is; a conversation as 'Role: content' lines."""
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], dict) and prompt[0].get("role") == "user":
            return str(prompt[0].get("content", ""))
        return "\n".join(f"{str(m.get('role', 'user')).capitalize()}: {m.get('content', '')}" for m in prompt if isinstance(m, dict))
    return str(prompt)


# ---------------------------------------------------------------- the client


class Judge:
    """A judge behind an OpenAI-compatible `/chat/completions` endpoint (see the module docstring)."""

    def __init__(self, settings: JudgeSettings, transport=None):
        import httpx

        if not settings.base_url:
            raise UserError("judge: base_url is required (an OpenAI-compatible endpoint up to /v1, e.g. http://127.0.0.1:8000/v1)")
        self.settings = settings
        self.base_url = settings.base_url.rstrip("/")
        key = os.environ.get(settings.api_key_env, "") if settings.api_key_env else ""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency)
        self.client = httpx.Client(timeout=httpx.Timeout(settings.timeout_s), limits=limits, headers=headers, transport=transport)
        self.model = settings.model
        self.stats = JudgeStats()
        self.pairwise = judge_prompts.get(settings.pairwise_prompt, "pairwise")
        self.scoring = judge_prompts.get(settings.score_prompt, "score")

    def close(self) -> None:
        self.client.close()

    def connect(self) -> str:
        """Check the endpoint answers (GET /models) and fill in the model name when none was given."""
        import httpx

        try:
            r = self.client.get(self.base_url + "/models", timeout=min(self.settings.timeout_s, 10.0))
            r.raise_for_status()
            listed = [m.get("id") for m in r.json().get("data", []) if isinstance(m, dict)]
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise UserError(f"judge endpoint {self.base_url} does not answer GET /models: {type(e).__name__}: {e}") from None
        if not self.model:
            if not listed:
                raise UserError(f"judge endpoint {self.base_url} lists no model; give judge model=NAME")
            self.model = listed[0]
        return self.model

    # ------------------------------------------------------------ one question

    def _post(self, messages: list[dict], temperature: float, seed: int) -> tuple[str, dict]:
        import httpx

        body = {"model": self.model, "messages": messages, "temperature": temperature,
                "max_tokens": self.settings.max_tokens, "n": 1, "seed": seed}
        try:
            r = self.client.post(self.base_url + "/chat/completions", json=body)
        except httpx.TimeoutException as e:
            raise JudgeCallError("timeout", f"no reply within {self.settings.timeout_s} s ({type(e).__name__})", True) from None
        except httpx.HTTPError as e:
            raise JudgeCallError("connection", f"{type(e).__name__}: {e}", True) from None
        if r.status_code != 200:
            retry = r.status_code == 429 or r.status_code >= 500
            raise JudgeCallError(f"http {r.status_code}", r.text[:300], retry)
        try:
            data = r.json()
            text = data["choices"][0]["message"]["content"]
            if not isinstance(text, str):
                raise TypeError("content is not a string")
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise JudgeCallError("bad response", f"not a chat completion ({type(e).__name__}: {e}): {r.text[:200]}", True) from None
        return text, data.get("usage") or {}

    def ask(self, messages: list[dict], parse) -> Call:
        """Ask one question until `parse(reply)` is not None or the attempts run out."""
        s, st, call = self.settings, self.stats, Call()
        t0 = time.perf_counter()
        for attempt in range(s.retries + 1):
            call.attempts = attempt + 1
            temperature = s.temperature if attempt == 0 else max(s.temperature, s.retry_temperature)
            try:
                call.text, usage = self._post(messages, temperature, s.seed + attempt)
            except JudgeCallError as e:
                call.error = str(e)
                with st._lock:
                    st.calls += 1
                    st.timeouts += e.kind == "timeout"
                    st.http_errors += e.kind.startswith("http")
                if not e.retry:
                    break
                if attempt < s.retries:
                    time.sleep(min(0.1 * 2 ** attempt, 2.0))  # back off before asking a struggling server again
                continue
            call.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            call.completion_tokens += int(usage.get("completion_tokens") or 0)
            call.value = parse(call.text)
            with st._lock:
                st.calls += 1
                st.malformed += call.value is None
            if call.value is not None:
                call.error = None
                break
            call.error = f"malformed: reply did not contain a verdict: {call.text[:200]!r}"
        call.latency_s = time.perf_counter() - t0
        with st._lock:
            st.questions += 1
            st.retries += call.attempts - 1
            st.failed += call.value is None
            st.prompt_tokens += call.prompt_tokens
            st.completion_tokens += call.completion_tokens
            st.latency_s += call.latency_s
            st.latency_max_s = max(st.latency_max_s, call.latency_s)
        if call.value is not None:
            call.error = None
        elif call.error:
            call.error = f"{call.error} (after {call.attempts} attempt{'s' * (call.attempts > 1)})"
        return call

    def _map(self, fn, items: list) -> list:
        if len(items) <= 1 or self.settings.concurrency == 1:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(max_workers=min(self.settings.concurrency, len(items))) as pool:
            return list(pool.map(fn, items))

    # ------------------------------------------------------------ pairwise and rubric

    def compare_many(self, items: list[tuple]) -> list[PairVerdict]:
        """items: (question, response_a, response_b); each pair asked in both orders."""
        if not self.model:
            self.connect()
        p = self.pairwise
        questions = []
        for q, a, b in items:
            q, a, b = question_text(q), completion_text(a), completion_text(b)
            questions.append(judge_prompts.render(p, question=q, response_a=a, response_b=b))
            questions.append(judge_prompts.render(p, question=q, response_a=b, response_b=a))
        calls = self._map(lambda m: self.ask(m, parse_pairwise), questions)
        out = []
        for i in range(len(items)):
            first, second = calls[2 * i], calls[2 * i + 1]
            orders = [{"A": "a", "B": "b"}.get(first.value), {"A": "b", "B": "a"}.get(second.value)]
            errors = [f"order {k} ({'a first' if k == 1 else 'b first'}): {c.error}" for k, c in ((1, first), (2, second)) if c.error]
            if errors:
                winner = None
            else:
                winner = orders[0] if orders[0] == orders[1] else "tie"
            out.append(PairVerdict(winner, orders, [first.text, second.text], "; ".join(errors) or None,
                                   p.version, judge_prompts.digest(p.version), self.model))
        return out

    def score_many(self, items: list[tuple], rubric: str | None = None) -> list[ScoreVerdict]:
        """items: (question, response); the rating from 1 to 10 against `rubric` (a constitution works too)."""
        if not self.model:
            self.connect()
        p, rubric = self.scoring, rubric or judge_prompts.DEFAULT_RUBRIC
        questions = [judge_prompts.render(p, question=question_text(q), response=completion_text(r), rubric=rubric) for q, r in items]
        calls = self._map(lambda m: self.ask(m, parse_score), questions)
        return [ScoreVerdict(c.value, c.text, c.error, p.version, judge_prompts.digest(p.version), self.model) for c in calls]

    def identity(self, rubric: str | None = None) -> str:
        """A hash of everything that decides a verdict besides the inputs (for caches): the model name, the
        prompt versions and texts, temperature, max_tokens, seed and the rubric; not the URL, so a local
        server on another port keeps its cache."""
        s = self.settings
        parts = [self.model, s.pairwise_prompt, judge_prompts.digest(s.pairwise_prompt), s.score_prompt,
                 judge_prompts.digest(s.score_prompt), repr(s.temperature), repr(s.max_tokens), str(s.seed), rubric or ""]
        return hashlib.sha256("\x00".join(parts).encode()).hexdigest()
