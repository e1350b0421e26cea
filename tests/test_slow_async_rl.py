"""Slow: asynchronous GRPO (max_staleness=1) still teaches the real SmolLM2-135M-Instruct single-digit
addition (issue #16 acceptance 3: pass@1 >= 0.8). Run alone, by hand:
`pytest -m slow -s tests/test_slow_async_rl.py`."""

import time

from test_slow_rl import ARGS, pass_at_1, pytestmark  # noqa: F401  (slow + needs the fetched model)


def test_async_grpo_teaches_single_digit_addition(tmp_path):
    from posttrain.config import parse_args
    from posttrain.recipes import rl

    cfg = parse_args(rl.RLConfig, [*ARGS, "algo=grpo", "mixed_precision=bf16", "max_steps=40", "async_rl=true",
                                   "max_staleness=1", f"output_dir={tmp_path / 'run'}"])
    run = rl.setup(cfg)
    before = pass_at_1(run.model, run.tok)
    t0 = time.perf_counter()
    rows = [rl.rl_step(run, step) for step in range(cfg.max_steps)]
    train_s = time.perf_counter() - t0
    summary = rl.finish(run)
    after = pass_at_1(run.model, run.tok)
    print(f"\nasync grpo k=1: pass@1 {before:.3f} -> {after:.3f}; {cfg.max_steps} steps in {train_s:.0f} s; "
          f"staleness {summary['async_staleness_hist']}; idle trainer {summary['async_trainer_idle_s']:.0f} s, "
          f"generator {summary['async_generator_idle_s']:.0f} s; reward {rows[0]['reward/mean']:.3f} -> "
          f"{sum(r['reward/mean'] for r in rows[-5:]) / 5:.3f} (last 5)")
    assert all(r["async/staleness/max"] <= 1 for r in rows)
    assert after >= 0.8, (before, after)
