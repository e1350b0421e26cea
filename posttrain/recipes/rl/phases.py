"""The phases of one RL step (posttrain/recipes/rl/step.py calls them in order). Each takes typed records and
returns typed records plus its metrics; metric names are prefixed by what they measure so phases
never overwrite each other (`merge_metrics` refuses a collision).

    collect    generate G samples per prompt -> Trajectory; score; filter (dynamic sampling)
    advantage  outcome advantages over the samples whose reward applies
    reference  log π_ref on the loss tokens (β > 0), temperature-only distribution
    update     policy loss (+ β·KL) of a micro-batch, consistency of trainer and sampler

PPO's critic phases are in ppo.py, online DPO's in online_dpo.py.
"""

from __future__ import annotations

import math

import torch

from posttrain.algos import aggregate, dynamic_sampling, kl_estimate
from posttrain.algos.adv_estimators import group_metrics, takes_lengths
from posttrain.data import formats
from posttrain.data.templates import render_prompt
from posttrain.models.forward import backbone_and_head, hidden_states
from posttrain.models.lora import reference_view
from posttrain.rollout.trajectory import RLBatch, Trajectory, split_inert
from posttrain.rollout.types import Request

# ---------------------------------------------------------------- collect


def generate(engine, tok, rows: list[formats.Row], first_group: int, cfg, seed: int, version: int) -> list[Trajectory]:
    """`group_size` samples of each row's prompt; group ids first_group, first_group + 1, …"""
    requests = requests_for(tok, rows, cfg, seed)
    out = []
    for i, res in enumerate(engine.generate(requests)):
        out += trajectories(res, rows[i], tok, first_group + i, version)
    return out


def batch_seed(seed: int, step: int, rounds: int = 0) -> int:
    """Seed of the requests of one generation round (row i of the round samples with batch_seed + i)."""
    return seed * 7919 + step * 1009 + rounds * 97


def requests_for(tok, rows: list[formats.Row], cfg, seed: int) -> list[Request]:
    """One request of `group_size` samples per row; row i samples with seed + i."""
    return [Request(render_prompt(tok, r.data["prompt"]), cfg.sampling.params(n=cfg.group_size, seed=seed + i),
                    request_id=i) for i, r in enumerate(rows)]


def trajectories(res, row: formats.Row, tok, group: int, version: int) -> list[Trajectory]:
    """The samples of one request output as trajectories of one group, sampled by policy `version`."""
    if res.error:
        raise row.error("prompt", f"generation refused: {res.error}")
    out = []
    for c in res.samples:
        text = c.text if c.text is not None else tok.decode(c.token_ids, skip_special_tokens=True)
        kept = getattr(c, "kept_counts", None)
        out.append(Trajectory(
            res.prompt_token_ids, list(c.token_ids), torch.tensor(c.logprobs, dtype=torch.float32), group,
            kept=torch.tensor(kept, dtype=torch.long) if kept is not None else None, policy_version=version,
            finish_reason=c.finish_reason, text=text))
    return out


def score(reward_fn, rows_by_group: dict[int, formats.Row], trajs: list[Trajectory]) -> None:
    """Fill `reward`. Dataset columns are passed per sample (TRL convention), and `completion_ids`
    (the response token ids) so length-based rewards count tokens."""
    rows = [rows_by_group[t.group] for t in trajs]
    extra = {k for row in rows for k in row.data if k not in ("prompt", "messages")}
    columns = {k: [row.data.get(k) for row in rows] for k in extra}
    columns["completion_ids"] = [t.response_ids for t in trajs]
    values = reward_fn([row.data["prompt"] for row in rows], [t.text for t in trajs], **columns)
    for t, v in zip(trajs, values):
        t.reward = v
        t.valid = v is not None


def refill_groups(run, produce) -> tuple[list[Trajectory], dict]:
    """Collect `prompts_per_step` groups. `produce(rows, first_group, round)` turns new prompt rows into scored
    trajectories (groups numbered from first_group). With dynamic sampling (DAPO), groups without signal are
    dropped and refilled with new prompts, at most `max_resample` extra rounds; when no group has signal the
    last round is kept. -> (trajectories, {"dynamic/rounds", "dynamic/groups_dropped"})"""
    cfg = run.cfg
    kept: list[Trajectory] = []
    last: list[Trajectory] = []
    seen = rounds = dropped = 0
    while True:
        need = cfg.prompts_per_step - len({t.group for t in kept})
        new = produce([run.rows[i] for i in run.sampler.take(need)], seen, rounds)
        seen, rounds, last = seen + need, rounds + 1, new
        if run.dynamic:
            new, n_drop = informative_groups(new)
            dropped += n_drop
        kept += new
        if not run.dynamic or len({t.group for t in kept}) >= cfg.prompts_per_step or rounds > cfg.max_resample:
            break
    kept = kept or last
    if run.dynamic:
        kept = kept[: cfg.prompts_per_step * cfg.group_size]
    return kept, {"dynamic/rounds": rounds, "dynamic/groups_dropped": dropped}


def informative_groups(trajs: list[Trajectory]) -> tuple[list[Trajectory], int]:
    """Dynamic sampling (DAPO): keep the groups whose applicable rewards are not all equal; a group
    with fewer than two applicable rewards has no signal either. Returns (kept trajectories, groups dropped)."""
    scored = [t for t in trajs if t.reward is not None]
    groups = {t.group for t in trajs}
    if not scored:
        return [], len(groups)
    res = dynamic_sampling(torch.tensor([t.reward for t in scored], dtype=torch.float64),
                           torch.tensor([t.group for t in scored]))
    keep = set(res.kept_groups.tolist())
    return [t for t in trajs if t.group in keep], len(groups) - len(keep)


# ---------------------------------------------------------------- advantage


def assign_advantages(trajs: list[Trajectory], adv_fn, mask_truncated: bool) -> dict:
    """Outcome advantages from the samples whose reward applies (None is left out of the baseline and
    the loss). With `mask_truncated`, samples cut at the length limit keep their place in the
    baseline but carry no loss (DAPO's overlong filtering). adv_fn=None (PPO: the critic gives token
    advantages later) only marks which samples carry loss."""
    scored = [t for t in trajs if t.reward is not None]
    for t in trajs:
        t.advantage, t.valid = 0.0, t.reward is not None and not (mask_truncated and t.finish_reason == "length")
    if not scored:
        return {}
    rewards = torch.tensor([t.reward for t in scored], dtype=torch.float64)  # exact equality tests, no fp32 residue
    groups = torch.tensor([t.group for t in scored])
    if adv_fn is None:  # PPO: its advantages come from GAE, the groups' reward health is the same signal
        return ppo_group_metrics(rewards, groups)
    extra = {}
    if takes_lengths(adv_fn):  # token-level whitening (REINFORCE++): loss tokens per sample, 0 when it carries no loss
        extra["lengths"] = torch.tensor([t.num_loss_tokens if t.valid else 0 for t in scored], dtype=torch.float64)
    adv, metrics = adv_fn(rewards, groups, **extra)
    for t, a in zip(scored, adv.tolist()):
        t.advantage = a
    return metrics


def ppo_group_metrics(rewards: torch.Tensor, groups: torch.Tensor) -> dict:
    """PPO's `groups/*`: all_pass_frac / all_fail_frac of each prompt's samples (one sample per prompt: the
    pass and fail rates), and zero_adv_frac (groups whose rewards are all equal: no contrast within the
    group) only where groups hold several samples (a group of one is always flat)."""
    out = {k: v for k, v in group_metrics(rewards, groups, torch.zeros_like(rewards)).items() if k.startswith("groups/")}
    if int(torch.unique(groups, return_counts=True)[1].max()) < 2:
        out.pop("groups/zero_adv_frac")
    return out


# ---------------------------------------------------------------- forward


def policy_logps(model, batch: RLBatch, temperature: float, mixed_precision: str, truncated: bool,
                 with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(a_t|s_t) of the loss tokens -> ((S, L), entropy (S, L) | None).

    truncated=True: the distribution the engine sampled from (temperature, then the kept set of a
    top-k/top-p draw, identified by its size so the two sides agree by construction);
    truncated=False: the temperature-only distribution (reference and KL: a token outside the
    reference's nucleus must not get log-prob −inf). entropy_grad: the entropy keeps its gradient (an entropy
    bonus; the temperature-only path only, which the config ensures)."""
    _, head = backbone_and_head(model)
    h = hidden_states(model, batch, mixed_precision, layout=batch.layout, tie=head.tie)  # (1, T, H)
    h = h.reshape(-1, h.shape[-1]).index_select(0, batch.hidden_index)  # (M, H) only where a loss token is predicted
    # the model's own logit transform (soft-cap, scale), in tiles: never (M x V) logits at once
    logp, ent = head.logprobs(h, batch.targets, temperature, kept=batch.kept if truncated else None,
                              with_entropy=with_entropy)
    if ent is not None and not entropy_grad:
        ent = ent.detach()
    return batch.spread(logp), (batch.spread(ent) if ent is not None else None)


@torch.no_grad()
def reference_logps(ref, batches: list[RLBatch], cfg) -> None:
    with reference_view(ref) as model:  # a frozen copy, or the LoRA policy with its adapter off
        for b in batches:
            b.ref_logp, _ = policy_logps(model, b, cfg.sampling.temperature, cfg.mixed_precision, truncated=False)


# ---------------------------------------------------------------- update


def inert_split(run, b: RLBatch, entropy_coef: float) -> tuple[RLBatch | None, RLBatch | None]:
    """(live, inert) sub-batches of b (`trajectory.split_inert`) when an inert group's loss provably adds nothing
    to the gradient: zero_advantage != train, a loss whose gradient vanishes at A = 0 (`run.inert_loss`), no β·KL
    term, no entropy bonus, no critic, one process (FSDP's ranks must run the same backwards). Else (b, None)."""
    if (run.cfg.zero_advantage == "train" or not run.inert_loss or run.loss_beta > 0 or entropy_coef > 0
            or run.critic is not None or run.info.world > 1):
        return b, None
    return split_inert(b, run.tok.pad_token_id)


def zero_missing_grads(model: torch.nn.Module) -> None:
    """p.grad = 0 for trainable parameters without one: a minibatch whose every group was inert ran no backward,
    and the step must still be AdamW's step on a zero gradient (moments decay, the update follows them)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def minibatches(batches: list[RLBatch], n: int) -> list[list[RLBatch]]:
    """The batch split in `n` minibatches of whole micro-batches (round robin)."""
    return [batches[i::n] for i in range(min(n, len(batches)))]


class TokenMeans:
    """Loss metrics averaged over loss tokens across micro-batches (a micro-batch's mean weighs by its
    tokens); `/min` and `/max` metrics take the extreme instead."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weight = 0.0

    def add(self, metrics: dict, tokens: float) -> None:
        self.weight += tokens
        for k, v in metrics.items():
            v = float(v)
            if k.endswith("/min"):
                self.sums[k] = min(self.sums.get(k, math.inf), v)
            elif k.endswith("/max"):
                self.sums[k] = max(self.sums.get(k, -math.inf), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * tokens

    def merge(self, sums: dict, weight: float) -> None:
        """Fold in another TokenMeans' sums and weight (another rank's)."""
        self.weight += weight
        for k, v in sums.items():
            if k.endswith("/min"):
                self.sums[k] = min(self.sums.get(k, math.inf), v)
            elif k.endswith("/max"):
                self.sums[k] = max(self.sums.get(k, -math.inf), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v

    def result(self) -> dict:
        w = max(self.weight, 1.0)
        return {k: (v if k.endswith(("/min", "/max")) else v / w) for k, v in self.sums.items()}


def consistency(batch: RLBatch, old: torch.Tensor) -> dict:
    """Trainer vs engine on the sampled tokens: |Δ log p| and KL(μ‖π) ≈ E_μ[log μ − log π] (sums)."""
    m = batch.mask
    d = (old - batch.behaviour_logp).abs() * m
    return {"dlogp_max": float(d.max()) if m.any() else 0.0, "dlogp_sum": float(d.sum()),
            "kl_sum": float(((batch.behaviour_logp - old) * m).sum()), "tokens": int(m.sum())}


def batch_loss(logp, b: RLBatch, loss_fn, cfg, beta: float, kl_est: str, tis_cap: float | None, norms: dict,
               entropy: torch.Tensor | None = None, entropy_coef: float = 0.0):
    """Scalar loss of one micro-batch (its exact share of the step's loss) and its metrics. With `entropy`
    (S, L) carrying its gradient: per-token loss ℓ_t − entropy_coef·H_t (an entropy bonus) before aggregation."""
    mask = b.loss_mask
    extra = dict(cfg.loss_args)
    if tis_cap:
        extra.update(behaviour_logp=b.behaviour_logp, tis_cap=tis_cap)
    tok_loss, metrics = loss_fn(logp, b.old_logp, b.advantages, mask, **extra)
    if beta > 0:
        kl_tok = kl_estimate(logp, b.ref_logp, kl_est)
        tok_loss = tok_loss + beta * kl_tok
        metrics["kl/mean"] = (kl_tok.detach() * mask).sum() / mask.sum().clamp(min=1)
    if entropy is not None and entropy_coef > 0:
        tok_loss = tok_loss - entropy_coef * entropy
    loss = aggregate(tok_loss, mask, norms["agg"], norm_tokens=norms["tokens"], max_len=cfg.sampling.max_new_tokens,
                     num_sequences=norms["seqs"])
    return loss, metrics
