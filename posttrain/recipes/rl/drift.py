"""KL to the start policy when no reference is held (β = 0): a fixed probe set, re-scored every N steps.

At β = 0 (the default of DAPO, Dr. GRPO, GSPO, CISPO, RLOO, REINFORCE++ and the quickstart) no reference
model is loaded, so the loss computes no KL. The drift from the initial policy is still the number a
user watches for a run that wanders off (and what the KL-budget alarm reads). It is measured here
without a second model:

- at the first step, before the first update, `size` of the step's samples y ~ π₀ are kept (one per
  group first, so the set spans prompts) with their token log-probs under π₀ (the temperature-only
  distribution, as the reference is scored: no top-k/top-p truncation; in fp32, see `_score`);
- after the first update and every `every` steps after it, the same tokens are re-scored under π_θ (no grad) and

      KL(π₀ ‖ π_θ) ≈ mean over the probe's tokens of  k3 = r − 1 − log r,   r = π_θ(y_t) / π₀(y_t)

  (Schulman's k3: unbiased for KL(π₀‖π_θ) when y ~ π₀, never negative); `kl_start/seq` sums it over
  each sample's tokens (nats per sequence, the KL budget's unit).

Cost: one no-grad fp32 forward over `size` samples every `every` steps, each prompt once (shared prefix, as
in training). The quickstart's 16 samples of 4 prompts are about half its 32-sample training forward, in fp32
instead of bf16: on SmolLM2 (2 cores, a loaded machine) 3.7 s per probe, 7.6 s before the samples of one prompt
shared it; benchmarks/grpo_vs_trl.py shows it as the "kl probe" row. `kl_probe_every` trades it for resolution. The probe is checkpointed, so a resumed run keeps
measuring against the same π₀. Steps that do not measure carry no `kl_start` key (never a 0 that was not
measured). Off under torchrun (the ranks would have to agree on the probe set) and with a reference
loaded (then `kl` is the measured KL to π_ref).
"""

from __future__ import annotations

import torch

from posttrain.recipes.rl import phases as ph
from posttrain.rollout.trajectory import Trajectory, make_batches


def spread_pick(trajs: list[Trajectory], size: int) -> list[Trajectory]:
    """Up to `size` trajectories with at least one token, one per group in turn (round robin over groups)."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajs:
        if t.response_ids and t.num_loss_tokens:
            groups.setdefault(t.group, []).append(t)
    out, depth = [], 0
    while len(out) < size and any(len(g) > depth for g in groups.values()):
        out += [g[depth] for g in groups.values() if len(g) > depth][: size - len(out)]
        depth += 1
    return out


class DriftProbe:
    def __init__(self, every: int, size: int):
        self.every, self.size = every, size
        self.samples: list[tuple[list[int], list[int], list[tuple[int, int]]]] = []  # (prompt, response, loss spans)
        self.start_logp: list[list[float]] = []  # per sample: log π₀ of its loss tokens

    def _batch(self, run):
        groups: dict[tuple[int, ...], int] = {}  # samples of one prompt form a group: the row holds its prompt once
        trajs = [Trajectory(p, r, torch.zeros(sum(e - s for s, e in spans)), group=groups.setdefault(tuple(p), len(groups)),
                            loss_spans=[tuple(x) for x in spans])
                 for p, r, spans in self.samples]
        return make_batches(trajs, run.tok.pad_token_id or 0, 1 << 30, device=run.device)

    @torch.no_grad()
    def _score(self, run) -> list[torch.Tensor]:
        """log π_θ of every probe sample's loss tokens (temperature-only distribution), in probe order."""
        out = []
        for b in self._batch(run):
            # fp32 whatever the trainer's autocast: under bf16 a step flips many weights by one bf16 ulp, a noise
            # floor (~0.1 nats/token on SmolLM2) that would hide the drift; the engine samples the fp32 weights
            logp, _ = ph.policy_logps(run.model, b, run.cfg.sampling.temperature, "none", truncated=False)
            out += [logp[i, : int(b.mask[i].sum())].float().cpu() for i in range(logp.shape[0])]
        return out

    def capture(self, run, trajs: list[Trajectory]) -> None:
        """Keep the probe set and its π₀ log-probs (once: the first step, before its update)."""
        if self.samples:
            return
        picked = spread_pick(trajs, self.size)
        self.samples = [(list(t.prompt_ids), list(t.response_ids), [list(s) for s in t.loss_spans]) for t in picked]
        if self.samples:
            self.start_logp = [x.tolist() for x in self._score(run)]

    def measure(self, run, step: int) -> dict:
        """{'kl_start', 'kl_start/seq'} on the steps it runs (the first, then every `every`-th), else {}."""
        if not self.samples or step % self.every:
            return {}
        k3_tokens, per_seq = [], []
        for now, start in zip(self._score(run), self.start_logp):
            log_r = now - torch.tensor(start)  # log π_θ/π₀ per token
            k3 = torch.expm1(log_r) - log_r
            k3_tokens.append(k3)
            per_seq.append(float(k3.sum()))
        tokens = torch.cat(k3_tokens)
        return {"kl_start": float(tokens.mean()), "kl_start/seq": sum(per_seq) / len(per_seq)}

    def state(self) -> dict:
        return {"samples": self.samples, "start_logp": self.start_logp}

    def load(self, state: dict) -> None:
        self.samples = [(list(p), list(r), [list(s) for s in spans]) for p, r, spans in state.get("samples", [])]
        self.start_logp = [list(x) for x in state.get("start_logp", [])]
