"""Slow: GRPO teaches the real SmolLM2-135M-Instruct single-digit addition (run by hand:
`make test-slow`, or `pytest -m slow -s tests/test_slow_rl.py` to see the numbers)."""

import os
import time

import pytest

from posttrain.models.builtin import real_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (real_model_dir("smollm2-135m-instruct") / "config.json").is_file(),
                       reason="run `posttrain models fetch smollm2-135m-instruct` first"),
]

# The run of the RL-core issue: 4 prompts x 8 samples, <= 24 new tokens, lr 5e-6 linear, beta 0,
# reward = the last integer of the completion equals a + b.
SEED = int(os.environ.get("POSTTRAIN_SLOW_SEED", "0"))  # rerun with another seed: POSTTRAIN_SLOW_SEED=1
ARGS = [f"seed={SEED}", "model=smollm2-135m-instruct", "data=single_digit_add:2000", "reward=math",
        "reward_args={math: {mode: last_number}}", "beta=0", "prompts_per_step=4", "group_size=8",
        "max_new_tokens=24", "optim.lr=5e-6", "optim.schedule=linear", "progress=false"]


def pass_at_1(model, tok, n: int = 8) -> float:
    """Mean reward over the 81 problems x n samples at temperature 1 (pass@1 estimated from n samples)."""
    from posttrain.data.tasks import generate
    from posttrain.data.templates import render_prompt
    from posttrain.rewards.registry import compose
    from posttrain.rollout.engine import Engine, EngineConfig
    from posttrain.rollout.types import Request, SamplingParams

    rows = generate("single_digit_add:all")
    engine = Engine(model, tok, EngineConfig(max_num_seqs=128, kv_cache_mb=256))
    reqs = [Request(render_prompt(tok, r["prompt"]), SamplingParams(n=n, temperature=1.0, max_new_tokens=24, seed=i))
            for i, r in enumerate(rows)]
    outs = engine.generate(reqs)
    reward = compose("math", options={"math": {"mode": "last_number"}})
    texts = [s.text for o in outs for s in o.samples]
    answers = [r["answer"] for r in rows for _ in range(n)]
    scores = reward([None] * len(texts), texts, answer=answers)
    return sum(scores) / len(scores)


@pytest.mark.parametrize("algo,mixed_precision,max_steps,budget_s,target,extra", [
    ("grpo", "bf16", 40, 240, 0.85, ()),  # the RL-core issue: >= 0.85 within 4 minutes of training
    # PPO with a value model (2 more forwards and a backward per step); the preset's 2 epochs x 2 minibatches
    ("ppo", "bf16", 40, 600, 0.8, ()),
])
def test_rl_teaches_single_digit_addition(tmp_path, algo, mixed_precision, max_steps, budget_s, target, extra):
    from posttrain.config import parse_args
    from posttrain.recipes import rl

    cfg = parse_args(rl.RLConfig, [*ARGS, f"algo={algo}", f"mixed_precision={mixed_precision}", f"max_steps={max_steps}",
                                   f"output_dir={tmp_path / 'run'}", *extra])
    run = rl.setup(cfg)
    before = pass_at_1(run.model, run.tok)
    t0 = time.perf_counter()
    rewards = [rl.rl_step(run, step)["reward/mean"] for step in range(max_steps)]
    train_s = time.perf_counter() - t0
    rl.finish(run)
    after = pass_at_1(run.model, run.tok)
    print(f"\n{algo}: pass@1 {before:.3f} -> {after:.3f}; {max_steps} steps in {train_s:.0f} s "
          f"({train_s / max_steps:.2f} s/step); training reward {rewards[0]:.3f} -> {sum(rewards[-5:]) / 5:.3f} (last 5)")
    assert after >= target, (before, after)
    assert train_s <= budget_s, train_s
