"""`posttrain eval` settings (one validated config; `posttrain eval --help` lists every key)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field, field_validator, model_validator

from posttrain.config import Config, backend_field, chat_template_args_field
from posttrain.rollout.settings import SamplingSettings


def parse_ks(value) -> list[int]:
    """`4` | `"1,2,4"` | `[1, 2, 4]` -> sorted distinct ints >= 1."""
    if value is None or value == "":
        return []
    if isinstance(value, int):
        value = [value]
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    try:
        ks = sorted({int(v) for v in value})
    except (TypeError, ValueError):
        raise ValueError(f"k must be integers, e.g. k=1,2,4 (got {value!r})") from None
    if any(k < 1 for k in ks):
        raise ValueError(f"k must be >= 1 (got {ks})")
    return ks


def default_ks(n: int) -> list[int]:
    """1, 2, 4, … up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return sorted(set(ks + [n]))


def _template_option(value):
    """chat_template=true/false (the older boolean form) -> '' / 'none'."""
    if isinstance(value, bool):
        return "" if value else "none"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return "" if value.lower() == "true" else "none"
    return value


class EvalConfig(Config):
    """posttrain eval: sample n completions per problem, verify them, report pass@k, cons@k, pass^k and
    mean@n with intervals, and the full protocol (results.json, report.html)."""

    model: str = Field("tiny-random", description="HF folder (e.g. runs/rl/final), built-in name or Hub id")
    data: str = Field("single_digit_add:all", description="task (single_digit_add:all, arithmetic:200, humaneval_mini:all) or .jsonl with `prompt` + `answer` | `tests` | `stdio`")
    output_dir: str = Field("runs/eval", description="where results.json and report.html go")
    backend: str = backend_field()
    n: int = Field(1, ge=1, description="samples per problem (pass@k needs n >= k)")
    k: list[int] = Field(default_factory=list, description="k values for pass@k, pass^k and cons@k, e.g. k=1,2,4 (default: 1, 2, 4, … up to n)")
    reward: str = Field("", description="verifier or composition (math, code, 'math:1.0,format:0.2', my.py:fn); empty: code when rows have tests/stdio, else math")
    reward_args: dict = Field(default_factory=dict, description="options per reward, e.g. {math: {mode: last_number}}")
    threshold: float = Field(1.0, description="a sample counts as correct when its reward >= threshold")
    system_prompt: str = Field("", description="system message put before every prompt (recorded in the protocol)")
    few_shot: str = Field("", description="file of example exchanges (messages, or prompt + completion/answer) put before every prompt")
    chat_template: Annotated[str, BeforeValidator(_template_option)] = Field(
        "", description="'' = the tokenizer's chat template (a tokenizer without one: string prompts as plain text); "
                        "none (or false) = string prompts as plain text; a built-in name (chatml, plain) or a .jinja file")
    chat_template_args: dict = chat_template_args_field()
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    seed: int = Field(0, description="sampling seed: problem i uses seed + i (as `posttrain generate`), sample j stream j")
    max_items: int = Field(0, ge=0, description="evaluate the first N problems only (0: all)")
    confidence: float = Field(0.95, gt=0, lt=1, description="interval coverage")
    bootstrap: int = Field(2000, ge=100, description="bootstrap resamples over items (intervals of pass@k>1, pass^k, cons@k, mean@n)")
    max_subsets: int = Field(1000, ge=1, description="cons@k with k < n: average over all k-subsets when at most this many, else this many seeded draws")
    workers: int = Field(2, ge=1, description="verifier worker processes")
    dtype: str = Field("float32", description="model dtype: float32 | bfloat16")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto | cpu | cuda | cuda:N")
    max_num_seqs: int = Field(64, ge=1, description="builtin: sequences decoded together")
    max_model_len: int = Field(2048, ge=2, description="prompt + completion tokens per sequence")
    kv_cache_mb: float = Field(1024, gt=0, description="builtin: KV cache size in MiB")
    report_samples: int = Field(3, ge=0, description="problems whose samples are shown in report.html")
    save_samples: bool = Field(True, description="keep every sample's text in results.json (false: outcomes only)")
    select: str = Field("", description="test-time selection among the first k samples, for every k: best_of_n (bon@k) | majority (maj@k), "
                                        "accuracy of the kept answer with its interval and its cost in generated tokens; '' = off")
    select_reward: str = Field("", description="select=best_of_n: the reward that ranks (rm:PATH, a file reward…); '' = the verifier "
                                               "(reward=), which sees the reference: an oracle, pass@k-like")

    @field_validator("k", mode="before")
    @classmethod
    def _ks(cls, v):
        return parse_ks(v)

    @model_validator(mode="after")
    def _check(self):
        too_big = [k for k in self.k if k > self.n]
        if too_big:
            raise ValueError(f"k={too_big} > n={self.n}: pass@k needs at least k samples per problem (raise n)")
        if self.select and self.select not in ("best_of_n", "majority"):
            raise ValueError(f"select='{self.select}' is not a selection method (known: best_of_n, majority; '' = off)")
        if self.select_reward and self.select != "best_of_n":
            raise ValueError("select_reward= ranks samples for select=best_of_n only (majority votes with reward='s extraction)")
        return self

    @property
    def ks(self) -> list[int]:
        return self.k or default_ks(self.n)
