"""Advantage estimators (docs/algorithms.md).

Outcome-reward estimators share one signature (registry level "outcome"):

    f(rewards (N,), group_ids (N,) long, **hp) -> (advantages (N,), metrics)

N = prompts × samples per prompt; samples of one prompt share a group id (any integers). The
advantage of a sequence is broadcast over its tokens by the policy loss. `gae` (level "token") takes
token-level rewards and values instead:

    gae(token_rewards (B, T), values (B, T), mask (B, T), gamma, lam) -> (advantages, returns)

Every group-baseline estimator gives exactly 0 to a group whose rewards are all equal (compared
exactly): in float32 the mean of eight 1.2s is not 1.2, and dividing that rounding residue by a
tiny std would hand every sample the same large advantage (8 × 1.2 -> A ≈ +0.106 before this rule).

Metrics are 0-dim tensors (no .item() here): adv/mean, adv/std (reward statistics belong to the
reward phase, which knows which samples were skipped), groups/zero_adv_frac (all rewards in the group equal -> zero advantage, zero gradient),
groups/all_pass_frac, groups/all_fail_frac (a sample passes when reward > pass_threshold).
"""

from __future__ import annotations

import inspect

import torch

from posttrain.algos._groups import group_index, group_max, group_mean, group_min, group_std, group_sum
from posttrain.algos.registry import advantages as registry
from posttrain.ops.masked import masked_mean, masked_var


def _check(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both be (N,); got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )


def group_metrics(rewards: torch.Tensor, group_ids: torch.Tensor, adv: torch.Tensor,
                  pass_threshold: float = 0.5) -> dict[str, torch.Tensor]:
    """Health metrics of a grouped batch (`adv/*`, `groups/*`: docs/rl.md "Metrics")."""
    inv, counts = group_index(group_ids)
    g = counts.numel()
    r = rewards.detach().float()
    passed = (r > pass_threshold).float()
    n_pass = group_sum(passed, inv, g)  # (G,)
    a = adv.detach().float()
    return {
        "adv/mean": a.mean(),
        "adv/std": a.std(unbiased=False),
        "groups/zero_adv_frac": (group_max(r, inv, g) == group_min(r, inv, g)).float().mean(),
        "groups/all_pass_frac": (n_pass == counts).float().mean(),
        "groups/all_fail_frac": (n_pass == 0).float().mean(),
    }


def _flat(rewards, inv, counts) -> torch.Tensor:
    """(N,) bool: the sample's group has all rewards exactly equal (no signal)."""
    g = counts.numel()
    return (group_max(rewards, inv, g) == group_min(rewards, inv, g))[inv]


def _centered(rewards, group_ids):
    """r − group mean  # (N,), exactly 0 in groups whose rewards are all equal; with the group index."""
    inv, counts = group_index(group_ids)
    centered = rewards - group_mean(rewards, inv, counts)[inv]
    return torch.where(_flat(rewards, inv, counts), torch.zeros_like(centered), centered), inv, counts


@registry.register("grpo", level="outcome")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, std_scale: str = "group", eps: float = 1e-6,
         pass_threshold: float = 0.5):
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath §4.1.2):

        A_i = (r_i − mean_g(r)) / (std + eps)

    std_scale: "group" (the paper: unbiased std of the group), "batch" (std of all rewards in the
    batch, as TRL `scale_rewards="batch"`), "none" (= Dr. GRPO's advantage).
    eps = 1e-6 (verl); the paper has none. A group of size 1 gets advantage 0.
    """
    _check(rewards, group_ids)
    centered, inv, counts = _centered(rewards, group_ids)  # (N,)
    if std_scale == "group":
        adv = centered / (group_std(rewards, inv, counts)[inv] + eps)
    elif std_scale == "batch":
        adv = centered / (rewards.std() + eps) if rewards.numel() > 1 else centered
    elif std_scale == "none":
        adv = centered
    else:
        raise ValueError(f"std_scale must be 'group', 'batch' or 'none', got {std_scale!r}")
    return adv, group_metrics(rewards, group_ids, adv, pass_threshold)


@registry.register("dr_grpo", level="outcome")
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, pass_threshold: float = 0.5):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i − mean_g(r),
    no std division. The paper's other half (no 1/|o_i| length normalisation) is the aggregation
    mode `seq_mean_token_sum_norm`."""
    _check(rewards, group_ids)
    adv, _, _ = _centered(rewards, group_ids)
    return adv, group_metrics(rewards, group_ids, adv, pass_threshold)


@registry.register("rloo", level="outcome")
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor, *, pass_threshold: float = 0.5):
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): leave-one-out baseline

        A_i = r_i − (1/(n−1)) Σ_{j≠i} r_j  =  n/(n−1) · (r_i − mean_g(r))

    Needs at least 2 samples per group (raises ValueError otherwise)."""
    _check(rewards, group_ids)
    inv, counts = group_index(group_ids)
    if bool((counts < 2).any()):
        raise ValueError("rloo needs at least 2 samples per group (leave-one-out baseline)")
    total = group_sum(rewards, inv, counts.numel())[inv]  # (N,) Σ_j r_j in i's group
    n = counts[inv].to(rewards.dtype)
    adv = rewards - (total - rewards) / (n - 1)
    adv = torch.where(_flat(rewards, inv, counts), torch.zeros_like(adv), adv)
    return adv, group_metrics(rewards, group_ids, adv, pass_threshold)


def _batch_whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x − mean_batch) / (std_batch + eps), unbiased std  # (N,)."""
    if x.numel() < 2:
        return x - x.mean()
    return (x - x.mean()) / (x.std() + eps)


def _token_whiten(x: torch.Tensor, lengths: torch.Tensor, eps: float) -> torch.Tensor:
    """Whitening over the batch's loss TOKENS, each sequence's value repeated over its `lengths` tokens:

        mean = Σ_i L_i x_i / Σ_i L_i,   var = Σ_i L_i (x_i − mean)² / (Σ_i L_i − 1)   (unbiased, verl's masked_whiten)
        A_i = (x_i − mean) / (sqrt(var) + eps)                                        # (N,)

    A sequence of length 0 (no loss tokens) does not enter the statistics."""
    w = lengths.to(x.dtype)
    if w.shape != x.shape or bool((w < 0).any()):
        raise ValueError(f"lengths must be (N,) non-negative token counts, got shape {tuple(w.shape)}")
    n = w.sum()
    if float(n) == 0:
        return x - x.mean()
    mean = (w * x).sum() / n
    if float(n) < 2:
        return x - mean
    var = (w * (x - mean) ** 2).sum() / (n - 1)
    return (x - mean) / (var.sqrt() + eps)


WHITEN = ("token", "sequence")


def _whiten(x: torch.Tensor, whiten: str, lengths: torch.Tensor | None, eps: float) -> torch.Tensor:
    if whiten == "token":
        if lengths is None:
            raise ValueError("whiten='token' needs lengths (loss tokens per sequence, (N,)); the RL recipe passes "
                             "them, or use whiten='sequence'")
        return _token_whiten(x, lengths, eps)
    if whiten == "sequence":
        return _batch_whiten(x, eps)
    raise ValueError(f"whiten must be 'token' or 'sequence', got {whiten!r}")


def takes_lengths(fn) -> bool:
    """Whether an outcome estimator (or a functools.partial of one) takes `lengths` (loss tokens per sequence)."""
    return "lengths" in inspect.signature(fn).parameters


@registry.register("reinforce_pp", level="outcome")
def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor, *, whiten: str = "token",
                 lengths: torch.Tensor | None = None, eps: float = 1e-6, pass_threshold: float = 0.5):
    """REINFORCE++ (Hu 2025, arXiv 2501.03262) for outcome rewards: global batch normalisation.

    whiten="token" (the default: the paper's eq. 10, verl's and OpenRLHF's implementation): the
    statistics are over every loss token of the batch, a sequence's reward counted once per token
    (`lengths` (N,) = loss tokens per sequence; `_token_whiten`). With rewards [1, 0] and lengths
    [1, 3] the token values are [1, 0, 0, 0]: mean 0.25, unbiased std 0.5, A = [1.5, −0.5].
    whiten="sequence": each sequence counted once, A_i = (r_i − mean_batch(r)) / std_batch(r)
    (unbiased; [1, 0] -> [0.707, −0.707] whatever the lengths).

    The paper's token advantage is A_t = r − β Σ_{s≥t} KL_s (k1 KL folded into the reward) before
    the same normalisation; here the KL is kept in the loss (or β = 0), so A is per sequence.
    group_ids only feed the metrics (the paper samples one response per prompt)."""
    _check(rewards, group_ids)
    adv = _whiten(rewards, whiten, lengths, eps)
    return adv, group_metrics(rewards, group_ids, adv, pass_threshold)


@registry.register("reinforce_pp_baseline", level="outcome")
def reinforce_pp_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, *, whiten: str = "token",
                          lengths: torch.Tensor | None = None, eps: float = 1e-6, pass_threshold: float = 0.5):
    """REINFORCE++-baseline (same paper, v2+, for G > 1 samples per prompt): subtract the group mean,
    then normalise by the *batch* statistics of the centred rewards, over tokens (default, as
    `reinforce_pp`) or over sequences (whiten="sequence"):

        A'_i = r_i − mean_g(r);   A_i = (A'_i − mean_batch(A')) / std_batch(A')"""
    _check(rewards, group_ids)
    centered, inv, counts = _centered(rewards, group_ids)
    adv = _whiten(centered, whiten, lengths, eps)
    adv = torch.where(_flat(rewards, inv, counts), torch.zeros_like(adv), adv)  # the batch mean is not exactly 0
    return adv, group_metrics(rewards, group_ids, adv, pass_threshold)


@registry.register("learnability", level="outcome")
def learnability(rewards: torch.Tensor, group_ids: torch.Tensor, *, weight: str = "variance",
                 lam: float = 1.0, std_scale: str = "group", eps: float = 1e-6,
                 pass_threshold: float = 0.5):
    """GRPO advantage re-weighted per prompt by how learnable the prompt is (docs/algorithms.md).

        p_g = fraction of the group with reward > pass_threshold   (empirical pass rate)
        weight="variance":  w_g = 4 p_g (1 − p_g)         reward variance of a Bernoulli(p), scaled so
                                                          w = 1 at p = ½ (Foster & Foerster 2025,
                                                          "Learning to Reason at the Frontier of Learnability")
        weight="maxent":    w_g = exp(−λ · KL(Bern(p_g) ‖ Bern(½)))   (MGPO, VibeThinker, Xu et al. 2025)
        A_i = w_g · A_i^GRPO

    Both weights peak at p = ½ and vanish (variance) or shrink (maxent) toward all-pass / all-fail.
    λ is a hyperparameter (1.0 here; not a value taken from the paper)."""
    _check(rewards, group_ids)
    base, _ = grpo(rewards, group_ids, std_scale=std_scale, eps=eps, pass_threshold=pass_threshold)
    inv, counts = group_index(group_ids)
    p = group_mean((rewards > pass_threshold).to(rewards.dtype), inv, counts)  # (G,)
    if weight == "variance":
        w = 4.0 * p * (1.0 - p)
    elif weight == "maxent":
        # KL(Bern(p) ‖ Bern(½)) = log 2 + p log p + (1−p) log(1−p)   (0 log 0 = 0)
        kl = torch.log(torch.tensor(2.0, dtype=p.dtype, device=p.device)) + torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p)
        w = torch.exp(-lam * kl)
    else:
        raise ValueError(f"weight must be 'variance' or 'maxent', got {weight!r}")
    adv = base * w[inv]
    metrics = group_metrics(rewards, group_ids, adv, pass_threshold)
    metrics["groups/learnability_weight_mean"] = w.detach().mean()
    return adv, metrics


@registry.register("gae", level="token")
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
        lam: float = 0.95, whiten: bool = False, last_value: torch.Tensor | None = None):
    """Generalised Advantage Estimation (Schulman et al. 2016) for PPO, over the loss-mask tokens.

        δ_t = r_t + γ V_{t'} − V_t            t' = next position with mask 1 (V = 0 after the last)
        A_t = δ_t + γλ A_{t'}                 returns R_t = A_t + V_t

    Positions with mask 0 (prompt, padding, tool output inside a multi-turn response) are skipped:
    the recursion carries V and A across them unchanged (verl's multi-turn GAE), so γ counts
    generated tokens only. Rewards must sit on mask-1 tokens (usually the last generated one);
    a reward on a mask-0 position is ignored. Advantages/returns are 0 where mask is 0.
    `last_value` (B,): V of the state after the last token, the bootstrap of a sample cut at the length
    limit (its episode did not end); 0 (the default) for a finished one.
    Backward loop over T, vectorised over B. `whiten`: masked (A − mean)/std over the batch
    (returns are computed before whitening). Shapes: all (B, T); returns (advantages, returns).
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        raise ValueError("gae expects token_rewards, values and mask of the same (B, T) shape")
    m = mask.to(values.dtype)
    rewards = token_rewards.detach().to(values.dtype)
    values = values.detach()
    B, T = values.shape
    next_value = values.new_zeros(B) if last_value is None else last_value.detach().to(values.dtype)  # V_{t'}  (B,)
    last_adv = values.new_zeros(B)  # A_{t'}  (B,)
    adv = torch.zeros_like(values)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        a_t = delta + gamma * lam * last_adv
        mt = m[:, t]
        last_adv = mt * a_t + (1 - mt) * last_adv  # masked positions pass A through
        next_value = mt * values[:, t] + (1 - mt) * next_value
        adv[:, t] = a_t * mt
    returns = (adv + values) * m
    if whiten:
        mean, var = masked_mean(adv, m), masked_var(adv, m)
        adv = (adv - mean) * torch.rsqrt(var + 1e-8) * m
    return adv, returns
