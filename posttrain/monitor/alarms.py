"""RL health alarms (docs/alarms.md): a bad run is stopped, not plotted.

Every step the monitor reads the metrics row the RL step already logs (names in docs/rl.md "Metrics")
and the step's samples, and raises an alarm when a curve leaves its healthy range:

    shaping_rise      what the non-verifier parts of a composed reward pay rose above its first steps
    eval_gap          training reward (last steps) > held-out pass@1 under the trusted verifier + gap, or risen
                      more than pass@1 since the first evaluation
    length_reward     reward and length correlate within the step while the length grew past its start
    reward_jump       reward/mean > running mean + k·max(running std, floor)   (off by default)
    length_blowup     response_length/mean > f · running median
    length_collapse   response_length/mean < f · running median
    entropy_collapse  entropy < floor, or < fraction × the entropy of the first steps
    kl_budget         KL per sequence > budget (nats): to the reference; at β = 0 to the start (kl_start/seq) > kl_start_budget
    clip_frac         clip_frac/low + clip_frac/high > max
    grad_norm_spike   grad_norm > f · running median
    nonfinite         any NaN / inf value in the row
    consistency       consistency/dlogp_mean > max (the trainer and the sampler disagree)

"Running" statistics are over the last `window` steps before the current one and need `warmup_steps`
of them; the absolute alarms (floor, budget, max, NaN) apply from the first step. Defaults and why:
docs/alarms.md. Use:

    monitor = AlarmMonitor(settings)
    fired = monitor.check(step, row, samples)    # samples: [{"prompt", "completion", "reward"}, ...]
    row.update(monitor.metrics(fired))           # alarm/<name> = 1.0 while it fires, alarm/count every step
    monitor.act(fired)                           # raises AlarmStop when on_alarm is stop | checkpoint_and_stop
    state = monitor.state(); monitor.load(state) # JSON, for checkpoints

An alarm is printed when it starts firing (the step, the value against its threshold, the samples
that raised it: the highest-reward ones for a reward jump, the longest for a length blow-up, …); while it
keeps firing it is logged every step but not printed again.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import Field

from posttrain.config import Config
from posttrain.errors import UserError

INF_SENTINEL = 1e308  # MetricsWriter writes ±inf as ±1e308 and NaN as null (monitor/metrics.py::to_python)


class AlarmSettings(Config):
    """Health alarms on the RL metrics (docs/alarms.md). A threshold set to null turns its alarm off."""

    on_alarm: str = Field("warn", pattern="^(warn|stop|checkpoint_and_stop)$",
                          description="warn (print and log) | stop (end the run) | checkpoint_and_stop (save, then end)")
    window: int = Field(20, ge=2, description="steps in the running band (mean / std / median) of the relative alarms")
    warmup_steps: int = Field(5, ge=1, description="steps observed before a relative alarm can fire; the initial entropy is their mean")
    reward_jump_std: float | None = Field(None, gt=0, description="reward/mean above the running mean by this many running stds "
                                          "(off by default: fast honest learning jumps too; docs/alarms.md)")
    reward_jump_min_std: float = Field(0.05, ge=0, description="floor on that std (in reward units): a flat band would fire on any change")
    shaping_rise: float | None = Field(0.15, gt=0, description="reward units: what the non-verifier parts of a composed reward pay "
                                       "(reward/mean − the verifiers' share) rose above its first steps' level")
    eval_gap: float | None = Field(0.3, gt=0, description="training reward/mean (mean of the last eval_gap_window steps) above "
                                   "the held-out eval/pass@1 (a trusted verifier) by more than this")
    eval_rise_gap: float | None = Field(0.25, gt=0, description="eval_gap's second test: the training reward's rise since "
                                        "the first evaluation beyond held-out pass@1's rise")
    eval_gap_window: int = Field(5, ge=1, description="steps of training reward averaged for eval_gap")
    length_reward_corr: float | None = Field(0.5, gt=0, le=1, description="within-step correlation of reward and completion "
                                             "length above this while the mean length grew past length_growth × its start")
    length_growth: float = Field(1.5, gt=1, description="the length growth length_reward_corr needs (× the first steps' median)")
    length_blowup: float | None = Field(2.0, gt=1, description="response_length/mean above this × its running median")
    length_collapse: float | None = Field(0.3, gt=0, lt=1, description="response_length/mean below this × its running median")
    entropy_floor: float | None = Field(0.02, ge=0, description="entropy (nats per token) below this, from the first step")
    entropy_drop: float | None = Field(0.05, gt=0, lt=1, description="entropy below this fraction of its initial value")
    kl_budget: float | None = Field(3.0, gt=0, description="KL to the reference in nats per sequence (kl × response_length/mean, or kl/seq)")
    kl_start_budget: float | None = Field(None, gt=0, description="β = 0: KL to the start policy (kl_start/seq, nats per sequence) "
                                          "above this; off by default: an honest run that sharpens its policy moves far from it")
    clip_frac_max: float | None = Field(0.3, gt=0, le=1, description="clip_frac/low + clip_frac/high above this")
    grad_norm_spike: float | None = Field(10.0, gt=1, description="grad_norm above this × its running median")
    dlogp_mean_max: float | None = Field(0.2, gt=0, description="consistency/dlogp_mean (nats) above this: trainer and sampler disagree")
    nonfinite: bool = Field(True, description="alarm on any NaN / inf value in the row (null in metrics.jsonl counts as NaN)")
    nonfinite_ignore: list[str] = Field(default_factory=lambda: ["reward/*", "rewards/*"],
                                        description="metric patterns that may be NaN (a reward mean is NaN when no reward applies)")
    show_samples: int = Field(3, ge=0, description="samples printed with an alarm")


@dataclass
class Alarm:
    name: str
    step: int
    value: float
    threshold: float
    message: str  # what crossed what, with the band it was judged against
    samples: list[dict] = field(default_factory=list)

    def format(self) -> str:
        lines = [f"[alarm] step {self.step}: {self.name}: {self.message}"]
        for i, s in enumerate(self.samples, 1):
            reward = s.get("reward")
            shown = f"{reward:.4g}" if isinstance(reward, (int, float)) else reward
            prompt = str(s.get("prompt", ""))[-160:].replace("\n", "⏎")
            completion = str(s.get("completion", ""))[:400].replace("\n", "⏎")
            lines.append(f"  sample {i} (reward {shown}, {len(str(s.get('completion', '')))} chars): "
                         f"prompt …{prompt!r} -> completion {completion!r}")
        return "\n".join(lines)


class AlarmStop(UserError):
    """Raised by `AlarmMonitor.act` when on_alarm says stop; `checkpoint` tells the recipe to save first."""

    def __init__(self, alarms: list[Alarm], checkpoint: bool):
        self.alarms, self.checkpoint = alarms, checkpoint
        how = "checkpoint_and_stop" if checkpoint else "stop"
        super().__init__(f"run stopped by on_alarm={how} at step {alarms[0].step}:\n"
                         + "\n".join(a.format() for a in alarms))


# ---------------------------------------------------------------- the checks (pure functions)


@dataclass
class Band:
    """The last `window` finite values of one metric before the current step."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    def mean(self) -> float:
        return statistics.fmean(self.values)

    def std(self) -> float:
        return statistics.pstdev(self.values) if self.n > 1 else 0.0

    def median(self) -> float:
        return statistics.median(self.values)


# a check: (settings, row of finite floats, bands, initial values) -> (value, threshold, message) | None
Check = Callable[[AlarmSettings, dict, dict, dict], "tuple[float, float, str] | None"]


def _ready(s: AlarmSettings, band: Band | None) -> bool:
    return band is not None and band.n >= s.warmup_steps


def reward_jump(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    v, band = row.get("reward/mean"), bands.get("reward/mean")
    if s.reward_jump_std is None or v is None or not _ready(s, band):
        return None
    std = max(band.std(), s.reward_jump_min_std)
    limit = band.mean() + s.reward_jump_std * std
    if v > limit:
        return v, limit, (f"reward/mean {v:.4g} > {limit:.4g} = running mean {band.mean():.4g} + "
                          f"{s.reward_jump_std:g} × std {std:.4g} (last {band.n} steps): read the top samples")
    return None


def length_blowup(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    v, band = row.get("response_length/mean"), bands.get("response_length/mean")
    if s.length_blowup is None or v is None or not _ready(s, band):
        return None
    limit = s.length_blowup * band.median()
    if v > limit:
        return v, limit, f"response_length/mean {v:.4g} > {s.length_blowup:g} × running median {band.median():.4g}"
    return None


def length_collapse(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    v, band = row.get("response_length/mean"), bands.get("response_length/mean")
    if s.length_collapse is None or v is None or not _ready(s, band):
        return None
    limit = s.length_collapse * band.median()
    if v < limit:
        return v, limit, f"response_length/mean {v:.4g} < {s.length_collapse:g} × running median {band.median():.4g}"
    return None


def entropy_collapse(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    v = row.get("entropy")
    if v is None:
        return None
    if s.entropy_floor is not None and v < s.entropy_floor:
        return v, s.entropy_floor, f"entropy {v:.4g} nats/token < floor {s.entropy_floor:g}"
    start = initial.get("entropy")
    if s.entropy_drop is not None and start is not None and len(start) >= s.warmup_steps:
        limit = s.entropy_drop * statistics.fmean(start)
        if v < limit:
            return v, limit, (f"entropy {v:.4g} < {s.entropy_drop:g} × initial {statistics.fmean(start):.4g} "
                              f"(mean of the first {len(start)} steps)")
    return None


def kl_budget(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    """Per-sequence KL: `kl/seq` when the step logs it, else the token-mean `kl` × response_length/mean
    (exact when every sample carries loss: Σ KL / tokens × tokens / samples)."""
    v, what = row.get("kl/seq"), "KL to the reference"
    if v is None and row.get("kl") is not None and row.get("response_length/mean") is not None:
        v = row["kl"] * row["response_length/mean"]
    budget = s.kl_budget
    if v is None and row.get("kl_start/seq") is not None:  # β = 0: no reference, the probe's KL to the start
        v, what, budget = row["kl_start/seq"], "KL to the start policy", s.kl_start_budget
    if v is not None and budget is not None and v > budget:
        return v, budget, f"{what} {v:.4g} nats per sequence > budget {budget:g}: check a held-out eval"
    return None


def clip_frac(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    parts = [row[k] for k in ("clip_frac/low", "clip_frac/high") if row.get(k) is not None]
    if s.clip_frac_max is None or not parts:
        return None
    v = sum(parts)
    if v > s.clip_frac_max:
        return v, s.clip_frac_max, f"clip fraction {v:.4g} (low + high) > {s.clip_frac_max:g}: the update moves too far"
    return None


def grad_norm_spike(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    v, band = row.get("grad_norm"), bands.get("grad_norm")
    if s.grad_norm_spike is None or v is None or not _ready(s, band) or band.median() <= 0:
        return None
    limit = s.grad_norm_spike * band.median()
    if v > limit:
        return v, limit, f"grad_norm {v:.4g} > {s.grad_norm_spike:g} × running median {band.median():.4g}"
    return None


def consistency(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    v = row.get("consistency/dlogp_mean")
    if s.dlogp_mean_max is not None and v is not None and v > s.dlogp_mean_max:
        return v, s.dlogp_mean_max, (f"consistency/dlogp_mean {v:.4g} nats > {s.dlogp_mean_max:g}: the trainer does "
                                     "not reproduce the sampler's log-probs (stale weights? precision?)")
    return None


def _initial_mean(s: AlarmSettings, initial: dict, key: str) -> float | None:
    values = initial.get(key) or []
    return statistics.fmean(values) if len(values) >= min(s.warmup_steps, 3) else None


def shaping_rise(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    """What the shaping parts pay (`reward/shaping` = reward/mean − the verifier parts' weighted means; only
    for a composition of verifiers and other terms) rose by more than `shaping_rise` over the first steps:
    the policy is being paid for something the task's verifier does not check."""
    v, start = row.get("reward/shaping"), _initial_mean(s, initial, "reward/shaping")
    if s.shaping_rise is None or v is None or start is None:
        return None
    limit = start + s.shaping_rise
    if v > limit:
        return v, limit, (f"the non-verifier reward parts pay {v:.3g} per sample, up from {start:.3g} in the first steps, "
                          f"while the verifier pays {row.get('reward/verifier', math.nan):.3g}: read the top samples")
    return None


def eval_gap(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    """On an evaluation step, the training reward (`eval/train_reward`: mean of the last `eval_gap_window`
    steps) against the held-out pass@1 under the trusted verifier: above it by more than `eval_gap`, or
    risen since the first evaluation by more than `eval_rise_gap` beyond what pass@1 rose while pass@1 stayed
    within the first evaluation's interval. Training pays what held-out correctness does not show."""
    held_out, train = row.get("eval/pass@1"), row.get("eval/train_reward")
    if held_out is None or train is None:
        return None
    if s.eval_gap is not None and train - held_out > s.eval_gap:
        return train - held_out, s.eval_gap, (f"training reward {train:.3g} (last steps) vs held-out pass@1 "
                                              f"{held_out:.3g}: a gap of {train - held_out:.3g} > {s.eval_gap:g}")
    first_train, first_eval = (initial.get("eval/train_reward") or [None])[0], (initial.get("eval/pass@1") or [None])[0]
    if s.eval_rise_gap is None or first_train is None or first_eval is None:
        return None
    rise = (train - held_out) - (first_train - first_eval)
    # ... while held-out pass@1 has not risen beyond the first evaluation's interval. A held-out gain outside it is
    # learning: the training reward (a mean of the last steps) lags the held-out score at a fast-learning first
    # evaluation, and growing out of that lag looks like a rise (honest GRPO on SmolLM2 through vLLM: gap -0.156 at
    # step 10, +0.094 at step 40, pass@1 0.519 [0.41, 0.62] -> 0.787; the format hack: pass@1 0.213 -> 0.167)
    first_high = (initial.get("eval/pass@1_high") or [None])[0]
    if first_high is not None and held_out > first_high:
        return None
    if rise > s.eval_rise_gap:
        return rise, s.eval_rise_gap, (f"since the first evaluation the training reward rose {train - first_train:+.3g} "
                                       f"({first_train:.3g} -> {train:.3g}) and held-out pass@1 {held_out - first_eval:+.3g} "
                                       f"({first_eval:.3g} -> {held_out:.3g}): {rise:.3g} > {s.eval_rise_gap:g}")
    return None


def length_reward(s: AlarmSettings, row: dict, bands: dict, initial: dict):
    """Longer samples earn more (within-step correlation of reward and length) while the mean length grew
    past `length_growth` × its first steps' level: length is being paid for."""
    corr, v = row.get("reward_length/corr"), row.get("response_length/mean")
    start = _initial_mean(s, initial, "response_length/mean")
    if s.length_reward_corr is None or corr is None or v is None or start is None or start <= 0:
        return None
    if corr > s.length_reward_corr and v > s.length_growth * start:
        return corr, s.length_reward_corr, (f"reward-length correlation {corr:.3g} > {s.length_reward_corr:g} while "
                                            f"response_length/mean {v:.4g} > {s.length_growth:g} × initial {start:.4g}")
    return None


def correlation(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation; None for fewer than 3 points or a constant side."""
    if len(xs) < 3:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def derived(numbers: dict, samples: list[dict], verifiers: dict[str, float]) -> dict:
    """The signals the hacking checks read, from the row and the step's samples: `reward/verifier` and
    `reward/shaping` (the weighted verifier parts and the rest of reward/mean; only when the reward mixes
    verifiers with other terms) and `reward_length/corr`."""
    out = {}
    parts = {k[len("rewards/"):-len("/mean")] for k in numbers if k.startswith("rewards/") and k.endswith("/mean")}
    if verifiers and "reward/mean" in numbers and parts - set(verifiers) and set(verifiers) <= parts:
        out["reward/verifier"] = sum(w * numbers[f"rewards/{n}/mean"] for n, w in verifiers.items())
        out["reward/shaping"] = numbers["reward/mean"] - out["reward/verifier"]
    scored = [(len(str(x.get("completion", ""))), float(x["reward"])) for x in samples
              if isinstance(x.get("reward"), (int, float)) and math.isfinite(x["reward"])]
    corr = correlation([a for a, _ in scored], [b for _, b in scored])
    if corr is not None:
        out["reward_length/corr"] = corr
    return out


# name -> (check, which samples to show)
CHECKS: dict[str, tuple[Check, str]] = {
    "reward_jump": (reward_jump, "reward"),
    "length_blowup": (length_blowup, "longest"),
    "length_collapse": (length_collapse, "shortest"),
    "entropy_collapse": (entropy_collapse, "first"),
    "shaping_rise": (shaping_rise, "reward"),
    "eval_gap": (eval_gap, "reward"),
    "length_reward": (length_reward, "longest"),
    "kl_budget": (kl_budget, "reward"),
    "clip_frac": (clip_frac, "first"),
    "grad_norm_spike": (grad_norm_spike, "first"),
    "consistency": (consistency, "first"),
}
NAMES = ("nonfinite", *CHECKS)
TRACKED = ("reward/mean", "response_length/mean", "grad_norm")  # metrics with a running band
INITIAL = ("entropy", "reward/shaping", "response_length/mean",  # metrics whose first warmup_steps values are kept
           "eval/train_reward", "eval/pass@1", "eval/pass@1_high")


def as_number(value) -> float | None:
    """A metric value as a float: tensors and numbers; None (NaN in metrics.jsonl) -> NaN; ±1e308 -> ±inf;
    anything else (strings, lists) -> None (not a metric)."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "numel") and hasattr(value, "item"):
        if value.numel() != 1:
            return None
        value = value.item()
    if not isinstance(value, (int, float)):
        return None
    value = float(value)
    return math.copysign(math.inf, value) if abs(value) >= INF_SENTINEL else value


def nonfinite_keys(row: dict, ignore: list[str]) -> list[str]:
    return [k for k, v in row.items() if not any(fnmatch.fnmatchcase(k, p) for p in ignore)
            and (x := as_number(v)) is not None and not math.isfinite(x)]


def pick_samples(samples: list[dict], how: str, k: int) -> list[dict]:
    if k <= 0 or not samples:
        return []
    if how == "reward":
        scored = [s for s in samples if isinstance(s.get("reward"), (int, float))]
        return sorted(scored, key=lambda s: -s["reward"])[:k]  # stable: ties keep the step's order
    if how in ("longest", "shortest"):
        return sorted(samples, key=lambda s: len(str(s.get("completion", ""))), reverse=how == "longest")[:k]
    return list(samples[:k])


# ---------------------------------------------------------------- the monitor


class AlarmMonitor:
    """Evaluates every alarm on each step's row; keeps the running bands (serialisable for resume)."""

    def __init__(self, settings: AlarmSettings | None = None, echo: Callable[[str], None] | None = None,
                 verifiers: dict[str, float] | None = None):
        """`verifiers`: name -> weight of the reward parts that check a ground truth (ComposedReward.verifiers)."""
        self.settings = settings or AlarmSettings()
        self.echo = echo or (lambda text: print(text, file=sys.stderr, flush=True))
        self.verifiers = dict(verifiers or {})
        self.history: dict[str, list[float]] = {k: [] for k in TRACKED}
        self.initial: dict[str, list[float]] = {k: [] for k in INITIAL}
        self.active: list[str] = []  # alarms that fired on the previous step (printing is on the rising edge)
        self.log: dict[str, dict] = {}  # name -> {"first_step", "steps", "last_step", "value", "threshold"}

    def check(self, step: int, row: dict, samples: list[dict] | None = None) -> list[Alarm]:
        """The alarms firing at `step`; prints those that were not firing on the previous step."""
        s, samples = self.settings, list(samples or [])
        numbers = {k: x for k, v in row.items() if (x := as_number(v)) is not None and math.isfinite(x)}
        numbers.update(derived(numbers, samples, self.verifiers))
        if "eval/pass@1" in numbers and "reward/mean" in numbers:  # the training reward an evaluation is held against
            recent = (self.history["reward/mean"] + [numbers["reward/mean"]])[-s.eval_gap_window:]
            numbers["eval/train_reward"] = statistics.fmean(recent)
        fired: list[Alarm] = []
        if s.nonfinite:
            bad = nonfinite_keys(row, s.nonfinite_ignore)
            if bad:
                fired.append(Alarm("nonfinite", step, math.nan, 0.0, f"non-finite values in {', '.join(sorted(bad))}",
                                   pick_samples(samples, "first", s.show_samples)))
        bands = {k: Band(v) for k, v in self.history.items() if v}
        for name, (fn, how) in CHECKS.items():
            hit = fn(s, numbers, bands, self.initial)
            if hit is not None:
                value, threshold, message = hit
                fired.append(Alarm(name, step, value, threshold, message, pick_samples(samples, how, s.show_samples)))
        self._observe(numbers)
        self._record(fired)
        return fired

    def _observe(self, numbers: dict) -> None:
        for k in TRACKED:
            if k in numbers:
                self.history[k] = (self.history[k] + [numbers[k]])[-self.settings.window:]
        for k in INITIAL:
            if k in numbers and len(self.initial[k]) < self.settings.warmup_steps:
                self.initial[k].append(numbers[k])

    def _record(self, fired: list[Alarm]) -> None:
        for a in fired:
            entry = self.log.setdefault(a.name, {"first_step": a.step, "steps": 0})
            value = a.value if math.isfinite(a.value) else None  # the state is JSON: no NaN
            entry.update(steps=entry["steps"] + 1, last_step=a.step, value=value, threshold=a.threshold)
            if a.name not in self.active:
                self.echo(a.format())
        self.active = [a.name for a in fired]

    @staticmethod
    def metrics(fired: list[Alarm]) -> dict[str, float]:
        """`alarm/<name>` = 1.0 for each firing alarm and `alarm/count` (0 on a quiet step)."""
        return {"alarm/count": float(len(fired)), **{f"alarm/{a.name}": 1.0 for a in fired}}

    def act(self, fired: list[Alarm]) -> None:
        """warn: nothing more; stop / checkpoint_and_stop: raise AlarmStop (the recipe saves when asked)."""
        if fired and self.settings.on_alarm != "warn":
            raise AlarmStop(fired, checkpoint=self.settings.on_alarm == "checkpoint_and_stop")

    def summary(self) -> dict:
        """For the report: per alarm that fired, its first and last step, how many steps, the last value."""
        return {name: dict(entry) for name, entry in self.log.items()}

    def state(self) -> dict:
        return {"history": {k: list(v) for k, v in self.history.items()},
                "initial": {k: list(v) for k, v in self.initial.items()},
                "active": list(self.active), "log": {k: dict(v) for k, v in self.log.items()}}

    def load(self, state: dict) -> None:
        self.history = {k: list(state.get("history", {}).get(k, [])) for k in TRACKED}
        self.initial = {k: list(state.get("initial", {}).get(k, [])) for k in INITIAL}
        self.active = list(state.get("active", []))
        self.log = {k: dict(v) for k, v in state.get("log", {}).items()}


def replay(records: list[dict], settings: AlarmSettings | None = None, verifiers: dict[str, float] | None = None
           ) -> dict[int, list[str]]:
    """Run the alarms over a recorded run: `records` = [{"row": metrics row, "samples": [...]}, ...] in step
    order (tests/fixtures/alarms, benchmarks/alarm_corpus.py). -> step -> names of the alarms firing."""
    monitor = AlarmMonitor(settings, echo=lambda text: None, verifiers=verifiers)
    return {r["row"]["step"]: [a.name for a in monitor.check(r["row"]["step"], r["row"], r.get("samples"))]
            for r in records}
