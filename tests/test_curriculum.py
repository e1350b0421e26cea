"""curriculum=band (posttrain/training/curriculum.py): the draw probabilities and the pass-rate estimate
against hand-computed values, the checkpoint round trip, a killed run resumed to the same prompts, the
default order untouched, and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import COUNT_PROMPTS, run_rl, write_jsonl
from posttrain.config import ConfigError, parse_args
from posttrain.errors import UserError
from posttrain.recipes import rl
from posttrain.systems.faults import EXIT_CODE
from posttrain.training.curriculum import BandSampler, CurriculumArgs, make_sampler, prompt_key, restore_sampler
from posttrain.training.data_order import EpochSampler
from test_resume import ROOT, in_process, rows, with_dir
from test_rl_recipe import space_share  # noqa: F401  (registers the test reward run_rl uses)


def sampler(prompts, **args) -> BandSampler:
    return BandSampler(prompts, seed=3, args=CurriculumArgs(**args))


def test_probabilities_by_hand():
    """Rows A A B C D E; A p=0.5 (in 0.2 < p < 0.8), B p=1.0 and C p=0.0 (outside), D p=0.2 (on the bound:
    outside, the band is open), E unseen (counts as in). Weights 1 1 .1 .1 .1 1, sum 3.3."""
    s = sampler(["A", "A", "B", "C", "D", "E"])
    s.rates.seen = {prompt_key("A"): (1, 0.5), prompt_key("B"): (2, 1.0), prompt_key("C"): (1, 0.0), prompt_key("D"): (3, 0.2)}
    assert s.status().tolist() == [1, 1, 2, 2, 2, 0]
    expected = torch.tensor([1, 1, 0.1, 0.1, 0.1, 1], dtype=torch.float64) / 3.3
    torch.testing.assert_close(s.probabilities(), expected, rtol=0, atol=1e-15)
    # the draws follow them: 6000 single draws, each frequency within 4 sigma
    counts = torch.bincount(torch.tensor([s.take(1)[0] for _ in range(6000)]), minlength=6).double() / 6000
    sigma = (expected * (1 - expected) / 6000).sqrt()
    assert ((counts - expected).abs() < 4 * sigma).all(), (counts, expected)
    # floor=1 (or nothing seen): uniform over rows, a mixture's row counts keep their meaning
    torch.testing.assert_close(sampler(["A", "A", "B"]).probabilities(), torch.full((3,), 1 / 3, dtype=torch.float64))


def test_take_is_without_replacement_within_a_step():
    s = sampler(["A", "B", "C", "D"])
    drawn = s.take(4)
    assert sorted(drawn) == [0, 1, 2, 3]
    assert len(s.take(6)) == 6  # past N: a second pass
    assert s.step_metrics()["curriculum/drawn_unseen_frac"] == 1.0


def test_pass_rate_estimate_by_hand():
    """a_n = max(1/n, rate); a sample passes when reward > pass_threshold (0.5 itself fails); None is left out."""
    s = sampler(["A"], rate=0.5)
    key = prompt_key("A")
    for rewards, p in [([1, 0, 0, 0], 0.25),            # n=1: a=1      -> f = 0.25
                       ([1, 1, 0.5, 0], 0.25 + 0.5 * (0.5 - 0.25)),  # n=2: a=1/2, f = 2/4 (0.5 is no pass)
                       ([None, None], 0.375),           # no applicable reward: no update
                       ([1, 1, 1, 1], 0.375 + 0.5 * (1 - 0.375)),   # n=3: a=max(1/3, .5)=.5
                       ([None, 1, 0, None], 0.6875 + 0.5 * (0.5 - 0.6875))]:  # n=4, f = 1/2
        s.observe("A", rewards)
        assert s.rates.get(key) == pytest.approx(p, abs=1e-12)
    assert s.rates.seen[key][0] == 4
    # rate 0.2: the running mean for 5 groups, then exponential; fractions 0 1 1 0 1 1
    s = sampler(["A"], rate=0.2)
    for f in [0, 1, 1, 0, 1, 1]:
        s.observe("A", [f])
    assert s.rates.get(key) == pytest.approx((0 + 1 + 1 + 0 + 1) / 5 + 0.2 * (1 - 0.6), abs=1e-12)


def test_state_round_trip_draws_the_same():
    a = sampler([f"p{i % 7}" for i in range(20)], floor=0.05)
    for i in range(7):
        a.take(3)
        a.observe(f"p{i}", [float(i % 3 == 0), 1.0, 0.0, float(i % 2)])
    state = json.loads(json.dumps(a.state()))  # as state.json stores it
    b = sampler([f"p{i % 7}" for i in range(20)], floor=0.05)
    restore_sampler(b, state)
    torch.testing.assert_close(b.probabilities(), a.probabilities(), rtol=0, atol=0)
    assert [b.take(3) for _ in range(5)] == [a.take(3) for _ in range(5)]
    # a checkpoint of the other kind is refused, both ways
    with pytest.raises(UserError, match="curriculum=band"):
        restore_sampler(EpochSampler(20, 3), state)
    with pytest.raises(UserError, match="curriculum=none"):
        restore_sampler(b, EpochSampler(20, 3).state())


def test_default_is_the_epoch_order(tmp_path):
    """curriculum=none: the same EpochSampler as before (the same draws), no curriculum/* metrics."""
    s = make_sampler("none", {}, ["x"] * 9, 5)
    ref = EpochSampler(9, 5)
    assert type(s) is EpochSampler and [s.take(4) for _ in range(5)] == [ref.take(4) for _ in range(5)]
    _, out = run_rl(tmp_path, "max_steps=2", "beta=0")
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("curriculum/") for row in history for k in row)


def test_band_run_tracks_every_group(tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS)
    cfg = parse_args(rl.RLConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}",
                                   "reward=space_share", "prompts_per_step=3", "group_size=4", "max_new_tokens=8",
                                   "beta=0", "max_steps=3", "progress=false", "curriculum=band",
                                   "curriculum_args={pass_threshold: 0.1, floor: 0.2}"])
    run = rl.setup(cfg)
    assert run.curriculum is run.sampler
    rows_ = [rl.rl_step(run, step) for step in range(3)]
    seen = run.curriculum.rates.seen
    assert sum(n for n, _ in seen.values()) == 9  # 3 steps x 3 groups, each folded in once
    assert rows_[-1]["curriculum/prompts_seen"] == len(seen) and rows_[-1]["curriculum/prompts"] == 8
    assert rows_[0]["curriculum/drawn_unseen_frac"] == 1.0
    rl.finish(run)
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-3" / "state.json").read_text())
    assert state["sampler"]["kind"] == "band" and state["sampler"]["draws"] == 3


def test_a_killed_band_run_resumes_to_the_same_prompts(tmp_path):
    """Killed after step 3 (checkpoints at 2 and 4), resumed: the same metrics (curriculum/* included), the
    same samples (prompts), the same tracked rates in the last checkpoint."""
    (tmp_path / "reward.py").write_text("def space_share(prompts, completions, **kw):\n"
                                        "    return [c.count(' ') / max(len(c), 1) for c in completions]\n")
    data = write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS[:6])
    argv = ["rl", "model=tiny-random", "progress=false", "max_steps=4", "save_every=2", f"data={data}",
            f"reward={tmp_path / 'reward.py'}:space_share", "prompts_per_step=2", "group_size=4", "max_new_tokens=6",
            "optim.lr=1e-3", "samples_per_log=8", "beta=0", "curriculum=band",
            "curriculum_args={pass_threshold: 0.1, floor: 0.2}"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    in_process(with_dir(argv, straight))
    env = {**os.environ, "POSTTRAIN_FAIL_AT": "0:3", "POSTTRAIN_NO_PROGRESS": "1"}
    killed = subprocess.run([sys.executable, "-m", "posttrain", *with_dir(argv, cut)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == EXIT_CODE, killed.stderr[-3000:]
    in_process(with_dir(argv, cut) + ["resume=true"])
    for log in ("metrics.jsonl", "samples.jsonl"):
        assert rows(cut / log) == rows(straight / log), log
    assert any("curriculum/in_band_frac" in json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines())
    last = [json.loads((d / "checkpoints" / "step-4" / "state.json").read_text())["sampler"] for d in (straight, cut)]
    assert last[0] == last[1] and last[0]["draws"] == 4


@pytest.mark.parametrize("args, match", [
    (["curriculum_args={low: 0.3}"], "curriculum=none: add curriculum=band"),
    (["curriculum=band", "curriculum_args={low: 0.8, high: 0.2}"], "0 <= low < high <= 1"),
    (["curriculum=band", "curriculum_args={low: 0.5, high: 0.5}"], "0 <= low < high <= 1"),
    (["curriculum=band", "curriculum_args={low: -0.1}"], "low"),
    (["curriculum=band", "curriculum_args={high: 1.5}"], "high"),
    (["curriculum=band", "curriculum_args={floor: 0}"], "floor"),
    (["curriculum=band", "curriculum_args={lo: 0.1}"], "lo.*keys: low, high"),
    (["curriculum=band", "async_rl=true"], "async_rl"),
    (["curriculum=band", "cluster=ray"], "async_rl / cluster=ray"),
    (["curriculum=bands"], "curriculum"),
])
def test_refusals(args, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(rl.RLConfig, ["model=tiny-random", *args])


@pytest.mark.parametrize("algo", ["ppo", "online_dpo"])
def test_band_with_ppo_and_online_dpo(tmp_path, algo):
    """The other steps share the collect: their groups feed the band too."""
    _, out = run_rl(tmp_path, f"algo={algo}", "max_steps=2", "beta=0", "curriculum=band",
                    "curriculum_args={pass_threshold: 0.1}")
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["curriculum/drawn_unseen_frac"] for r in history][0] == 1.0
    state = json.loads((out / "checkpoints" / "step-2" / "state.json").read_text())["sampler"]
    assert sum(n for n, _ in state["rates"].values()) == 2 * 4  # 2 steps x prompts_per_step 4
