"""Evaluation during training: every `every` steps, sample a held-out set with the recipe's engine and
log `eval/pass@1` with its Wilson interval (`eval/pass@1_low`, `eval/pass@1_high`), pass@k and
mean@n next to the training reward.

A recipe adds the section and calls the hook:

    class RLConfig(CommonConfig):
        eval: EvalSettings = Field(default_factory=EvalSettings)

    hook = EvalHook(cfg.eval, tok, recipe_reward=run.reward_fn, default_sampling=cfg.sampling,
                    eval_every=cfg.eval_every_fallback)         # loads and checks the data now
    ...
    row.update(hook.maybe(run.engine, step + 1, last=step + 1 == cfg.max_steps))   # {} when not due

or evaluates once: `evaluate(engine, tok, rows, reward_fn, n=4, sampling=cfg.sampling, seed=0)`.
The engine shares the trainer's weights: call `engine.sync_weights()` after optimizer steps (the RL
recipe does; `EvalHook.maybe` does it too, it is cheap). Eval requests carry their own seeds, so
the training samples' random streams are untouched.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from posttrain.config import Config
from posttrain.data.formats import Row
from posttrain.eval.config import parse_ks
from posttrain.eval.prompts import build_items, check_columns, load_rows
from posttrain.eval.results import item_values
from posttrain.eval.runner import generate_and_score
from posttrain.eval.stats import bootstrap_interval, clustered_wilson
from posttrain.rewards.pool import default_pool
from posttrain.rollout.settings import SamplingSettings


class EvalSettings(Config):
    """Held-out evaluation during training (off while `data` is empty)."""

    data: str = Field("", description="held-out set (task or .jsonl with prompt + answer/tests); empty: no evaluation")
    n: int = Field(4, ge=1, description="samples per problem")
    k: list[int] = Field(default_factory=lambda: [1], description="pass@k values logged (each <= n)")
    every: int = Field(0, ge=0, description="evaluate every N steps (0: the recipe's eval_every, or only at the end)")
    max_items: int = Field(64, ge=0, description="first N problems of data (0: all)")
    reward: str = Field("", description="verifier; empty: the recipe's reward (rl: only its verifier parts, those that read "
                        "a ground-truth column, when shaping terms are mixed in) or math (sft)")
    reward_args: dict = Field(default_factory=dict, description="options per reward, e.g. {math: {mode: last_number}}")
    threshold: float = Field(1.0, description="a sample is correct when its reward >= threshold")
    sampling: dict = Field(default_factory=dict, description="sampling keys that differ from the recipe's, e.g. {temperature: 0.6, max_new_tokens: 64}")
    seed: int = Field(1234, description="problem i samples with seed + i at every evaluation (same draws as the weights allow)")
    confidence: float = Field(0.95, gt=0, lt=1, description="interval coverage")

    @field_validator("k", mode="before")
    @classmethod
    def _ks(cls, v):
        return parse_ks(v)

    @model_validator(mode="after")
    def _check(self):
        if any(k > self.n for k in self.k):
            raise ValueError(f"eval k={self.k} needs n >= {max(self.k)} samples per problem (n={self.n})")
        SamplingSettings(**self.sampling)  # unknown or invalid sampling keys fail at parse time
        return self

    def sampling_settings(self, default: SamplingSettings | None = None) -> SamplingSettings:
        base = (default or SamplingSettings()).model_dump()
        return SamplingSettings(**{**base, **self.sampling})


def evaluate(engine, tok, rows, reward_fn, n: int = 4, sampling: SamplingSettings | None = None, seed: int = 0,
             ks: tuple[int, ...] = (1,), threshold: float = 1.0, confidence: float = 0.95, prefix: str = "eval/") -> dict:
    """Sample n completions of each row's prompt with `engine` (the built-in Engine, HFBackend or
    VLLMBackend), verify them with `reward_fn` (TRL signature) and return
    {prefix + "pass@1", "pass@1_low", "pass@1_high", "pass@k" (k > 1, with bootstrap bounds), "mean@n", "seconds"}.
    `rows` are `formats.Row`s or plain dicts with `prompt` and the reward's columns."""
    import time

    rows = [r if isinstance(r, Row) else Row(dict(r), "eval", i + 1) for i, r in enumerate(rows)]
    items = build_items(tok, rows)
    t0 = time.perf_counter()
    results, timing = generate_and_score(engine, items, reward_fn, sampling or SamplingSettings(), n, seed, threshold,
                                         None, default_pool())
    values = [item_values(r, n, list(ks), cons=False) for r in results]
    p1 = [v["pass@1"] for v in values] if 1 in ks else [v["c"] / v["n"] for v in values]
    mean, low, high = clustered_wilson(p1, n, confidence)
    out = {"pass@1": mean, "pass@1_low": low, "pass@1_high": high}
    for k in ks:
        if k > 1:
            out[f"pass@{k}"], out[f"pass@{k}_low"], out[f"pass@{k}_high"] = bootstrap_interval(
                [v[f"pass@{k}"] for v in values], confidence, 1000, seed)
    out["mean@n"] = sum(v["mean@n"] for v in values) / len(values)
    out["reward_errors"] = timing["reward_errors"]
    out.update({k: v for k, v in timing.items() if k.startswith("engine/")})  # the evaluation's engine signals
    out["seconds"] = time.perf_counter() - t0
    return {prefix + k: v for k, v in out.items()}


def _with_options(reward_fn, reward_args: dict):
    """The recipe's composed reward rebuilt with eval.reward_args over its own options (a part they name must be in it)."""
    from posttrain.errors import UserError
    from posttrain.rewards.registry import ComposedReward

    if not isinstance(reward_fn, ComposedReward):
        raise UserError("eval.reward_args: the recipe's reward takes no options here; give eval.reward= with them")
    unknown = sorted(set(reward_args) - {n for n, _ in reward_fn.parts})
    if unknown:
        raise UserError(f"eval.reward_args: {', '.join(unknown)} is not a part of the reward the evaluation uses "
                        f"({reward_fn.__name__}); name one of its parts, or give eval.reward= too")
    options = {**reward_fn.options, **{k: dict(v) for k, v in reward_args.items()}}
    try:
        return ComposedReward(list(reward_fn.parts), on_error=reward_fn.on_error, options=options)
    except UserError as e:  # a bad option: say which key it came from
        raise UserError(f"eval.reward_args: {e}") from None


class EvalHook:
    """Held-out evaluation every `every` steps (see the module docstring). Data and reward are loaded
    and checked when the hook is built, i.e. before the recipe loads its model."""

    def __init__(self, settings: EvalSettings, tok, recipe_reward=None, default_sampling: SamplingSettings | None = None,
                 eval_every: int = 0):
        from posttrain.rewards.registry import compose  # math-verify (slow): only when a hook is built

        self.settings, self.tok = settings, tok
        self.backend = None  # a recipe without an engine of its own may keep the one it builds for evaluation here
        self.every = settings.every or eval_every
        self.enabled = bool(settings.data)
        if not self.enabled:
            return
        self.rows = load_rows(settings.data, settings.max_items)
        if settings.reward or recipe_reward is None:
            self.reward_fn = compose(settings.reward or "math", on_error="record",
                                     options={k: dict(v) for k, v in settings.reward_args.items()})
        else:  # the recipe's reward; with shaping terms mixed in, only its verifiers (a trusted held-out verdict)
            trusted = recipe_reward.verifier_part() if hasattr(recipe_reward, "verifier_part") else None
            self.reward_fn = trusted or recipe_reward
            if settings.reward_args:  # options for the recipe's reward parts at evaluation (never silently dropped)
                self.reward_fn = _with_options(self.reward_fn, settings.reward_args)
            if trusted is not None:
                print(f"held-out eval scores with {trusted.__name__} (the training reward's verifiers; "
                      f"eval.reward= to choose)", flush=True)
        check_columns(self.rows, getattr(self.reward_fn, "columns", {}))
        build_items(tok, self.rows)  # a prompt the template cannot render fails now, not mid-training
        self.sampling = settings.sampling_settings(default_sampling)
        self.ks = tuple(settings.k or [1])

    def due(self, step: int, last: bool = False) -> bool:
        return self.enabled and (last or (self.every > 0 and step % self.every == 0))

    def maybe(self, engine, step: int, last: bool = False) -> dict:
        """The eval metrics when `step` (1-based, steps done) is due, else {}."""
        if not self.due(step, last):
            return {}
        if hasattr(engine, "sync_weights"):
            engine.sync_weights()
        return evaluate(engine, self.tok, self.rows, self.reward_fn, self.settings.n, self.sampling, self.settings.seed,
                        self.ks, self.settings.threshold, self.settings.confidence)

