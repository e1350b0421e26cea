"""The engine's typed API: requests and sampling parameters in, outputs out (all backends share it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # most alternatives per position a request may ask for (OpenAI's chat limit, vLLM's default)


@dataclass
class TokenLogprob:
    """The model's log-prob of one token (temperature 1, untruncated) and the `top` most likely tokens at its
    position as (token id, log-prob), most likely first."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SamplingParams:
    """How to sample the completions of one request (see posttrain.ops.sampling for the semantics).

    temperature 0 = greedy. top_k 0 = off. top_p 1 = off. stop_token_ids None = the model's eos
    ids; [] = none. A stop token is kept in the output (its log-prob is a policy action); text stops
    are checked on the decoded completion and the token that completes them is kept too.
    seed None = drawn from the engine's seed; sample j of a request uses stream (seed, j).
    max_new_tokens 0 = no completion (the samples are empty): with prompt_logprobs, scoring a text.

    Reporting (what an OpenAI-compatible server returns; sampling never depends on it):
    logprobs k: each sampled token also gets its log-prob under the model (log_softmax of the raw
    logits: temperature 1, before top-k / top-p; what OpenAI and vLLM report) and the k most likely
    tokens at its position (`Completion.model_logprobs`; k = 0: the token's own only). prompt_logprobs
    k: the same for every prompt token but the first (`RequestOutput.prompt_logprobs`), computed by
    one forward of the whole prompt. None = not asked (no cost).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def truncates(self, vocab_size: int | None = None) -> bool:
        """Whether tokens are drawn from a truncated distribution (top-k and/or top-p, not greedy)."""
        top_k_cuts = self.top_k > 0 and (vocab_size is None or self.top_k < vocab_size)
        return self.temperature > 0 and (top_k_cuts or self.top_p < 1)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1 (got {self.n!r})")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (got {self.temperature!r})")
        if not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, 0 = off (got {self.top_k!r})")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0 (got {self.max_new_tokens!r})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (got {k!r})")
        if self.stop_token_ids is not None and not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers (got {self.stop_token_ids!r})")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings (got {self.stop_strings!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or not (-(2**63) <= self.seed < 2**63)):
            raise ValueError(f"seed must be a 64-bit integer or None (got {self.seed!r})")


@dataclass
class Request:
    """One prompt (token ids, already templated) and how to sample it; `request_id` is echoed back."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | int | None = None


@dataclass
class Completion:
    """One sample. `logprobs[i]` = log-prob of `token_ids[i]` under the processed distribution it was drawn from.

    finish_reason: "stop" (stop token or stop string), "length" (max_new_tokens or context full).
    kept_counts[i]: the size of the truncated (top-k / top-p) set `token_ids[i]` was drawn from (tokens
    with finite log-prob, ties included); the trainer recomputes log-probs over that many of its own
    top logits (posttrain.ops.sampling.kept_logprobs) instead of re-deciding the cut. None when the
    request did not truncate (greedy, or no top-k and top_p = 1) or the backend does not report it (vLLM).
    """

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    kept_counts: list[int] | None = None
    model_logprobs: list[TokenLogprob] | None = None  # per token, when SamplingParams.logprobs asked for them


@dataclass
class RequestOutput:
    """All samples of one request, or `error` (then `samples` is empty) when the request was refused."""

    request_id: str | int | None
    prompt_token_ids: list[int]
    samples: list[Completion] = field(default_factory=list)
    error: str | None = None
    # seconds since generate() was called
    time_first_token: float | None = None
    time_finished: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (not recomputed)
    # per prompt token when SamplingParams.prompt_logprobs asked for them; the first is None (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def default_stop_ids(model, tokenizer=None) -> list[int]:
    """The stop ids of a request that gives none: the model's generation_config eos, then its config's, then the
    tokenizer's (every backend uses this one rule)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def check_request(request: Request, max_model_len: int, vocab_size: int | None = None, has_tokenizer: bool = True) -> None:
    """Raise ValueError naming what is wrong with one request; every backend refuses it alone."""
    request.params.validate()
    ids = request.prompt_token_ids
    if not ids:
        raise ValueError("empty prompt")
    if vocab_size is not None and not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if request.params.max_new_tokens == 0:  # scoring only: the whole context may be prompt
        if len(ids) > max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {max_model_len}")
    elif len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the context holds {max_model_len} (prompt + at least 1 new token): "
                         "shorten the prompt or raise max_model_len")
    if request.params.stop_strings and not has_tokenizer:
        raise ValueError("stop_strings need a tokenizer")
