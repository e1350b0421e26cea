"""The RL options beyond the presets, with hand-derived values: advantage_args (checked against the estimator),
REINFORCE++'s token whitening, the entropy bonus and Skywork-OR1's adaptive control, ProRL's reference reset;
and each option refused with a message naming it when misused."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import COUNT_PROMPTS, write_jsonl
from posttrain.algos import advantages
from posttrain.algos.entropy import AdaptiveEntropyCoef, FixedEntropyCoef
from posttrain.config import ConfigError, parse_args
from posttrain.ops.logprobs import chunked_logprobs
from posttrain.recipes import rl
from posttrain.recipes.rl import phases as ph
from posttrain.recipes.rl.build import advantage_fn
from posttrain.rewards.base import register
from posttrain.rollout.trajectory import Trajectory


@register("space_frac", description="test reward: share of spaces in the completion")
def space_frac(prompts, completions, **kw):
    return [c.count(" ") / max(len(c), 1) for c in completions]


# ---------------------------------------------------------------- REINFORCE++ whitening


def test_reinforce_pp_token_whitening_by_hand():
    """Rewards [1, 0], lengths 1 and 3: the batch's tokens carry [1, 0, 0, 0], mean 1/4, unbiased variance
    (0.5625 + 3 · 0.0625) / 3 = 0.25, std 0.5 -> A = (1 − 0.25)/0.5 = 1.5 and (0 − 0.25)/0.5 = −0.5
    (Hu 2025 eq. 10, verl's masked_whiten). Sequence whitening: mean 0.5, std 0.7071 -> ±0.7071."""
    r, g = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0, 1])
    fn = advantages.get("reinforce_pp")
    adv, _ = fn(r, g, lengths=torch.tensor([1.0, 3.0]))
    assert adv.tolist() == pytest.approx([1.5, -0.5], abs=1e-5)
    adv, _ = fn(r, g, whiten="sequence")
    assert adv.tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], abs=1e-5)
    # a sample without loss tokens does not enter the statistics
    adv, _ = fn(torch.tensor([1.0, 0.0, 5.0], dtype=torch.float64), torch.tensor([0, 1, 2]),
                lengths=torch.tensor([1.0, 3.0, 0.0]))
    assert adv[:2].tolist() == pytest.approx([1.5, -0.5], abs=1e-5)
    with pytest.raises(ValueError, match="whiten='token' needs lengths"):
        fn(r, g)
    with pytest.raises(ValueError, match="whiten must be 'token' or 'sequence'"):
        fn(r, g, whiten="batch", lengths=torch.ones(2))


def test_the_step_passes_loss_token_counts_and_advantage_args():
    """assign_advantages hands the estimator each sample's loss tokens; advantage_args reach it through the config."""
    trajs = [Trajectory([1], [2], torch.zeros(1), 0, reward=1.0), Trajectory([1], [2, 3, 4], torch.zeros(3), 1, reward=0.0)]
    cfg = parse_args(rl.RLConfig, ["algo=reinforce_pp"])
    ph.assign_advantages(trajs, advantage_fn(cfg, None), mask_truncated=False)
    assert [t.advantage for t in trajs] == pytest.approx([1.5, -0.5], abs=1e-5)
    cfg = parse_args(rl.RLConfig, ["algo=reinforce_pp", "advantage_args={whiten: sequence}"])
    ph.assign_advantages(trajs, advantage_fn(cfg, None), mask_truncated=False)
    assert [t.advantage for t in trajs] == pytest.approx([0.70711, -0.70711], abs=1e-5)
    # GRPO's std_scale and the learnability estimator's options, from the command line
    group = [Trajectory([1], [2], torch.zeros(1), 0, reward=r) for r in (1.0, 0.0, 0.0, 0.0)]
    cfg = parse_args(rl.RLConfig, ["advantage_args={std_scale: none}"])
    ph.assign_advantages(group, advantage_fn(cfg, None), mask_truncated=False)
    assert [t.advantage for t in group] == pytest.approx([0.75, -0.25, -0.25, -0.25])
    cfg = parse_args(rl.RLConfig, ["advantage=learnability", "advantage_args={weight: variance, std_scale: none}"])
    ph.assign_advantages(group, advantage_fn(cfg, None), mask_truncated=False)
    assert [t.advantage for t in group] == pytest.approx([0.75 * 0.75, -0.25 * 0.75, -0.25 * 0.75, -0.25 * 0.75])  # 4p(1-p), p=1/4
    cfg = parse_args(rl.RLConfig, ["advantage_args={pass_threshold: 2.0}"])  # nothing passes
    assert float(ph.assign_advantages(group, advantage_fn(cfg, None), False)["groups/all_fail_frac"]) == 1.0


# ---------------------------------------------------------------- entropy


def test_entropy_bonus_gradient_on_a_three_token_toy():
    """Logits z = [2, 0, 0] over 3 tokens (hidden = z, head = identity). H = −Σ p log p; ∂H/∂z_j = −p_j (log p_j + H).
    The loss −c·H (c = 0.1) has gradient c·p_j (log p_j + H): positive on the dominant token (its log p is above the
    mean log p = −H), negative on the others, so gradient descent flattens the distribution (entropy rises)."""
    z = torch.tensor([[2.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    _, ent = chunked_logprobs(z, torch.eye(3, dtype=torch.float64), torch.tensor([0]), with_entropy=True)
    p = torch.tensor([math.e ** 2, 1.0, 1.0], dtype=torch.float64) / (math.e ** 2 + 2)
    H = float(-(p * p.log()).sum())
    assert float(ent.detach()) == pytest.approx(H, abs=1e-12)  # 0.6800...
    (-0.1 * ent.sum()).backward()
    expected = 0.1 * p * (p.log() + H)
    assert z.grad[0].tolist() == pytest.approx(expected.tolist(), abs=1e-12)
    assert z.grad[0, 0] > 0 and (z.grad[0, 1:] < 0).all()
    stepped = (z - 1.0 * z.grad).detach()
    assert float(-(stepped.softmax(-1) * stepped.log_softmax(-1)).sum()) > H


@pytest.mark.parametrize("n, chunk", [(5, 1024), (40, 7)])  # the kept softmax; recomputed tiles over row chunks
def test_entropy_gradient_equals_autograd_through_the_full_softmax(n, chunk):
    torch.manual_seed(0)
    h = torch.randn(n, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 4, dtype=torch.float64, requires_grad=True)
    y, c = torch.randint(0, 300, (n,)), torch.randn(n, dtype=torch.float64)
    lp, ent = chunked_logprobs(h, w, y, temperature=0.7, chunk=chunk, with_entropy=True, softcap=3.0)
    gh, gw = torch.autograd.grad(lp.sum() + (c * ent).sum(), (h, w))
    logp = torch.log_softmax(3.0 * torch.tanh(h @ w.t() / 3.0) / 0.7, -1)
    ref = logp.gather(1, y[:, None]).sum() + (c * -(logp.exp() * logp).sum(-1)).sum()
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert torch.allclose(gh, rh, atol=1e-12) and torch.allclose(gw, rw, atol=1e-12)


def test_batch_loss_subtracts_the_entropy_bonus_per_token():
    """ℓ_t − c·H_t before aggregation (token_mean): the loss moves by exactly −c·mean H over the loss tokens."""
    cfg = parse_args(rl.RLConfig, ["algo=rloo"])
    from posttrain.algos import policy_losses
    from posttrain.rollout.trajectory import make_batches

    trajs = [Trajectory([1], [2, 3], torch.zeros(2), 0, reward=1.0), Trajectory([1], [4], torch.zeros(1), 0, reward=0.0)]
    ph.assign_advantages(trajs, advantage_fn(cfg, None), False)
    b = make_batches(trajs, 0, 4096)[0]
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.8, 1.0]])) * b.mask
    b.old_logp = logp.detach()
    entropy = torch.tensor([[1.0, 2.0], [0.5, 0.0]]) * b.mask  # (S, L)
    norms = {"agg": "token_mean", "tokens": 3, "seqs": 2}
    base, _ = ph.batch_loss(logp, b, policy_losses.get("ppo"), cfg, 0.0, "k3", None, norms)
    bonus, _ = ph.batch_loss(logp, b, policy_losses.get("ppo"), cfg, 0.0, "k3", None, norms, entropy=entropy,
                             entropy_coef=0.1)
    assert float(bonus - base) == pytest.approx(-0.1 * (1.0 + 2.0 + 0.5) / 3)


def test_adaptive_entropy_control_follows_skywork_or1():
    """c += Δ below the target, −= Δ above (never < 0); the bonus acts only while the entropy is at most the target."""
    ctl = AdaptiveEntropyCoef(0.0, target=0.2, delta=0.005)
    assert ctl.coef() == 0.0
    ctl.update(0.1)  # below: c = 0.005, applied
    assert ctl.value == pytest.approx(0.005) and ctl.coef() == pytest.approx(0.005)
    ctl.update(0.15)
    assert ctl.coef() == pytest.approx(0.010)
    ctl.update(0.3)  # above: c = 0.005, not applied while above
    assert ctl.value == pytest.approx(0.005) and ctl.coef() == 0.0
    ctl.update(0.4)
    ctl.update(0.5)
    assert ctl.value == 0.0  # floored
    again = AdaptiveEntropyCoef(0.0, 0.2, 0.005)
    again.load(ctl.state())
    assert (again.value, again.last) == (ctl.value, ctl.last)
    assert FixedEntropyCoef(0.01).coef() == 0.01 and not FixedEntropyCoef(0.0).active


def tiny_cfg(tmp_path, *overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS)
    return parse_args(rl.RLConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}",
                                    "reward=space_frac", "prompts_per_step=2", "group_size=4", "max_new_tokens=8",
                                    "optim.lr=2e-2", "max_steps=3", "progress=false", "kl_probe_every=0", *overrides])


def test_entropy_bonus_in_a_run_moves_the_loss_by_c_times_entropy(tmp_path):
    """Same samples (same seed, first step): the logged loss with entropy_coef c is the loss without it − c·entropy
    (token_mean aggregation), and the row says what the bonus did."""
    rows = {}
    for c in (0.0, 0.5):
        run = rl.setup(tiny_cfg(tmp_path / str(c), "algo=rloo", f"entropy_coef={c}"))
        rows[c] = rl.rl_step(run, 0)
        run.rollout.close()
    with_bonus, without = rows[0.5], rows[0.0]
    assert with_bonus["entropy"] == pytest.approx(without["entropy"], rel=1e-6)
    assert with_bonus["loss"] == pytest.approx(without["loss"] - 0.5 * without["entropy"], abs=1e-5)
    assert with_bonus["entropy/coef"] == 0.5 and with_bonus["entropy/bonus"] == pytest.approx(0.5 * with_bonus["entropy"])
    assert "entropy/coef" not in without


# ---------------------------------------------------------------- reference reset


def test_ref_reset_replaces_the_reference_and_clears_the_optimizer(tmp_path):
    """ref_reset_every=2: after step 2 π_ref = π_θ (every parameter), the AdamW state is empty, and the next step's
    KL to the reference is exactly 0 (same weights, same log-probs); before the reset it was not."""
    run = rl.setup(tiny_cfg(tmp_path, "beta=0.05", "ref_reset_every=2", "ref_reset_optimizer=true"))
    first = rl.rl_step(run, 0)
    assert first["ref_reset"] == 0 and len(run.optimizer.state) > 0
    assert not all(torch.equal(a, b) for a, b in zip(run.ref.parameters(), run.model.parameters()))
    second = rl.rl_step(run, 1)
    assert second["ref_reset"] == 1 and second["kl"] > 1e-6
    assert all(torch.equal(a, b) for a, b in zip(run.ref.parameters(), run.model.parameters()))
    assert len(run.optimizer.state) == 0
    third = rl.rl_step(run, 2)
    assert third["kl"] == 0.0 and third["ref_reset"] == 0
    assert "reference" in run.checkpoint_extras()  # the moved reference is checkpointed
    run.rollout.close()


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("argv, match", [
    (["advantage_args={std_scal: none}"], r"advantage_args \['std_scal'\] are not arguments of advantage estimator 'grpo'"),
    (["advantage_args={std_scale: nne}"], "advantage_args .*std_scale must be 'group', 'batch' or 'none'"),
    (["advantage_args={eps: abc}"], "advantage_args .*eps"),
    (["algo=reinforce_pp", "advantage_args={whiten: tokens}"], "whiten must be 'token' or 'sequence'"),
    (["advantage=learnability", "advantage_args={weight: uniform}"], "weight must be 'variance' or 'maxent'"),
    (["algo=ppo", "advantage_args={whiten: sequence}"], "algo=ppo's advantages are GAE .* gamma=, lam="),
    (["algo=online_dpo", "advantage_args={std_scale: none}"], "advantage_args: not used by algo=online_dpo"),
    (["advantage_args=3"], "advantage_args"),
    (["entropy_coef=-0.1"], "entropy_coef: Input should be greater than or equal to 0"),
    (["entropy_coef=high"], "entropy_coef"),
    (["entropy_control=clip_cov"], "entropy_control: String should match"),
    (["entropy_target=0.3"], "entropy_target: used only by entropy_control=adaptive"),
    (["entropy_control=adaptive", "entropy_target=0"], "entropy_target: Input should be greater than 0"),
    (["algo=online_dpo", "entropy_coef=0.01"], "entropy_coef / entropy_control with algo=online_dpo"),
    (["entropy_control=adaptive", "top_p=0.9"], "with top_k / top_p sampling"),
    (["ref_reset_every=-1"], "ref_reset_every: Input should be greater than or equal to 0"),
    (["ref_reset_every=5", "beta=0"], "ref_reset_every with beta=0"),
    (["algo=dapo", "ref_reset_every=5"], "ref_reset_every with beta=0 .*set beta > 0"),
    (["algo=online_dpo", "ref_reset_every=5", "beta=0.1"], "ref_reset_every with algo=online_dpo: .*ref_update_every"),
    (["ref_reset_every=5", "lora.enabled=true"], "ref_reset_every with lora"),
    (["ref_reset_optimizer=true"], "ref_reset_optimizer=true without ref_reset_every"),
    (["overlong_shaping=maybe"], "overlong_shaping"),
    (["env=calculator", "overlong_shaping=true"], "overlong_shaping=true with env="),
])
def test_misused_options_are_refused_by_name(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(rl.RLConfig, argv)
