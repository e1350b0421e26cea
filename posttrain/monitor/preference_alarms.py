"""Alarms of offline preference training (docs/preference.md), raised from the metrics of each step.

    likelihood displacement   the chosen *and* the rejected log-probs both fall below the reference's
                              (mean log π_θ − log π_ref < 0 for both) for `patience` steps in a row:
                              DPO is widening the margin by pushing both down, moving probability mass
                              to responses that are neither (Razin et al. 2024, "Unintentional
                              Unalignment"; Pal et al. 2024, "Smaug"). Needs a reference (not orpo/simpo).
    length growth             sampled responses of the policy are more than `max_ratio` (1.3) times as
                              long as the reference's on the same prompts (Park et al. 2024, "Disentangling
                              Length from Quality in DPO").

An alarm is a 0/1 metric every step (`alarm/likelihood_displacement`, `alarm/length_growth`); the first
time one fires a warning is printed and the step recorded (`fired`, reported in summary.json).
"""

from __future__ import annotations

import sys

# what to try when DPO's responses grow (summed log-probs reward length: Park et al. 2024, "Disentangling Length
# from Quality in DPO"): the length-normalised losses
LENGTH_HINT = ("the summed log-probs of dpo favour longer responses: try a length-normalised loss, loss=simpo "
               "(no reference, average log-probs) or loss=dpo_norm (length-normalised DPO, Tülu 3)")


class PreferenceAlarms:
    def __init__(self, patience: int = 3, max_length_ratio: float = 1.3, stream=None):
        self.patience, self.max_length_ratio = patience, max_length_ratio
        self.streak = 0
        self.fired: dict[str, int] = {}  # alarm -> first step it fired
        self.stream = stream if stream is not None else sys.stderr

    def update(self, step: int, row: dict) -> dict:
        """0/1 alarm metrics for this step's row (reads logratio/chosen, logratio/rejected, length/ratio)."""
        out = {}
        chosen, rejected = row.get("logratio/chosen"), row.get("logratio/rejected")
        if chosen is not None and rejected is not None:
            self.streak = self.streak + 1 if (chosen < 0 and rejected < 0) else 0
            out["alarm/likelihood_displacement"] = int(self.streak >= self.patience)
            if out["alarm/likelihood_displacement"]:
                self._fire("likelihood_displacement", step,
                           f"chosen and rejected log-probs both below the reference for {self.streak} steps "
                           f"(log-ratio chosen {chosen:.3f}, rejected {rejected:.3f})")
        ratio = row.get("length/ratio")
        if ratio is not None:
            out["alarm/length_growth"] = int(ratio > self.max_length_ratio)
            if out["alarm/length_growth"]:
                self._fire("length_growth", step, f"sampled responses are {ratio:.2f}x the reference's length "
                           f"(alarm above {self.max_length_ratio:.2f}x); {LENGTH_HINT}")
        return out

    def _fire(self, name: str, step: int, message: str) -> None:
        if name not in self.fired:
            self.fired[name] = step
            print(f"ALARM step {step}: {name}: {message}", file=self.stream, flush=True)

    def state(self) -> dict:
        return {"streak": self.streak, "fired": dict(self.fired)}

    def load(self, state: dict) -> None:
        self.streak, self.fired = state.get("streak", 0), dict(state.get("fired", {}))
