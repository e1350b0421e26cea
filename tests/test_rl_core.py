"""RL core: typed trajectories, the shared-prefix training layout, the phases' formula fixes, resume,
bad rewards. Recipe runs use the tiny random model (see test_rl_recipe.py for the smoke runs)."""

import json
import math

import pytest
import torch

from conftest import run_rl
from posttrain.config import ConfigError, parse_args
from posttrain.recipes import rl
from posttrain.recipes.rl import online_dpo, ppo
from posttrain.recipes.rl import phases as ph
from posttrain.rewards.base import RewardError, register
from posttrain.rollout.trajectory import Trajectory, make_batches


def run(tmp_path, *overrides, name="run"):
    return run_rl(tmp_path, "prompts_per_step=2", "max_new_tokens=8", "max_steps=2", *overrides, name=name)


def rows_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- rewards used below

@register("space_share", description="test reward: share of spaces in the completion")
def space_share(prompts, completions, **kw):
    return [c.count(" ") / max(len(c), 1) for c in completions]


@register("half_none", description="test reward: 1.0 on even samples, None (does not apply) on odd ones")
def half_none(prompts, completions, **kw):
    return [1.0 if i % 2 == 0 else None for i in range(len(completions))]


@register("never_applies", description="test reward: always None")
def never_applies(prompts, completions, **kw):
    return [None] * len(completions)


@register("nan_on_third", description="test reward: NaN on sample 2")
def nan_on_third(prompts, completions, **kw):
    return [math.nan if i == 2 else 0.5 for i in range(len(completions))]


# ---------------------------------------------------------------- layout

def traj(prompt, response, group, reward=None):
    return Trajectory(prompt, response, torch.zeros(len(response)), group, reward=reward)


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2"])
def test_shared_prefix_layout_equals_separate_forwards(name):
    """A group's prompt computed once (completions attend to it, not to each other) gives every
    completion token the log-prob of a plain forward of prompt + completion, and the same gradient.
    fp32: only summation order differs (bucketed attention vs one sequence), ~1e-6."""
    from posttrain.models.loading import load_model

    model = load_model(name, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (7, 11)]
    trajs = [traj(prompts[i // 3], torch.randint(5, 1000, (2 + 3 * i,), generator=g).tolist(), i // 3) for i in range(6)]
    batches = make_batches(trajs, pad_id=0, token_budget=40)  # forces two micro-batches (one group each)
    assert len(batches) == 2
    got = [ph.policy_logps(model, b, 0.7, "none", truncated=False)[0] for b in batches]
    sum(x.sum() for x in got).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = 0
    for b, lp in zip(batches, got):
        for i, t in enumerate(b.trajectories):
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logits = model(ids).logits[0, len(t.prompt_ids) - 1:-1] / 0.7
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(t.response_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(lp[i, : len(t.response_ids)].detach(), ref.detach(), atol=1e-5, rtol=0)
            assert torch.all(lp[i, len(t.response_ids):] == 0)
            total = total + ref.sum()
    total.backward()
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-4, rtol=1e-4)


def test_trajectory_loss_spans_and_prompt_counted_once():
    t = Trajectory([1, 2, 3], [4, 5, 6, 7, 8], torch.zeros(3), 0, loss_spans=[(0, 2), (4, 5)])  # 6, 7: a tool's output
    assert t.loss_positions() == [0, 1, 4]
    b = make_batches([t, traj([1, 2, 3], [9, 9], 0)], pad_id=0, token_budget=100, pad_to_multiple_of=8)[0]
    assert b.input_ids.shape == (1, 16)  # 3 + 5 + 2 = 10 tokens, padded to 16: the prompt once
    assert b.targets.tolist() == [4, 5, 8, 9, 9]
    assert b.hidden_index.tolist() == [2, 3, 6, 2, 8]  # the prompt's last position predicts both first tokens
    assert b.mask.tolist() == [[True, True, True], [True, True, False]]
    with pytest.raises(ValueError, match="behaviour"):
        Trajectory([1], [2, 3], torch.zeros(1), 0)


# ---------------------------------------------------------------- the formula bugs

def test_none_reward_is_left_out_of_baseline_filter_and_loss():
    from posttrain.algos import advantages

    trajs = [traj([1], [2], 0, r) for r in (1.0, 0.0, None, None)] + [traj([1], [2], 1, r) for r in (1.0, None, None, 1.0)]
    metrics = ph.assign_advantages(trajs, advantages.get("grpo"), mask_truncated=False)
    a = [t.advantage for t in trajs]
    # group 0 is [1, 0]: mean 0.5, unbiased std 0.7071 -> ±0.7071 (None counted as 0 gave mean 0.25)
    assert a[0] == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-6)) and a[1] == pytest.approx(-a[0])
    assert a[2:] == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0] and [t.valid for t in trajs] == [True, True, False, False, True, False, False, True]
    assert float(metrics["groups/zero_adv_frac"]) == 0.5
    kept, dropped = ph.informative_groups(trajs)  # group 1's applicable rewards are all equal: no signal
    assert {t.group for t in kept} == {0} and dropped == 1


def test_logged_reward_mean_counts_only_applicable_rewards(tmp_path):
    summary, out = run(tmp_path, "reward=half_none", "max_steps=1")
    row = rows_of(out)[0]
    assert row["reward/mean"] == 1.0 and row["reward/none_frac"] == 0.5  # None counted as 0 logged 0.5
    assert summary["last_reward"] == 1.0


def test_metric_names_from_two_phases_never_overwrite():
    with pytest.raises(ValueError, match="reward/mean"):
        rl.merge_metrics({"reward/mean": 1.0}, {"reward/mean": 0.5})


def test_overlong_shaping_counts_tokens_against_the_generation_limit(tmp_path):
    # max_new_tokens=8 -> Lmax 8, Lcache round(8/5) = 2; every sample runs to 8 tokens: R = (6 - 8)/2 = -1
    summary, out = run(tmp_path, "reward=overlong", "ignore_eos=true", "max_steps=1")
    assert rows_of(out)[0]["reward/mean"] == -1.0


def test_reference_uses_the_temperature_only_distribution_under_top_k(tmp_path):
    """A token the policy sampled can lie outside the reference's top-k: log π_ref must stay finite."""
    summary, out = run(tmp_path, "top_k=3", "beta=0.1", "kl_estimator=k2", "max_steps=3")
    for r in rows_of(out):
        assert math.isfinite(r["kl"]) and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r
        assert r["consistency/dlogp_max"] < 1e-4  # the policy side is the truncated distribution, exactly


def test_k1_in_the_loss_is_refused_and_loss_args_are_checked():
    with pytest.raises(ConfigError, match="zero expected gradient"):
        parse_args(rl.RLConfig, ["kl_estimator=k1", "beta=0.1"])
    parse_args(rl.RLConfig, ["kl_estimator=k1", "beta=0"])  # no KL term: nothing to refuse
    with pytest.raises(ConfigError, match="eps_hgh.*clip_higher|eps_high"):
        parse_args(rl.RLConfig, ["algo=dapo", "loss_args={eps_hgh: 0.3}"])
    assert parse_args(rl.RLConfig, ["algo=dapo", "loss_args={eps_high: 0.3}"]).loss_args == {"eps_high": 0.3}


# ---------------------------------------------------------------- bad rewards, skipped steps

def test_a_nan_reward_stops_the_run_naming_reward_and_sample(tmp_path):
    with pytest.raises(RewardError, match=r"nan_on_third.*sample 2.*completion"):
        run(tmp_path, "reward=nan_on_third")


def test_a_step_where_no_reward_applies_is_logged_and_skipped(tmp_path):
    summary, out = run(tmp_path, "reward=never_applies")
    rows = rows_of(out)
    assert [r["skipped"] for r in rows] == [1, 1] and summary["skipped_steps"] == 2
    assert rows[0]["reward/mean"] is None and "loss" not in rows[0]


# ---------------------------------------------------------------- resume, device

@pytest.mark.parametrize("algo_args", [("beta=0.05", "kl_target=0.01"), ("algo=ppo", "critic_lr=1e-3")])
def test_resume_after_a_kill_equals_the_uninterrupted_run(tmp_path, monkeypatch, algo_args):
    from safetensors.torch import load_file

    args = ("max_steps=4", "save_every=2", *algo_args)
    _, full = run(tmp_path, *args, name="full")
    real_step = rl.rl_step

    def killed(run_, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(run_, step)

    monkeypatch.setattr(rl.step, "rl_step", killed)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, *args, name="cut")
    monkeypatch.setattr(rl.step, "rl_step", real_step)
    run(tmp_path, *args, "resume=true", name="cut")
    a, b = rows_of(full), rows_of(tmp_path / "cut")
    timing = lambda k: k.startswith("time/") or k.endswith("/seconds") or k.endswith("tokens_per_s")  # engine/*tokens_per_s too
    drop = lambda r: {k: v for k, v in r.items() if not timing(k)}
    assert [drop(r) for r in a] == [drop(r) for r in b]
    wa = load_file(full / "final" / "model.safetensors")
    wb = load_file(tmp_path / "cut" / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    if "algo=ppo" in algo_args:  # the value model resumes too
        va = load_file(full / "final" / "value" / "model.safetensors")
        vb = load_file(tmp_path / "cut" / "final" / "value" / "model.safetensors")
        assert all(torch.equal(va[k], vb[k]) for k in va)


def test_each_phase_runs_on_the_configured_device(tmp_path, monkeypatch):
    seen = []
    real = ph.policy_logps

    def spy(model, batch, *a, **k):
        logp, ent = real(model, batch, *a, **k)
        seen.append({batch.input_ids.device, batch.advantages.device, batch.behaviour_logp.device, logp.device,
                     next(model.parameters()).device})
        return logp, ent

    monkeypatch.setattr(ph, "policy_logps", spy)
    run(tmp_path, "device=cpu", "beta=0.05", "max_steps=1")
    assert seen and all(s == {torch.device("cpu")} for s in seen)


# ---------------------------------------------------------------- PPO

def test_gae_bootstraps_a_length_cut_sample_from_the_value_after_it():
    from posttrain.algos import gae

    r, v, m = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3)
    # γ = 1, λ = 0.5, V after the cut = 0.8: δ2 = 1 + 0.8 − 0.7 = 1.1; A1 = 0.1 + 0.5·1.1; A0 = 0.1 + 0.5·0.65
    adv, ret = gae(r, v, m, gamma=1.0, lam=0.5, last_value=torch.tensor([0.8]))
    torch.testing.assert_close(adv, torch.tensor([[0.425, 0.65, 1.1]]))
    torch.testing.assert_close(ret, torch.tensor([[0.925, 1.25, 1.8]]))
    adv, _ = gae(r, v, m, gamma=1.0, lam=0.5)  # a finished sample: nothing after it
    torch.testing.assert_close(adv, torch.tensor([[0.225, 0.25, 0.3]]))


def test_ppo_token_rewards_fold_k1_in_and_put_the_outcome_on_the_last_token():
    a = traj([1, 2], [3, 4], 0, reward=1.0)
    b = traj([1, 2], [5, 6, 7], 0, reward=0.0)
    b.finish_reason = "length"
    batch = make_batches([a, b], pad_id=0, token_budget=100)[0]
    batch.old_logp = torch.tensor([[0.2, -0.1, 0.0], [0.0, 0.5, 0.1]])  # ref = 0, so k1 = old_logp
    batch.ref_logp = torch.zeros(2, 3)
    batch.old_values = torch.tensor([[0.3, 0.4, 0.0], [0.1, 0.2, 0.3]])
    batch.bootstrap = torch.tensor([9.0, 0.5])  # a finished sample never uses its bootstrap
    # β = 0.1, γ = λ = 1: A_t = Σ_{l≥t} r_l + V_after − V_t
    ppo.ppo_advantages([batch], beta=0.1, gamma=1.0, lam=1.0, whiten=False, bootstrap_truncated=True)
    torch.testing.assert_close(batch.advantages, torch.tensor([[0.69, 0.61, 0.0], [0.34, 0.24, 0.19]]))
    ppo.ppo_advantages([batch], beta=0.1, gamma=1.0, lam=1.0, whiten=False)  # default: the cut is terminal
    torch.testing.assert_close(batch.advantages[1], torch.tensor([-0.16, -0.26, -0.31]))


@register("even_count_plus_first_token_even", description="test reward: (count in the prompt is even) + (first token id is even)")
def even_count_plus_first_token_even(prompts, completions, completion_ids=None, **kw):
    import re

    return [float(int(re.search(r"\d", str(p)).group()) % 2 == 0) + float(ids[0] % 2 == 0)
            for p, ids in zip(prompts, completion_ids)]


def test_ppo_learns_and_its_critic_explains_the_returns(tmp_path, tiny_tok):
    """PPO (GAE, critic copied from the policy). The reward's first half depends on the prompt only
    (what a value model can learn), the second on the first sampled token (what the policy can learn).
    The expected reward of the policy's part rises (see test_grpo_raises_the_expected_reward for the
    margin), and the critic's explained variance over the last steps is positive (0 = no better than
    predicting the mean return; measured 0.02-0.27 over seeds 0-3)."""
    from transformers import AutoModelForCausalLM

    from posttrain.models.loading import load_model
    from test_rl_recipe import expected_first_token_even

    before = expected_first_token_even(load_model("tiny-random", seed=0), tiny_tok)
    summary, out = run(tmp_path, "algo=ppo", "reward=even_count_plus_first_token_even", "max_new_tokens=2",
                       "prompts_per_step=4", "max_steps=24", "critic_lr=1e-2", "beta=0.02")
    after = expected_first_token_even(AutoModelForCausalLM.from_pretrained(out / "final"), tiny_tok)
    rows = rows_of(out)
    assert after > before + 0.05, (before, after)
    assert sum(r["vf/explained_var"] for r in rows[-6:]) / 6 > 0, [r["vf/explained_var"] for r in rows]
    assert (out / "final" / "value" / "config.json").is_file()
    roles = [m["role"] for m in json.loads((out / "plan.json").read_text())["predicted"]["models"]]
    assert roles == ["policy", "value", "reference"]  # a verifier reward: no reward model in memory


# ---------------------------------------------------------------- online DPO

def test_preference_pairs_take_best_and_worst_and_skip_ties():
    g0 = [traj([1], [2], 0, r) for r in (0.5, 1.0, 0.0, 1.0)]
    g1 = [traj([1], [2], 1, r) for r in (1.0, 1.0)]
    g2 = [traj([1], [2], 2, r) for r in (None, 0.0, 1.0)]
    pairs, skipped = online_dpo.preference_pairs(g0 + g1 + g2)
    assert [(c.reward, r.reward) for c, r in pairs] == [(1.0, 0.0), (1.0, 0.0)]
    assert pairs[0][0] is g0[1] and pairs[0][1] is g0[2] and pairs[1][0] is g2[2] and skipped == 1


@pytest.mark.parametrize("pref", [["pref_loss=dpo", "pref_args={beta: 0.5}"], ["pref_loss=simpo"]])
def test_online_dpo_raises_the_expected_reward(tmp_path, tiny_tok, pref):
    """Pairs from the current policy (best vs worst of each group) under a DPO-family loss; the expected
    reward is measured exactly (no sampling noise in the measurement, only in the training path)."""
    from transformers import AutoModelForCausalLM

    from posttrain.models.loading import load_model
    from test_rl_recipe import expected_first_token_even

    before = expected_first_token_even(load_model("tiny-random", seed=0), tiny_tok)
    summary, out = run(tmp_path, "algo=online_dpo", *pref, "reward=first_token_even", "max_new_tokens=1",
                       "prompts_per_step=4", "max_steps=16", "optim.lr=3e-2")
    after = expected_first_token_even(AutoModelForCausalLM.from_pretrained(out / "final"), tiny_tok)
    rows = rows_of(out)
    assert after > before + 0.1, (before, after)  # seeds 0-2: +0.25 to +0.39 (dpo), +0.25 to +0.32 (simpo)
    assert all(r["pairs"] + r["pairs/groups_skipped"] == 4 for r in rows if not r["skipped"])
    assert "pref/rewards/accuracies" in rows[0]


def test_online_dpo_refuses_arguments_its_loss_does_not_take():
    with pytest.raises(ConfigError, match="eps"):
        parse_args(rl.RLConfig, ["algo=online_dpo", "pref_args={eps: 0.1}"])


# ---------------------------------------------------------------- alarms

@register("pays_for_banana", description="test reward hack: pays for a string the task never needs")
def pays_for_banana(prompts, completions, completion_ids=None, **kw):
    return [5.0 if ids[0] % 7 == 0 else 0.0 for ids in completion_ids]  # a rare "string" the policy can find


def test_an_injected_reward_hack_raises_the_alarm_and_on_alarm_stop_ends_the_run(tmp_path, capsys):
    """The hack pays 5 for a first token id divisible by 7 (p ≈ 1/7 at init; nothing else pays): once GRPO
    amplifies it, reward/mean leaves its running band and reward_jump fires; on_alarm=checkpoint_and_stop
    saves and ends the run with the samples that raised it. Seeds 0-5: fires at steps 4-9 with a 3-std band
    (the entropy alarms, which the collapsing policy would raise too, are off to isolate this one)."""
    from posttrain.monitor.alarms import AlarmStop

    with pytest.raises(AlarmStop, match="reward_jump") as stop:
        run(tmp_path, "reward=pays_for_banana", "max_new_tokens=1", "prompts_per_step=4", "max_steps=30",
            "beta=0", "alarms.on_alarm=checkpoint_and_stop", "alarms.warmup_steps=3", "alarms.window=6",
            "alarms.reward_jump_std=3", "alarms.entropy_drop=null", "alarms.entropy_floor=null")
    alarm = next(a for a in stop.value.alarms if a.name == "reward_jump")
    assert alarm.samples and alarm.samples[0]["reward"] == 5.0 and alarm.step < 30
    rows = rows_of(tmp_path / "run")
    assert rows[-1]["alarm/reward_jump"] == 1.0 and rows[-1]["step"] == alarm.step
    assert (tmp_path / "run" / "checkpoints" / f"step-{alarm.step}" / "state.json").is_file()
    assert "[alarm]" in capsys.readouterr().err


def test_held_out_evaluation_is_logged_beside_the_training_reward(tmp_path):
    from conftest import COUNT_PROMPTS, write_jsonl

    held_out = write_jsonl(tmp_path / "held_out.jsonl", COUNT_PROMPTS[:3])
    summary, out = run(tmp_path, f"eval.data={held_out}", "eval.every=1", "eval.n=2", "eval.reward=space_share",
                       "eval.threshold=0.1")
    rows = rows_of(out)
    for r in rows:
        assert 0 <= r["eval/pass@1_low"] <= r["eval/pass@1"] <= r["eval/pass@1_high"] <= 1, r
        assert "time/eval" in r
