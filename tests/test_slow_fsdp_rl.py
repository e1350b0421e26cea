"""Slow: GRPO under `torchrun --nproc-per-node 2 -m posttrain rl` (FSDP2, gloo) teaches the real
SmolLM2-135M-Instruct single-digit addition as one process does (issue #16: RL runs sharded). Run alone, by
hand: `pytest -m slow -s tests/test_slow_fsdp_rl.py` (~6 minutes on 2 cores)."""

import os
import subprocess
import sys
import time

from test_slow_rl import ARGS, pass_at_1, pytestmark  # noqa: F401  (slow + needs the fetched model)


def test_grpo_under_torchrun_teaches_single_digit_addition(tmp_path):
    from posttrain.models.loading import load_model, load_tokenizer

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "posttrain",
           "rl", *ARGS, "algo=grpo", "mixed_precision=bf16", "max_steps=40", "save_every=10", f"output_dir={out}"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"}, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    after = pass_at_1(load_model(str(out / "final")), load_tokenizer(str(out / "final")))
    print(f"\ngrpo at 2 ranks: pass@1 over the 81 additions {after:.3f}; 40 steps in {seconds:.0f} s (with start-up)")
    assert (out / "checkpoints" / "step-40" / "dcp").is_dir()
    assert after >= 0.8, after
