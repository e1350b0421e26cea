"""A learnability curriculum over prompts (`curriculum=band` in `posttrain rl`, docs/rl.md).

Each prompt's pass rate is tracked across steps from its groups' rewards, and prompts outside the band
low < p < high (`algos.filters.in_band`; default 0.2 < p < 0.8, where the reward variance p(1 − p) of a
0/1 verifier, and so the group-relative signal, is largest) are drawn less often, but never not at all:

    pass        a sample passes when its reward > pass_threshold (the rule of algos.adv_estimators'
                groups/all_pass_frac); rewards that are None do not count
    estimate    after the n-th group of a prompt with pass fraction f_n:
                    p_n = p_{n-1} + a_n (f_n − p_{n-1}),   a_n = max(1/n, rate)
                the running mean of its first groups, then an exponential average with weight `rate` on
                the newest (p_1 = f_1); a prompt is its text: rows with the same prompt share one estimate
    weight      w(row) = 1 when its prompt is unseen or in the band, `floor` (0 < floor <= 1) otherwise;
                a draw picks row r with probability w_r / Σ w (k rows of a step without replacement), so a
                prompt that leaves the band is still drawn now and then, and can come back

With every prompt unseen or in the band the draw is uniform over rows: a mixture's row counts keep their
meaning. The draws are seeded by (seed, draw number) and the tracked rates are plain numbers, so `state()`
resumes exactly; `curriculum=none` keeps the epoch order of `data_order.EpochSampler` untouched.
"""

from __future__ import annotations

import hashlib
import json

import torch
from pydantic import Field, ValidationError, model_validator

from posttrain.algos.filters import in_band
from posttrain.config import Config
from posttrain.errors import UserError
from posttrain.training.data_order import EpochSampler


class CurriculumArgs(Config):
    """`curriculum_args` of `curriculum=band` (checked when the config is read)."""

    low: float = Field(0.2, ge=0, le=1, description="band's lower bound: prompts with pass rate <= low are drawn less")
    high: float = Field(0.8, ge=0, le=1, description="band's upper bound: prompts with pass rate >= high are drawn less")
    pass_threshold: float = Field(0.5, description="a sample passes when its reward > pass_threshold")
    floor: float = Field(0.1, gt=0, le=1, description="weight of a prompt outside the band (in the band or unseen: 1)")
    rate: float = Field(0.5, gt=0, le=1, description="weight of the newest group in the pass-rate estimate, once 1/n < rate")

    @model_validator(mode="after")
    def _check(self):
        if not self.low < self.high:
            raise ValueError(f"curriculum band needs 0 <= low < high <= 1 (got low={self.low}, high={self.high})")
        return self


def curriculum_args(given: dict) -> CurriculumArgs:
    """curriculum_args -> CurriculumArgs; a bad key or value -> ValueError naming it (a config error)."""
    try:
        return CurriculumArgs(**given)
    except ValidationError as e:
        problems = "; ".join(problem(err) for err in e.errors())
        raise ValueError(f"curriculum_args: {problems} (keys: {', '.join(CurriculumArgs.model_fields)})") from None


def problem(err: dict) -> str:
    """One pydantic error of curriculum_args as 'key: what is wrong'."""
    msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    return f"{'.'.join(map(str, err['loc']))}: {msg}" if err["loc"] else msg


def make_sampler(curriculum: str, args: dict, prompts: list, seed: int) -> EpochSampler | BandSampler:
    """The data order of a run: `none` -> EpochSampler (exactly as before), `band` -> BandSampler.
    prompts (N,): each row's prompt (`prompt_of(row.data)`)."""
    if curriculum == "none":
        return EpochSampler(len(prompts), seed)
    return BandSampler(prompts, seed, curriculum_args(args))


def restore_sampler(sampler: EpochSampler | BandSampler, state: dict) -> None:
    """Resume the data order from a checkpoint's `sampler` state, refusing one of the other kind."""
    if isinstance(sampler, EpochSampler) and "kind" in state:
        raise UserError(f"the checkpoint was written with curriculum={state['kind']}: resume with the same "
                        "curriculum, or start over with fresh=true")
    sampler.load(state)


def prompt_of(data: dict):
    """The part of a row that names its prompt: `prompt` (string or conversation), else the whole row."""
    return data.get("prompt", data)


def prompt_key(prompt) -> str:
    """A prompt's identity: a short hash of its canonical JSON (a string or a conversation)."""
    text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def pass_fraction(rewards: list[float | None], pass_threshold: float) -> float | None:
    """Share of the applicable rewards above the threshold; None when no reward applies."""
    scored = [r for r in rewards if r is not None]
    return sum(r > pass_threshold for r in scored) / len(scored) if scored else None


class PassRates:
    """key -> (groups seen n, estimated pass rate p), updated as the module docstring says."""

    def __init__(self, rate: float):
        self.rate = rate
        self.seen: dict[str, tuple[int, float]] = {}

    def update(self, key: str, fraction: float) -> None:
        n, p = self.seen.get(key, (0, 0.0))
        n += 1
        a = max(1.0 / n, self.rate)
        self.seen[key] = (n, p + a * (fraction - p))

    def get(self, key: str) -> float | None:
        item = self.seen.get(key)
        return None if item is None else item[1]


class BandSampler:
    """The data order of `curriculum=band`: `take(k)` draws k row indices by the band weights; `observe`
    feeds back each group's rewards. Same interface as EpochSampler (take, state, load)."""

    kind = "band"

    def __init__(self, prompts: list, seed: int, args: CurriculumArgs | None = None):
        if not prompts:
            raise UserError("no training rows left after filtering")
        args = args or CurriculumArgs()
        self.keys = [prompt_key(p) for p in prompts]  # (N,) one per row
        self.seed, self.low, self.high, self.floor = seed, args.low, args.high, args.floor
        self.pass_threshold = args.pass_threshold
        self.rates = PassRates(args.rate)
        self.draws = 0
        self.drawn_status: list[int] = []  # status (0/1/2) of the rows drawn since the last step_metrics

    def status(self) -> torch.Tensor:
        """(N,) long per row: 0 unseen, 1 in the band, 2 outside it."""
        p = torch.tensor([self.rates.get(k) if k in self.rates.seen else float("nan") for k in self.keys],
                         dtype=torch.float64)
        seen = ~torch.isnan(p)
        band = in_band(torch.nan_to_num(p), low=self.low, high=self.high) & seen
        return torch.where(~seen, 0, torch.where(band, 1, 2))

    def probabilities(self, status: torch.Tensor | None = None) -> torch.Tensor:
        """(N,) float64: the chance each row is the next single draw, w_r / Σ w."""
        status = self.status() if status is None else status
        w = torch.ones(len(self.keys), dtype=torch.float64)
        w[status == 2] = self.floor
        return w / w.sum()

    def take(self, k: int) -> list[int]:
        """k row indices; without replacement within one call (with replacement past N). The status of
        each drawn row is kept for the step's metrics (`step_metrics`)."""
        g = torch.Generator().manual_seed(self.seed * 1000003 + 7919 * self.draws + 17)
        self.draws += 1
        status = self.status()
        probs, out = self.probabilities(status), []
        while len(out) < k:
            m = min(k - len(out), len(self.keys))
            out += torch.multinomial(probs, m, replacement=False, generator=g).tolist()
        self.drawn_status += status[out].tolist()
        return out

    def observe(self, prompt, rewards: list[float | None]) -> None:
        """One group of `prompt` was scored: fold its pass fraction into the prompt's estimate."""
        f = pass_fraction(rewards, self.pass_threshold)
        if f is not None:
            self.rates.update(prompt_key(prompt), f)

    def step_metrics(self) -> dict:
        """curriculum/* of a step: the tracked prompts, and the status of the rows drawn since the last call
        (when they were drawn)."""
        drawn, self.drawn_status = self.drawn_status, []
        tracked = [p for _, p in self.rates.seen.values()]
        inside = int(in_band(torch.tensor(tracked, dtype=torch.float64), low=self.low, high=self.high).sum()) if tracked else 0
        return {"curriculum/prompts_seen": len(tracked), "curriculum/prompts": len(set(self.keys)),
                "curriculum/in_band_frac": inside / len(tracked) if tracked else 0.0,
                "curriculum/pass_rate_mean": sum(tracked) / len(tracked) if tracked else 0.0,
                **drawn_metrics(drawn)}

    def state(self) -> dict:
        return {"kind": self.kind, "n": len(self.keys), "draws": self.draws,
                "rates": {k: [n, p] for k, (n, p) in self.rates.seen.items()}}

    def load(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise UserError("the checkpoint was written with curriculum=none: resume with the same curriculum, "
                            "or start over with fresh=true")
        if state.get("n", len(self.keys)) != len(self.keys):
            raise UserError(f"resume: the data has {len(self.keys)} training rows, the checkpoint's run had "
                            f"{state['n']}: resume with the same data, or start over with fresh=true")
        self.draws = state["draws"]
        self.rates.seen = {k: (int(n), float(p)) for k, (n, p) in state["rates"].items()}


def drawn_metrics(status_of_drawn: list[int]) -> dict:
    """Shares of a step's drawn rows that were unseen / in the band / outside it when drawn."""
    n = max(len(status_of_drawn), 1)
    return {"curriculum/drawn_unseen_frac": status_of_drawn.count(0) / n,
            "curriculum/drawn_in_band_frac": status_of_drawn.count(1) / n,
            "curriculum/drawn_out_band_frac": status_of_drawn.count(2) / n}
