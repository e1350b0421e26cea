"""Slow: DPO and a reward model from SmolLM2-135M-Instruct's own samples on single-digit addition (run by
hand: `pytest -m slow -s tests/test_slow_dpo_rm.py` to see the numbers).

Pairs: for each of the 81 problems, samples of the model itself at T = 1; a sample whose last number is
a + b is chosen, one whose last number is not is rejected, same prompt. Then
    dpo   raises pass@1 over the 81 problems (8 samples each, T = 1) from about 0.2 to >= 0.6;
    rm    reaches >= 90 % pairwise accuracy on held-out pairs, and as `reward=rm:PATH` in GRPO (the
          run of tests/test_slow_rl.py, 20 steps) raises pass@1.
"""

import json
import os
import time

import pytest

from posttrain.models.builtin import real_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (real_model_dir("smollm2-135m-instruct") / "config.json").is_file(),
                       reason="run `posttrain models fetch smollm2-135m-instruct` first"),
]

MODEL = "smollm2-135m-instruct"
SEED = int(os.environ.get("POSTTRAIN_SLOW_SEED", "0"))  # rerun with another seed: POSTTRAIN_SLOW_SEED=1
REWARD_OPTIONS = {"math": {"mode": "last_number"}}


def own_pairs(model, tok, samples: int = 32, seed: int = 0, pairs_per_prompt: int = 4,
              finished_only: bool = True) -> list[dict]:
    """Preference pairs from the model's own samples: (correct, incorrect) of the same prompt, distinct texts;
    `finished_only`: samples that ended (not cut at the 24-token limit), whose last number is their answer."""
    from posttrain.data.tasks import generate
    from posttrain.data.templates import render_prompt
    from posttrain.rewards.registry import compose
    from posttrain.rollout.engine import Engine, EngineConfig
    from posttrain.rollout.types import Request, SamplingParams

    rows = generate("single_digit_add:all")
    engine = Engine(model, tok, EngineConfig(max_num_seqs=256, kv_cache_mb=512))
    outs = engine.generate([Request(render_prompt(tok, r["prompt"]), SamplingParams(
        n=samples, temperature=1.0, max_new_tokens=24, seed=seed * 7919 + i)) for i, r in enumerate(rows)])
    reward = compose("math", options=REWARD_OPTIONS)
    pairs = []
    for r, out in zip(rows, outs):
        done = [s.text.strip() for s in out.samples if s.text.strip() and (s.finish_reason == "stop" or not finished_only)]
        scores = reward([r["prompt"]] * len(done), done, answer=[r["answer"]] * len(done))
        good = list(dict.fromkeys(t for t, s in zip(done, scores) if s == 1.0))  # distinct texts, sample order
        bad = list(dict.fromkeys(t for t, s in zip(done, scores) if s == 0.0))
        for k in range(min(len(good), len(bad), pairs_per_prompt)):
            pairs.append({"prompt": r["prompt"], "chosen": good[k % len(good)], "rejected": bad[k], "answer": r["answer"]})
    return pairs


def pass_at_1(model, tok, n: int = 8) -> float:
    from test_slow_rl import pass_at_1 as measure

    return measure(model, tok, n)


def write_pairs(path, pairs) -> str:
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return str(path)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    from posttrain.models.loading import load_model, load_tokenizer

    tok = load_tokenizer(MODEL)
    model = load_model(MODEL)
    t0 = time.perf_counter()
    pairs = own_pairs(model, tok, seed=SEED)
    print(f"\n{len(pairs)} pairs from {len({p['answer'] + json.dumps(p['prompt']) for p in pairs})} prompts "
          f"in {time.perf_counter() - t0:.0f} s")
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", pairs)


DPO_ARGS = [f"seed={SEED}", f"model={MODEL}", "loss=dpo", "beta=0.1", "batch_size=16", "optim.lr=5e-6", "optim.warmup_steps=2",
            "optim.schedule=linear", "eval_every=0", "length_probe.prompts=0", "progress=false",
            "eval_fraction=0.1"]


def test_dpo_on_own_samples_raises_pass_at_1(pairs_file, tmp_path):
    from posttrain.config import parse_args
    from posttrain.recipes import dpo

    cfg = parse_args(dpo.DPOConfig, [*DPO_ARGS, f"data={pairs_file}", f"output_dir={tmp_path / 'dpo'}", "max_steps=40"])
    run = dpo.setup(cfg)
    before = pass_at_1(run.model, run.tok)
    t0 = time.perf_counter()
    rows = [dpo.dpo_step(run, s) for s in range(cfg.max_steps)]
    train_s = time.perf_counter() - t0
    summary = dpo.finish(run)
    after = pass_at_1(run.model, run.tok)
    print(f"\nDPO pass@1 {before:.3f} -> {after:.3f}; {cfg.max_steps} steps in {train_s:.0f} s; held-out pair accuracy "
          f"{summary.get('eval/accuracy_after', float('nan')):.3f}; loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; "
          f"reference computed {summary['reference/computations']} times for {summary['reference/sequences']} sequences")
    assert summary["reference/max_per_sequence"] == 1
    assert after >= 0.6, (before, after)


def test_rm_on_own_samples_and_as_grpo_reward(pairs_file, tmp_path):
    from posttrain.config import parse_args
    from posttrain.recipes import rl, rm
    from test_slow_rl import ARGS

    cfg = parse_args(rm.RMConfig, [f"model={MODEL}", f"data={pairs_file}", f"output_dir={tmp_path / 'rm'}", "max_steps=60",
                                   "batch_size=16", "optim.lr=1e-5", "optim.warmup_steps=3", "eval_fraction=0.2",
                                   "eval_every=0", "progress=false", "mixed_precision=bf16"])
    t0 = time.perf_counter()
    summary = rm.train(cfg)
    print(f"\nRM held-out pairwise accuracy {summary['eval/accuracy_before']:.3f} -> {summary['eval/accuracy_after']:.3f} "
          f"({summary['eval_pairs']} pairs; train {summary['train_eval/accuracy_after']:.3f}) in {time.perf_counter() - t0:.0f} s")
    assert summary["eval/accuracy_after"] >= 0.9
    args = [a for a in ARGS if not a.startswith(("reward=", "reward_args="))]
    grpo = parse_args(rl.RLConfig, [*args, f"reward=rm:{tmp_path / 'rm' / 'final'}", "mixed_precision=bf16", "max_steps=20",
                                    f"output_dir={tmp_path / 'grpo'}"])
    run = rl.setup(grpo)
    before = pass_at_1(run.model, run.tok)
    rewards = [rl.rl_step(run, s)["reward/mean"] for s in range(grpo.max_steps)]
    rl.finish(run)
    after = pass_at_1(run.model, run.tok)
    print(f"GRPO with reward=rm: pass@1 {before:.3f} -> {after:.3f}; RM reward {rewards[0]:.3f} -> "
          f"{sum(rewards[-5:]) / 5:.3f} (last 5)")
    assert after > before + 0.1, (before, after)
