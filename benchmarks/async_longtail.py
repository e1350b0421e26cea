"""Asynchronous vs synchronous RL on a simulated long-tail rollout device (issue: scale-out, acceptance 3).

The tiny random model generates for real; each group's length is drawn from a Pareto distribution
(heavy tail) and every engine step costs `--latency` seconds of simulated device time
(benchmarks/simulated_device.py). Prints both wall times, the speedup, the idle time of generator and
trainer, and the staleness histogram of the asynchronous run.

    python benchmarks/async_longtail.py --steps 12 --staleness 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("POSTTRAIN_NO_PROGRESS", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--staleness", type=int, default=2, help="max_staleness k of the asynchronous run")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--latency", type=float, default=0.004, help="simulated seconds per engine step")
    ap.add_argument("--alpha", type=float, default=1.3, help="Pareto tail index of the lengths")
    ap.add_argument("--min-len", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--partial", default="finish", choices=["finish", "drop"])
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    from simulated_device import compare_sync_async

    out = a.out or tempfile.mkdtemp(prefix="async_longtail_")
    args = ["model=tiny-random", "data=single_digit_add:200", "reward=math", "reward_args={math: {mode: last_number}}",
            "beta=0", f"prompts_per_step={a.prompts}", f"group_size={a.group}", f"max_new_tokens={a.max_len}",
            f"max_steps={a.steps}", f"max_staleness={a.staleness}", f"partial_rollouts={a.partial}", "optim.lr=1e-4",
            "progress=false", "samples_per_log=0", f"output_dir={out}"]
    res = compare_sync_async(args, a.latency, a.alpha, a.min_len, a.max_len)
    s, y = res["sync"], res["async"]
    print(f"{a.steps} steps, B={a.prompts} x G={a.group}, Pareto(alpha={a.alpha}) lengths in [{a.min_len}, {a.max_len}], "
          f"{a.latency * 1e3:.1f} ms per engine step, k={a.staleness}, partial_rollouts={a.partial}")
    print(f"  sync : {s['wall_s']:7.2f} s   trainer idle {s['trainer_idle_s']:6.2f} s   generator idle {s['generator_idle_s']:6.2f} s")
    print(f"  async: {y['wall_s']:7.2f} s   trainer idle {y['trainer_idle_s']:6.2f} s   generator idle {y['generator_idle_s']:6.2f} s")
    print(f"  speedup {res['speedup']:.2f}x; async staleness histogram (samples) {y['staleness_hist']}")
    print(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
