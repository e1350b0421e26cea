"""Sampled response length of the policy on a few fixed prompts (the length-growth alarm of offline
preference training: DPO has no generation of its own, so the probe samples).

    probe = LengthProbe(model, tok, prompts, settings, backend="auto")
    reference = probe.measure()      # before the first update: the reference's length
    ...
    ratio = probe.measure() / reference

Fixed seeds per prompt, so two measurements differ only through the weights. The backend
(rollout/backends.py) samples the trainer's own weights; `sync_weights()` before each measurement.
"""

from __future__ import annotations

from pydantic import Field

from posttrain.config import Config
from posttrain.rollout.types import Request, SamplingParams


class LengthProbeSettings(Config):
    prompts: int = Field(8, ge=0, description="prompts sampled at every eval to measure response length (0: no length probe)")
    max_new_tokens: int = Field(256, ge=1, description="generation limit of the probe")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of the probe (0 = greedy)")
    alarm_ratio: float = Field(1.3, gt=1, description="alarm when sampled responses are longer than this times the reference's")


class LengthProbe:
    def __init__(self, model, tok, prompts: list[list[int]], settings: LengthProbeSettings, seed: int = 0,
                 backend: str = "auto"):
        from posttrain.rollout.backends import build_backend  # torch: this module stays torch-free
        from posttrain.rollout.engine import EngineConfig

        self.model, self.settings, self.seed = model, settings, seed
        self.prompts = prompts[: settings.prompts]
        longest = max(len(p) for p in self.prompts) + settings.max_new_tokens
        self.backend = build_backend(backend, model, tok, EngineConfig(max_num_seqs=len(self.prompts), max_model_len=longest,
                                                                       kv_cache_mb=256, seed=seed), echo=None)

    def measure(self) -> float:
        """Mean generated tokens over the probe prompts."""
        self.backend.sync_weights()  # the optimizer changed the shared weights in place
        s = self.settings
        reqs = [Request(p, SamplingParams(n=1, temperature=s.temperature, max_new_tokens=s.max_new_tokens,
                                          seed=self.seed * 1009 + i)) for i, p in enumerate(self.prompts)]
        was_training = self.model.training
        self.model.eval()
        try:
            outs = self.backend.generate(reqs)
        finally:
            self.model.train(was_training)
        lengths = [len(c.token_ids) for o in outs for c in o.samples]
        return sum(lengths) / max(len(lengths), 1)
