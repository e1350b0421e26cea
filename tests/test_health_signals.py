"""Health signals: the engine's per-step counters (rollout/signals.py) in RL rows, PPO's groups/*, plan.json's
phase_seconds from the step timers, CUDA peak memory as the measured memory, MFU > 1 as a measurement error."""

import json
import math

import pytest
import torch

import test_rl_recipe  # noqa: F401  registers the `space_share` reward run_rl uses
from conftest import conv, run_rl, write_jsonl
from posttrain.models.loading import load_model
from posttrain.plan import measure
from posttrain.rollout.engine import Engine, EngineConfig
from posttrain.rollout.signals import EngineWindow, window
from posttrain.rollout.types import Request, SamplingParams


def test_window_signals_are_differences_of_the_cumulative_counters():
    before = {"generated_tokens": 100, "prefill_s": 1.0, "decode_s": 3.0, "decode_steps": 10, "batch_occupancy": 0.5,
              "preemptions": 2}
    after = {"generated_tokens": 160, "prefill_s": 1.5, "decode_s": 5.5, "decode_steps": 30, "batch_occupancy": 0.75,
             "preemptions": 5, "window_peak_kv_mb": 3.0, "kv_capacity_mb": 12.0}
    w = window(before, after)
    assert w["generated_tokens"] == 60 and w["tokens_per_s"] == pytest.approx(60 / 3.0)
    assert w["decode_tokens_per_s"] == pytest.approx(60 / 2.5)
    # occupancy sums: 0.75 × 30 − 0.5 × 10 = 17.5 over 20 new decode steps
    assert w["batch_occupancy"] == pytest.approx(17.5 / 20)
    assert w["kv_peak_frac"] == 0.25 and w["preemptions"] == 3
    hf_like = window({}, {"generated_tokens": 8, "decode_s": 2.0})  # no KV, no scheduler: what it has
    assert hf_like == {"generated_tokens": 8, "tokens_per_s": 4.0}


def test_a_tight_kv_cache_shows_as_preemptions_and_a_full_cache_in_the_window():
    model = load_model("tiny-random").eval()
    eng = Engine(model, None, EngineConfig(max_num_seqs=16, max_model_len=80, kv_cache_mb=0.06, block_size=8))
    win = EngineWindow()
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=5)
    eng.generate([Request(list(range(10, 27)), params), Request(list(range(100, 140)), params)])
    first = win.take(eng)
    assert first["engine/preemptions"] == eng.stats.preemptions > 0
    assert first["engine/generated_tokens"] == 8 * 24
    assert first["engine/kv_peak_frac"] == pytest.approx(eng.stats.peak_kv_blocks / eng.blocks.num_blocks)
    assert first["engine/kv_peak_frac"] > 0.9  # preempted because the cache was full
    assert 0 < first["engine/batch_occupancy"] <= 8 / 16
    eng.generate([Request([5, 6, 7], SamplingParams(n=1, max_new_tokens=4, ignore_eos=True, seed=1))])
    second = win.take(eng)  # one short sample: its own window, not the totals
    assert second["engine/generated_tokens"] == 4 and second["engine/preemptions"] == 0
    assert second["engine/kv_peak_frac"] < 0.2
    assert second["engine/batch_occupancy"] == pytest.approx(1 / 16)


def test_rl_rows_carry_engine_signals_and_plan_json_the_phase_seconds(tmp_path):
    _, out = run_rl(tmp_path, "max_steps=2", "algo=ppo", "critic_lr=1e-3")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["engine/generated_tokens"] == r["generated_tokens"]  # the step's generation, nothing else
        assert r["engine/tokens_per_s"] > 0 and r["engine/preemptions"] == 0
        assert 0 < r["engine/kv_peak_frac"] <= 1 and 0 < r["engine/batch_occupancy"] <= 1
        # PPO rows: the groups' reward health (4 samples per prompt here)
        assert {"groups/zero_adv_frac", "groups/all_pass_frac", "groups/all_fail_frac"} <= set(r)
    plan = json.loads((out / "plan.json").read_text())
    phases = plan["measured"]["phase_seconds"]
    assert phases["generate"] == pytest.approx(sum(r["time/generate"] for r in rows))
    assert phases["update"] == pytest.approx(sum(r["time/update"] for r in rows))
    assert set(plan["comparison"]["phase_seconds_over_predicted"]) >= {"generate", "train"}


def test_ppo_group_metrics_with_one_sample_per_prompt_are_pass_and_fail_rates():
    from posttrain.recipes.rl.phases import ppo_group_metrics

    m = ppo_group_metrics(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), torch.tensor([0, 1, 2, 3]))
    assert set(m) == {"groups/all_pass_frac", "groups/all_fail_frac"}  # a group of one is always "flat"
    assert float(m["groups/all_pass_frac"]) == 0.5 and float(m["groups/all_fail_frac"]) == 0.5
    g = ppo_group_metrics(torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64), torch.tensor([0, 0, 1, 1]))
    assert float(g["groups/zero_adv_frac"]) == 0.5 and float(g["groups/all_pass_frac"]) == 0.5


def test_sft_plan_json_has_phase_seconds(tmp_path):
    from posttrain.config import parse_args
    from posttrain.recipes import sft

    data = write_jsonl(tmp_path / "d.jsonl", [conv(f"{a}+1?", f"{a + 1}") for a in range(16)])
    cfg = parse_args(sft.SFTConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}", "max_steps=3",
                                     "batch_size=4", "progress=false", "eval_fraction=0", "sample_every=0"])
    sft.train(cfg)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    phases = plan["measured"]["phase_seconds"]
    assert phases["forward_backward"] == pytest.approx(sum(r["time/forward_backward"] for r in rows))
    assert set(phases) == {k[len("time/"):] for r in rows for k in r if k.startswith("time/")}
    ratio = plan["comparison"]["phase_seconds_over_predicted"]["train"]
    predicted = plan["predicted"]["phases"][0]["seconds"]
    assert ratio == pytest.approx((phases["forward_backward"] + phases["update"]) / 3 / predicted)


def _pred(peak=1e9):
    return {"tokens_per_step": 100, "seconds_per_step": 1.0, "hardware": {"peak_flops": peak},
            "phases": [{"phase": "train", "seconds": 1.0, "bound": "compute", "flops_run": 4e8}]}


def test_an_mfu_above_one_is_a_measurement_error_not_a_number():
    m = {"steps": 2, "tokens_per_step": 100, "seconds_per_step": 0.5, "phase_seconds": {"update": 0.2}}
    comparison, notes = measure.compare(_pred(), m)
    # 2 × 4e8 FLOPs in 0.2 s = 4e9 FLOP/s against a 1e9 peak: 4.00x
    assert comparison["achieved_mfu"] is None
    assert len(notes) == 1 and "measurement error" in notes[0] and "4.00x the peak" in notes[0]
    ok, none = measure.compare(_pred(peak=1e10), m)
    assert ok["achieved_mfu"] == pytest.approx(0.4) and none == []
    assert ok["phase_seconds_over_predicted"] == {"train": pytest.approx(0.1)}


def test_write_measured_puts_the_note_in_plan_json(tmp_path):
    measure.write_plan(tmp_path, _pred())
    measure.write_measured(tmp_path, {"steps": 2, "tokens_per_step": 100, "seconds_per_step": 0.5,
                                      "phase_seconds": {"update": 0.2}})
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["comparison"]["achieved_mfu"] is None and "MFU > 1 is impossible" in data["notes"][0]


class FakeCuda:
    """torch.cuda as a run on a GPU sees it: 1 GiB allocated before, 3 GiB at the peak."""

    def __init__(self):
        self.reset = 0

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def reset_peak_memory_stats(self):
        self.reset += 1

    def memory_allocated(self):
        return 2**30

    def max_memory_allocated(self):
        return 3 * 2**30


def test_on_cuda_the_measured_memory_is_max_memory_allocated(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch, "cuda", fake)
    m = measure.Measured()
    assert fake.reset == 1  # the peak belongs to this run
    m.add_step(10)
    d = m.as_dict()
    assert (d["cuda_peak_allocated_bytes"], d["cuda_peak_growth_bytes"]) == (3 * 2**30, 2 * 2**30)
    assert d["memory_source"] == "torch.cuda.max_memory_allocated" and "peak_rss_bytes" in d  # host RSS kept
    comparison, _ = measure.compare({"peak_bytes_estimate": 2**30}, d)
    assert comparison["peak_memory_over_predicted"] == 2.0
    monkeypatch.undo()
    assert measure.Measured().as_dict()["memory_source"] == "peak RSS (VmHWM)"
    assert math.isfinite(measure.Measured().as_dict()["peak_rss_growth_bytes"])


def test_an_evaluation_reports_its_own_engine_window(tmp_path, tiny_tok):
    from posttrain.data.tasks import generate
    from posttrain.eval.hook import evaluate
    from posttrain.rewards.registry import load_file_reward
    from posttrain.rollout.settings import SamplingSettings

    (tmp_path / "even.py").write_text("def even(completions, **kw):\n    return [float(len(c) % 2 == 0) for c in completions]\n")
    reward = load_file_reward(f"{tmp_path / 'even.py'}:even").fn
    engine = Engine(load_model("tiny-random"), tiny_tok, EngineConfig(max_num_seqs=32, kv_cache_mb=16))
    engine.generate([Request([5, 6, 7], SamplingParams(n=2, max_new_tokens=9, ignore_eos=True, seed=0))])  # earlier work
    rows = generate("single_digit_add:all")[:6]
    m = evaluate(engine, tiny_tok, rows, reward, n=4, sampling=SamplingSettings(max_new_tokens=5), seed=3)
    generated = engine.stats.generated_tokens - 18  # the evaluation's tokens only
    assert m["eval/engine/generated_tokens"] == generated > 0
    assert m["eval/engine/tokens_per_s"] > 0 and m["eval/engine/preemptions"] == 0
    assert 0 < m["eval/engine/kv_peak_frac"] < 1 and 0 < m["eval/engine/batch_occupancy"] <= 24 / 32


def test_seconds_per_step_leave_the_set_up_out():
    m = measure.Measured()
    m.step_ends = []
    m.add_step(10)
    m.step_ends[-1] = 100.0  # steps end at 100, 103, 109: steady 4.5 s per step, whatever came before step 1
    m.add_step(10)
    m.step_ends[-1] = 103.0
    m.add_step(10)
    m.step_ends[-1] = 109.0
    d = m.as_dict()
    assert d["seconds_per_step"] == 4.5 and d["seconds_per_step_with_setup"] == pytest.approx(d["seconds"] / 3)
    assert measure.steady_step_seconds([5.0]) is None
