"""Zero-advantage groups (RLConfig.zero_advantage). A group whose every advantage is 0 adds exactly nothing to the
gradient under a loss linear in A with β = 0 and no entropy bonus: `forward` runs it without autograd (its metrics
only), `skip` leaves it out, `train` backwards it like any group. The three give the same gradient (to fp32
summation order: the live groups run as a shorter packed row), the same loss and norm; `forward` also the same
metrics. A minibatch of inert groups only is still AdamW's step on a zero gradient."""

import pytest
import torch

from conftest import COUNT_PROMPTS, write_jsonl
from posttrain.algos import policy_losses
from posttrain.algos.pg_losses import ppo, vanishes_at_zero_advantage
from posttrain.config import parse_args
from posttrain.recipes import rl
from posttrain.recipes.rl import phases as ph
from posttrain.recipes.rl import step as rl_step
from posttrain.rewards.base import register
from posttrain.rollout.trajectory import Trajectory, make_batches, split_inert

U = torch.finfo(torch.float32).eps


@register("letter_share", description="test reward: share of letters in the completion")
def letter_share(prompts, completions, **kw):
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def setup_run(tmp_path, *overrides):
    data = write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS)
    cfg = parse_args(rl.RLConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}",
                                   "reward=letter_share", "prompts_per_step=4", "group_size=4", "max_new_tokens=8",
                                   "beta=0", "max_steps=4", "progress=false", "optim.lr=1e-2", *overrides])
    return rl.setup(cfg)


def samples(run, inert_groups):
    """One step's samples with advantages set by hand: the groups at the indices `inert_groups` all 0 (as when a
    group's rewards are equal), the others 1, 1, -0.5, ... (so they carry a gradient and a nonzero loss)."""
    trajs, _ = run.rollout.collect(run, 0)
    ph.assign_advantages(trajs, run.adv_fn, run.cfg.mask_truncated)
    order = list(dict.fromkeys(t.group for t in trajs))
    for i, t in enumerate(trajs):
        t.advantage = 0.0 if order.index(t.group) in inert_groups else (1.0 if i % 3 else -0.5)
    return trajs


def state_of(run):
    return ({k: v.clone() for k, v in run.model.state_dict().items()},
            {k: v for k, v in run.optimizer.state_dict().items()}, run.scheduler.state_dict())


def update(run, trajs, mode, start, monkeypatch):
    """update() from the state `start` with zero_advantage=mode -> (gradients it stepped on, its row, weights after)"""
    import copy

    model, opt, sched = start
    run.model.load_state_dict(model)
    run.optimizer.load_state_dict(copy.deepcopy(opt))
    run.scheduler.load_state_dict(sched)
    run.cfg = run.cfg.model_copy(update={"zero_advantage": mode})
    grads = {}
    real = rl_step.optimizer_step

    def capture(model_, optimizer, max_norm):
        grads.update({n: p.grad.clone() for n, p in model_.named_parameters() if p.grad is not None})
        return real(model_, optimizer, max_norm)

    monkeypatch.setattr(rl_step, "optimizer_step", capture)
    row = rl_step.update(run, make_batches(trajs, run.tok.pad_token_id, run.cfg.micro_batch_tokens))
    return grads, row, {n: p.detach().clone() for n, p in run.model.named_parameters()}


def assert_same_gradient(got, want, tokens):
    """fp32 summation order only: each gradient a sum over at most `tokens` positions, so within tokens·u of its
    tensor's largest magnitude (a generous form of the order bound; terms of inert rows are exactly 0)"""
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=tokens * U * float(g.abs().max()) + 1e-30, msg=name)


def test_forward_and_skip_give_the_train_update(tmp_path, monkeypatch):
    run = setup_run(tmp_path)
    assert run.inert_loss
    trajs = samples(run, inert_groups={0, 2})
    start = state_of(run)
    g_train, r_train, _ = update(run, trajs, "train", start, monkeypatch)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    for mode in ("forward", "skip"):
        g, row, _ = update(run, trajs, mode, start, monkeypatch)
        assert_same_gradient(g, g_train, tokens)
        assert row["zero_adv/no_backward_samples"] == 8 and r_train["zero_adv/no_backward_samples"] == 0
        assert row["loss"] == pytest.approx(r_train["loss"], abs=tokens * U)
        assert float(row["grad_norm"]) == pytest.approx(float(r_train["grad_norm"]), rel=tokens * U)
    # forward: the inert groups' statistics are still measured, as in train
    _, row, _ = update(run, trajs, "forward", start, monkeypatch)
    for key in ("entropy", "consistency/dlogp_mean", "consistency/kl_behaviour_trainer", "ratio/mean", "approx_kl"):
        assert row[key] == pytest.approx(r_train[key], rel=1e-4, abs=1e-9), key


def test_a_minibatch_of_inert_groups_only_still_steps_adamw(tmp_path, monkeypatch):
    """After a live step (AdamW moments m, v != 0), a step whose every group is inert: train backwards zeros, forward
    and skip run no backward; AdamW must still move the weights along its moments, identically."""
    run = setup_run(tmp_path, "optim.weight_decay=0.0")
    live = samples(run, inert_groups=set())
    update(run, live, "train", state_of(run), monkeypatch)
    after_live = state_of(run)
    dead = samples(run, inert_groups={0, 1, 2, 3})
    _, _, w_train = update(run, dead, "train", after_live, monkeypatch)
    moved = any(not torch.equal(w_train[n], after_live[0][n]) for n in w_train)
    assert moved  # the moments moved the weights without a gradient
    for mode in ("forward", "skip"):
        _, row, w = update(run, dead, mode, after_live, monkeypatch)
        assert row["zero_adv/no_backward_samples"] == 16 and float(row["grad_norm"]) == 0.0
        for n in w_train:
            assert torch.equal(w[n], w_train[n]), n


def test_the_split_keeps_group_order_and_counts_invalid_samples_as_inert():
    def t(prompt, group, adv, valid=True):
        return Trajectory(prompt, [5, 6, 7], torch.zeros(3), group, advantage=adv, valid=valid)

    trajs = [t([1, 2], 0, 0.0), t([1, 2], 0, 0.0),  # inert: all zero
             t([3], 1, 0.0), t([3], 1, 0.5),  # live: one nonzero advantage
             t([4, 4], 2, 1.0, valid=False), t([4, 4], 2, 0.0),  # inert: the nonzero one carries no loss
             t([9], 3, -1.0), t([9], 3, 1.0)]
    (b,) = make_batches(trajs, 0, 1 << 20)
    live, inert = split_inert(b, 0)
    assert [x.group for x in live.trajectories] == [1, 1, 3, 3]
    assert [x.group for x in inert.trajectories] == [0, 0, 2, 2]
    assert int(live.loss_mask.sum()) + int(b.loss_mask[[0, 1, 4, 5]].sum()) == int(b.loss_mask.sum())
    assert split_inert(make_batches(trajs[2:4], 0, 1 << 20)[0], 0)[1] is None
    assert split_inert(make_batches(trajs[:2], 0, 1 << 20)[0], 0)[0] is None


@pytest.mark.parametrize("name", sorted(policy_losses.names()))
@pytest.mark.parametrize("tis", [False, True])
def test_every_builtin_policy_loss_vanishes_at_zero_advantage(name, tis):
    assert vanishes_at_zero_advantage(policy_losses.get(name), 2.0 if tis else None)


def test_a_loss_with_a_term_of_its_own_is_never_split(tmp_path):
    def with_bonus(logp, old_logp, advantages, mask, **kw):  # PPO minus a log-prob bonus: a gradient at A = 0
        loss, metrics = ppo(logp, old_logp, advantages, mask, **kw)
        return loss - 0.01 * logp * mask, metrics

    assert not vanishes_at_zero_advantage(with_bonus)
    run = setup_run(tmp_path)
    (b,) = make_batches(samples(run, inert_groups={0}), run.tok.pad_token_id, 1 << 20)
    assert ph.inert_split(run, b, 0.0)[1] is not None
    assert ph.inert_split(run, b, 0.01) == (b, None)  # an entropy bonus has a gradient at A = 0
    run.inert_loss = False
    assert ph.inert_split(run, b, 0.0) == (b, None)
    run.inert_loss = True
    run.cfg = run.cfg.model_copy(update={"zero_advantage": "train"})
    assert ph.inert_split(run, b, 0.0) == (b, None)
