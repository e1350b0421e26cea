"""RL health alarms on synthetic metric streams and on two recorded runs (tests/data/)."""

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, parse_args
from posttrain.errors import UserError
from posttrain.monitor.alarms import NAMES, AlarmMonitor, AlarmSettings, AlarmStop

DATA = Path(__file__).parent / "data"


def healthy(step: int) -> dict:
    """A quiet step: reward noisy around 0.5, steady length, entropy, grad norm; small KL and clipping."""
    wiggle = (-1) ** step * 0.05 + 0.01 * (step % 3)
    return {"reward/mean": 0.5 + wiggle, "reward/std": 0.4, "response_length/mean": 100 + 10 * wiggle,
            "entropy": 1.5 + wiggle, "kl": 0.002, "clip_frac/low": 0.01, "clip_frac/high": 0.02,
            "grad_norm": 1.0 + wiggle, "consistency/dlogp_mean": 0.01, "loss": 0.1, "lr": 1e-6}


SAMPLES = [{"prompt": "p", "completion": "short", "reward": 0.0},
           {"prompt": "p", "completion": "a much longer completion", "reward": 1.0},
           {"prompt": "p", "completion": "mid length", "reward": 0.5}]


def run_stream(rows, settings=None, samples=SAMPLES):
    """Feed rows as steps 1..n; returns {step: [names fired]} and the printed lines."""
    printed = []
    mon = AlarmMonitor(settings or AlarmSettings(), echo=printed.append)
    fired = {}
    for i, row in enumerate(rows, start=1):
        names = [a.name for a in mon.check(i, row, samples)]
        if names:
            fired[i] = names
    return fired, printed, mon


def with_change(step_from: int, n: int, **change) -> list[dict]:
    return [{**healthy(i), **(change if i >= step_from else {})} for i in range(1, n + 1)]


def test_a_healthy_stream_raises_nothing():
    fired, printed, _ = run_stream([healthy(i) for i in range(1, 61)])
    assert fired == {} and printed == []


JUMP = AlarmSettings(reward_jump_std=4.0)  # reward_jump is opt-in (docs/alarms.md: honest learning jumps too)


def test_reward_jump_fires_after_warmup_and_shows_the_top_samples():
    s = JUMP
    band_top = 0.5 + 0.05 + 0.02  # the healthy reward never exceeds this
    jump = band_top + s.reward_jump_std * 0.07 + 0.1  # above mean + k·std of the healthy band (std < 0.07)
    rows = [healthy(i) for i in range(1, 31)]
    rows[2] = {**rows[2], "reward/mean": 5.0}  # step 3: inside warm-up, nothing to compare against yet
    rows[24] = {**rows[24], "reward/mean": jump}  # step 25: step 3 has left the 20-step window
    fired, printed, mon = run_stream(rows, s)
    assert fired == {25: ["reward_jump"]}
    assert "sample 1 (reward 1" in printed[0] and "a much longer completion" in printed[0]
    assert mon.summary()["reward_jump"]["first_step"] == 25


def test_reward_jump_std_floor_keeps_a_flat_band_quiet():
    s = JUMP
    flat = [{**healthy(i), "reward/mean": 0.0} for i in range(1, 11)]
    small = s.reward_jump_std * s.reward_jump_min_std * 0.9  # below the floored threshold
    fired, _, _ = run_stream(flat + [{**healthy(11), "reward/mean": small}], s)
    assert fired == {}
    fired, _, _ = run_stream(flat + [{**healthy(11), "reward/mean": small / 0.9 * 1.1}], s)
    assert fired == {11: ["reward_jump"]}


def test_length_blowup_and_collapse_relative_to_the_running_median():
    s = AlarmSettings(length_reward_corr=None)  # SAMPLES' reward grows with length: length_reward would fire too
    fired, printed, _ = run_stream(with_change(25, 26, **{"response_length/mean": 100 * s.length_blowup * 1.2}), s)
    assert fired == {25: ["length_blowup"], 26: ["length_blowup"]}
    assert len(printed) == 1  # printed when it starts firing, logged while it lasts
    assert "a much longer completion" in printed[0].splitlines()[1]  # the longest sample first
    fired, printed, _ = run_stream(with_change(25, 25, **{"response_length/mean": 100 * s.length_collapse * 0.8}))
    assert fired == {25: ["length_collapse"]}
    assert "'short'" in printed[0].splitlines()[1]  # the shortest sample first
    # a gentle trend never fires
    fired, _, _ = run_stream([{**healthy(i), "response_length/mean": 100 * 1.02 ** i} for i in range(1, 61)], s)
    assert fired == {}


def test_entropy_collapse_floor_from_step_one_and_drop_after_warmup():
    s = AlarmSettings()
    fired, _, _ = run_stream([{**healthy(1), "entropy": s.entropy_floor / 2}])
    assert fired == {1: ["entropy_collapse"]}
    low = 1.5 * s.entropy_drop * 0.8  # below the drop threshold but above the floor
    assert low > s.entropy_floor
    fired, _, _ = run_stream(with_change(12, 12, entropy=low))
    assert fired == {12: ["entropy_collapse"]}
    fired, _, _ = run_stream(with_change(12, 12, entropy=1.5 * s.entropy_drop * 1.2))
    assert fired == {}


def test_kl_budget_per_sequence():
    s = AlarmSettings()
    per_token = s.kl_budget / 100 * 1.1  # × response_length/mean 100 -> 1.1 budgets per sequence
    fired, printed, _ = run_stream([{**healthy(2), "kl": per_token, "response_length/mean": 100.0}])
    assert fired == {1: ["kl_budget"]} and "nats per sequence" in printed[0]
    fired, _, _ = run_stream([{**healthy(2), "kl": per_token * 0.8, "response_length/mean": 100.0}])
    assert fired == {}
    fired, _, _ = run_stream([{**healthy(2), "kl": 0.0, "kl/seq": s.kl_budget * 1.01}])  # logged directly wins
    assert fired == {1: ["kl_budget"]}


def test_clip_fraction_counts_both_sides():
    s = AlarmSettings()
    fired, _, _ = run_stream([{**healthy(1), "clip_frac/low": s.clip_frac_max * 0.6, "clip_frac/high": s.clip_frac_max * 0.6}])
    assert fired == {1: ["clip_frac"]}
    fired, _, _ = run_stream([{**healthy(1), "clip_frac/low": s.clip_frac_max * 0.45, "clip_frac/high": s.clip_frac_max * 0.45}])
    assert fired == {}


def test_grad_norm_spike_against_the_running_median():
    s = AlarmSettings()
    fired, _, _ = run_stream(with_change(15, 15, grad_norm=1.1 * s.grad_norm_spike * 1.1))
    assert fired == {15: ["grad_norm_spike"]}
    fired, _, _ = run_stream(with_change(15, 15, grad_norm=0.9 * s.grad_norm_spike * 0.9))
    assert fired == {}
    fired, _, _ = run_stream(with_change(3, 3, grad_norm=1e6))  # warm-up: no band yet
    assert fired == {}


@pytest.mark.parametrize("bad", [math.nan, math.inf, None, 1e308, -1e308, torch.tensor(float("nan"))])
def test_nonfinite_anywhere_fires_from_the_first_step(bad):
    fired, printed, _ = run_stream([{**healthy(1), "loss": bad}])
    assert fired == {1: ["nonfinite"]} and "loss" in printed[0]


def test_a_step_without_applicable_rewards_is_not_nonfinite():
    # rl.py logs reward/mean = NaN when no reward applies (a skipped step): not an alarm by default
    fired, _, _ = run_stream([{"reward/mean": math.nan, "reward/std": None, "skipped": 1,
                               "rewards/math/mean": math.nan}])
    assert fired == {}


def test_train_inference_gap():
    s = AlarmSettings()
    fired, _, _ = run_stream([{**healthy(1), "consistency/dlogp_mean": s.dlogp_mean_max * 1.5}])
    assert fired == {1: ["consistency"]}


def test_null_threshold_turns_an_alarm_off_and_settings_parse():
    s = parse_args(AlarmSettings, ["kl_budget=null", "on_alarm=stop", "window=10"])
    assert s.kl_budget is None and s.on_alarm == "stop" and s.window == 10
    fired, _, _ = run_stream([{**healthy(1), "kl/seq": 1e3}], s)
    assert fired == {}
    with pytest.raises(ConfigError, match="on_alarm"):
        parse_args(AlarmSettings, ["on_alarm=pause"])
    with pytest.raises(ConfigError, match="kl_budget"):
        parse_args(AlarmSettings, ["kl_budjet=2"])


def test_printed_again_only_after_it_stopped_firing():
    rows = [healthy(i) for i in range(1, 8)]
    for i in (2, 3, 6):
        rows[i - 1] = {**rows[i - 1], "clip_frac/high": 0.9}
    fired, printed, mon = run_stream(rows)
    assert sorted(fired) == [2, 3, 6]
    assert [line.split(":")[0] for line in printed] == ["[alarm] step 2", "[alarm] step 6"]
    assert mon.summary()["clip_frac"] == {"first_step": 2, "steps": 3, "last_step": 6, "value": pytest.approx(0.91),
                                          "threshold": 0.3}


def test_metrics_and_act():
    mon = AlarmMonitor(AlarmSettings(), echo=lambda _: None)
    quiet = mon.check(1, healthy(1), SAMPLES)
    assert mon.metrics(quiet) == {"alarm/count": 0.0}
    mon.act(quiet)
    loud = mon.check(2, {**healthy(2), "loss": math.nan, "clip_frac/low": 0.9}, SAMPLES)
    assert mon.metrics(loud) == {"alarm/count": 2.0, "alarm/nonfinite": 1.0, "alarm/clip_frac": 1.0}
    assert {f"alarm/{n}" for n in NAMES} >= set(mon.metrics(loud)) - {"alarm/count"}
    mon.act(loud)  # warn: logged and printed, the run goes on
    for how, checkpoint in [("stop", False), ("checkpoint_and_stop", True)]:
        stopper = AlarmMonitor(AlarmSettings(on_alarm=how), echo=lambda _: None)
        stopper.act([])
        with pytest.raises(AlarmStop) as err:
            stopper.act(stopper.check(7, {**healthy(7), "grad_norm": math.inf}, SAMPLES))
        assert isinstance(err.value, UserError) and err.value.checkpoint is checkpoint
        assert "step 7" in str(err.value) and "nonfinite" in str(err.value) and "grad_norm" in str(err.value)


def test_state_round_trips_through_json_and_resumes_identically():
    rows = with_change(18, 30, **{"reward/mean": 0.9})
    rows[4] = {**rows[4], "loss": math.nan}
    straight, _, _ = run_stream(rows, JUMP)
    mon = AlarmMonitor(JUMP, echo=lambda _: None)
    for i in range(1, 11):
        mon.check(i, rows[i - 1], SAMPLES)
    resumed = AlarmMonitor(JUMP, echo=lambda _: None)
    resumed.load(json.loads(json.dumps(mon.state(), allow_nan=False)))
    after = {i: [a.name for a in resumed.check(i, rows[i - 1], SAMPLES)] for i in range(11, 31)}
    assert {i: n for i, n in after.items() if n} == {i: n for i, n in straight.items() if i > 10}
    assert straight[18] == ["reward_jump"] and straight[5] == ["nonfinite"]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_recorded_healthy_grpo_run_raises_nothing():
    """40 steps of tests/test_slow_rl.py (SmolLM2-135M-Instruct learning single-digit addition with GRPO,
    bf16 update, pass@1 0.16 -> 0.88): reward 0.25 -> 0.97, length 16 -> 9, entropy 2.08 -> 0.25,
    grad_norm 0 .. 9.5. Real learning, not a failure: the defaults stay quiet."""
    rows = read_jsonl(DATA / "grpo_smollm2_add_metrics.jsonl")
    assert len(rows) == 40
    fired, printed, _ = run_stream(rows)
    assert fired == {}, printed


def test_recorded_reward_hack_raises_the_reward_alarm_and_stop_shows_the_samples():
    """GRPO on the tiny model with a reward that pays for a string the task never needs (recorded by
    scripts/record_reward_hack.py), with reward_jump switched on: a reward that is nothing but the hack, with no
    verifier part and no held-out evaluation, leaves the default checks nothing to compare (docs/alarms.md). The policy finds it at the first step from which every step has
    samples with the string; the reward alarm must fire within two steps of that, and nothing before."""
    stream = read_jsonl(DATA / "tiny_reward_hack_stream.jsonl")
    has_hack = [any(" generates" in s["completion"] for s in rec["samples"]) for rec in stream]
    found = next(rec["step"] for i, rec in enumerate(stream) if all(has_hack[i:]))
    printed = []
    mon = AlarmMonitor(JUMP, echo=printed.append)
    fired = {rec["step"]: [a.name for a in mon.check(rec["step"], rec["row"], rec["samples"])] for rec in stream}
    first = min(step for step, names in fired.items() if names)
    assert fired[first] == ["reward_jump"] and found <= first <= found + 2, (found, fired)
    assert " generates" in printed[0]  # the top-reward samples are shown: they carry the hack
    stopper = AlarmMonitor(JUMP.model_copy(update={"on_alarm": "stop"}), echo=lambda _: None)
    with pytest.raises(AlarmStop) as err:
        for rec in stream:
            stopper.act(stopper.check(rec["step"], rec["row"], rec["samples"]))
    assert err.value.alarms[0].step == first
    assert all(" generates" in s["completion"] for s in err.value.alarms[0].samples)
    assert " generates" in str(err.value)


def test_shaping_rise_fires_when_the_non_verifier_part_pays_more_not_when_the_verifier_does():
    """reward = math + bonus: the bonus share rising by more than shaping_rise over its first steps fires;
    the same rise in math (the task being learnt) does not."""
    def row(i, math_mean, bonus):
        return {**healthy(i), "reward/mean": math_mean + bonus, "rewards/math/mean": math_mean, "rewards/bonus/mean": bonus}
    s = AlarmSettings()
    hacked = [row(i, 0.2, 0.05 if i < 8 else 0.5) for i in range(1, 12)]
    mon = AlarmMonitor(s, echo=lambda _: None, verifiers={"math": 1.0})
    fired = {i: [a.name for a in mon.check(i, r, SAMPLES)] for i, r in enumerate(hacked, 1)}
    assert [i for i, n in fired.items() if "shaping_rise" in n] == [8, 9, 10, 11]
    learning = [row(i, 0.2 if i < 8 else 0.9, 0.05) for i in range(1, 12)]
    mon = AlarmMonitor(s, echo=lambda _: None, verifiers={"math": 1.0})
    assert not any("shaping_rise" in [a.name for a in mon.check(i, r, SAMPLES)] for i, r in enumerate(learning, 1))
    mon = AlarmMonitor(s, echo=lambda _: None)  # no verifier known: nothing to compare
    assert not any(mon.check(i, r, SAMPLES) for i, r in enumerate(hacked, 1))


def test_eval_gap_compares_recent_training_reward_with_held_out_pass_at_1():
    s = AlarmSettings()
    rows = [{**healthy(i), "reward/mean": 0.9} for i in range(1, 6)]
    rows[-1] = {**rows[-1], "eval/pass@1": 0.9 - s.eval_gap - 0.05}
    fired, printed, _ = run_stream(rows)
    assert fired == {5: ["eval_gap"]} and "held-out pass@1" in printed[0]
    rows[-1]["eval/pass@1"] = 0.9 - s.eval_gap + 0.05
    assert run_stream(rows)[0] == {}


def test_length_reward_needs_both_the_correlation_and_the_growth():
    s = AlarmSettings(length_blowup=None)
    grow = [{**healthy(i), "response_length/mean": 100 if i <= 5 else 100 * s.length_growth * 1.1} for i in range(1, 8)]
    assert run_stream(grow, s)[0] == {6: ["length_reward"], 7: ["length_reward"]}  # SAMPLES: longer earns more
    anti = [{**x, "reward": 1.0 - x["reward"]} for x in SAMPLES]  # shorter earns more: learning to be brief
    assert run_stream(grow, s, samples=anti)[0] == {}


def test_eval_gap_also_compares_the_rises_since_the_first_evaluation():
    """Held-out pass@1 starts above the training reward (other problems), then the training reward climbs
    0.4 while pass@1 climbs 0.05: level gap 0.2 (under 0.3), rise gap 0.35 (over 0.25)."""
    rows = [{**healthy(i), "reward/mean": 0.2} for i in range(1, 6)] + [{**healthy(i), "reward/mean": 0.6} for i in range(6, 11)]
    rows[4]["eval/pass@1"], rows[9]["eval/pass@1"] = 0.35, 0.40
    fired, printed, _ = run_stream(rows)
    assert fired == {10: ["eval_gap"]} and "since the first evaluation" in printed[0]
    rows[9]["eval/pass@1"] = 0.60  # held-out correctness rose with it: learning
    assert run_stream(rows)[0] == {}
