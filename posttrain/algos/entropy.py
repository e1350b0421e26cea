"""The coefficient of an entropy bonus in the policy loss (docs/algorithms.md "Entropy bonus and control").

Per loss token the policy loss becomes ℓ_t − c·H_t, H_t = −Σ_v π(v|s_t) log π(v|s_t) the entropy of the
temperature-only distribution (its exact gradient, ∂H/∂z_v = −p_v (log p_v + H), comes from
`posttrain.ops.logprobs`). c comes from one of:

    FixedEntropyCoef(c)                      c every step (`entropy_coef`; 0 = off)
    AdaptiveEntropyCoef(c0, target, delta)   Skywork-OR1's adaptive entropy control (He et al. 2025, "Skywork
                                             Open Reasoner 1 Technical Report", §4 "adaptive entropy control";
                                             target 0.2, Δ 0.005 there):
                                                 c_{k+1} = c_k + Δ  if H_k < target
                                                           max(c_k − Δ, 0)  if H_k > target
                                             and the bonus acts only while H_k <= target (c applied 0 above it).

H_k is the mean entropy per loss token of step k (the `entropy` metric); the coefficient of step k+1 follows
it (a one-step lag: step k's entropy is known once its update has run). Both controllers have the same
interface: `coef()` (the c of the coming step), `update(entropy)`, `state()` / `load(state)` (checkpointed).
"""

from __future__ import annotations


class FixedEntropyCoef:
    def __init__(self, value: float = 0.0):
        self.value = float(value)

    def coef(self) -> float:
        return self.value

    @property
    def active(self) -> bool:
        """Whether the run has an entropy bonus at all (the metrics `entropy/coef`, `entropy/bonus` are logged)."""
        return self.value > 0

    def update(self, entropy: float) -> None:
        pass

    def state(self) -> dict:
        return {}

    def load(self, state: dict) -> None:
        pass


class AdaptiveEntropyCoef:
    def __init__(self, init: float, target: float, delta: float):
        if init < 0 or target <= 0 or delta <= 0:
            raise ValueError(f"need init >= 0, target > 0, delta > 0; got {init}, {target}, {delta}")
        self.value, self.target, self.delta = float(init), float(target), float(delta)
        self.last: float | None = None  # H of the last step (None before the first)

    active = True

    def coef(self) -> float:
        """c of the coming step: 0 while the last step's entropy is above the target."""
        return self.value if self.last is None or self.last <= self.target else 0.0

    def update(self, entropy: float) -> None:
        self.last = float(entropy)
        if entropy < self.target:
            self.value += self.delta
        elif entropy > self.target:
            self.value = max(self.value - self.delta, 0.0)

    def state(self) -> dict:
        return {"value": self.value, "last": self.last}

    def load(self, state: dict) -> None:
        if state:
            self.value, self.last = float(state["value"]), state["last"]
