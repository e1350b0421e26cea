"""Evaluation during training: the engine's on_output stream, `evaluate`, the hook in SFT."""

import json

import pytest

from posttrain.config import ConfigError, parse_args
from posttrain.models.loading import load_model
from posttrain.rollout.engine import Engine, EngineConfig
from posttrain.rollout.types import Request, SamplingParams

pytestmark = pytest.mark.timeout(300)


def test_engine_reports_each_output_once_as_it_finishes(tiny_tok):
    model = load_model("tiny-random")
    engine = Engine(model, tiny_tok, EngineConfig(max_num_seqs=4, max_model_len=64, kv_cache_mb=8))
    reqs = [Request([5, 6, 7 + i], SamplingParams(n=2, max_new_tokens=3 + 4 * i, seed=i), request_id=i) for i in range(5)]
    reqs.append(Request(list(range(10, 80)), SamplingParams(n=1), request_id=5))  # longer than max_model_len: refused
    seen = []
    outs = engine.generate(reqs, on_output=seen.append)
    assert sorted(o.request_id for o in seen) == list(range(6)) and len(seen) == 6
    assert seen[0].request_id == 5 and seen[0].error  # the refusal is reported first
    assert all(o.samples for o in seen if o.request_id != 5)  # each one complete when reported
    # the stream changes nothing: the same samples as a plain generate of the same requests
    again = Engine(model, tiny_tok, EngineConfig(max_num_seqs=4, max_model_len=64, kv_cache_mb=8)).generate(reqs)
    assert [[s.token_ids for s in o.samples] for o in outs] == [[s.token_ids for s in o.samples] for o in again]


def test_evaluate_returns_pass_at_1_with_its_interval(tmp_path, tiny_tok):
    from posttrain.data.tasks import generate
    from posttrain.eval.hook import evaluate
    from posttrain.rewards.registry import load_file_reward

    (tmp_path / "even.py").write_text("def even(completions, **kw):\n    return [float(len(c) % 2 == 0) for c in completions]\n")
    reward = load_file_reward(f"{tmp_path / 'even.py'}:even").fn
    engine = Engine(load_model("tiny-random"), tiny_tok, EngineConfig(max_num_seqs=32, kv_cache_mb=16))
    rows = generate("single_digit_add:all")[:10]
    from posttrain.rollout.settings import SamplingSettings

    m = evaluate(engine, tiny_tok, rows, reward, n=4, sampling=SamplingSettings(max_new_tokens=5), seed=3, ks=(1, 4))
    assert set(m) >= {"eval/pass@1", "eval/pass@1_low", "eval/pass@1_high", "eval/pass@4", "eval/mean@n", "eval/seconds"}
    assert 0 < m["eval/pass@1"] < 1 and m["eval/pass@1_low"] < m["eval/pass@1"] < m["eval/pass@1_high"]
    assert m["eval/pass@4"] >= m["eval/pass@1"] and m["eval/mean@n"] == pytest.approx(m["eval/pass@1"])
    again = evaluate(engine, tiny_tok, rows, reward, n=4, sampling=SamplingSettings(max_new_tokens=5), seed=3, ks=(1, 4))
    assert again["eval/pass@1"] == m["eval/pass@1"]  # seeded: the same draws


def test_eval_settings_are_checked_at_parse_time():
    from posttrain.recipes.sft import SFTConfig

    with pytest.raises(ConfigError, match="n >= 4"):
        parse_args(SFTConfig, ["eval_tasks.n=2", "eval_tasks.k=1,4"])
    with pytest.raises(ConfigError, match="temprature"):
        parse_args(SFTConfig, ["eval_tasks.sampling={temprature: 0.5}"])
    cfg = parse_args(SFTConfig, ["eval_tasks.data=single_digit_add:all", "eval_tasks.sampling={temperature: 0.5}"])
    assert cfg.eval_tasks.sampling_settings().temperature == 0.5


def test_sft_logs_held_out_pass_at_1_at_eval_steps(tmp_path):
    from posttrain.recipes import sft

    cfg = parse_args(sft.SFTConfig, [
        "model=tiny-random", "data=single_digit_add:100", f"output_dir={tmp_path / 'run'}", "max_steps=4", "batch_size=4",
        "max_length=64", "eval_every=2", "sample_every=0", "save_every=0", "progress=false", "forgetting_probe=false",
        "eval_tasks.data=single_digit_add:all", "eval_tasks.max_items=8", "eval_tasks.n=2", "eval_tasks.k=1,2",
        "eval_tasks.reward_args={math: {mode: last_number}}", "eval_tasks.sampling={max_new_tokens: 4}",
    ])
    sft.train(cfg)
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [2, 4]
    for r in rows:
        if "eval/pass@1" in r:
            assert r["eval/pass@1_low"] <= r["eval/pass@1"] <= r["eval/pass@1_high"] and "eval/pass@2" in r and "eval/loss" in r
    assert ">eval/pass@1</text>" in (tmp_path / "run" / "report.html").read_text()  # charted beside the training curves


def test_hook_runs_on_the_rl_recipes_engine_and_reward(tmp_path):
    """The one-call API the RL recipe uses: its engine (shared weights), its reward, its sampling section."""
    from posttrain.eval.hook import EvalHook, EvalSettings
    from posttrain.recipes import rl

    cfg = parse_args(rl.RLConfig, ["model=tiny-random", "data=single_digit_add:40", "reward=math", f"output_dir={tmp_path / 'rl'}",
                                   "max_steps=1", "prompts_per_step=2", "group_size=2", "max_new_tokens=4", "progress=false"])
    run = rl.setup(cfg)
    hook = EvalHook(EvalSettings(data="single_digit_add:all", max_items=5, n=2, k=[1, 2]), run.tok,
                    recipe_reward=run.reward_fn, default_sampling=cfg.sampling)
    assert hook.reward_fn is run.reward_fn and hook.sampling.max_new_tokens == 4
    rl.rl_step(run, 0)
    assert hook.maybe(run.engine, 1) == {}  # every = 0: only at the end
    m = hook.maybe(run.engine, 1, last=True)
    assert m["eval/pass@1_low"] <= m["eval/pass@1"] <= m["eval/pass@1_high"] and "eval/pass@2" in m


def test_hook_scores_with_the_training_rewards_verifiers_only(tiny_tok, capsys):
    """With shaping terms mixed into the training reward, the held-out verdict is the verifier's alone."""
    from posttrain.eval.hook import EvalHook, EvalSettings
    from posttrain.rewards.registry import compose

    mixed = compose("math,format:0.2")
    hook = EvalHook(EvalSettings(data="single_digit_add:all", max_items=3), tiny_tok, recipe_reward=mixed)
    assert hook.reward_fn.parts == [("math", 1.0)]
    assert "the training reward's verifiers" in capsys.readouterr().out
    plain = compose("math")
    assert EvalHook(EvalSettings(data="single_digit_add:all", max_items=3), tiny_tok, recipe_reward=plain).reward_fn is plain
