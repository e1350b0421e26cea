"""GRPO step time with each generation backend, side by side in one process: the quickstart's RL recipe
(configs/quickstart.yaml `rl:` section: SmolLM2-135M-Instruct, 4 prompts x 8 samples, 24 new tokens, bf16
autocast) with `backend=builtin` and `backend=hf` (transformers generate), steps alternating between the two
runs so both see the same machine load.

Each side is its own RL run (own model, optimizer, data order); a step is `rl_step` wall time, split into
generation (`time/generate`) and the rest. The first --warmup steps of each side are not timed. Prints the
median s/step and generation s/step of each backend and `hf/builtin: N.NNx`.

    .venv/bin/python benchmarks/rl_backends.py [--steps 8] [--warmup 1] [--backends builtin,hf] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

os.environ.setdefault("POSTTRAIN_NO_PROGRESS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]


def make_run(backend: str, model: str, steps: int, out: Path):
    from posttrain.recipes.rl import RLConfig, setup

    section = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["rl"]
    section.update(model=model, backend=backend, max_steps=steps, save_every=0, output_dir=str(out / backend),
                   eval={"data": ""}, progress=False)
    return setup(RLConfig(**section))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--backends", default="builtin,hf")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    from posttrain.recipes.rl.step import rl_step

    names = args.backends.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {b: make_run(b, args.model, args.warmup + args.steps, Path(tmp)) for b in names}
        times = {b: [] for b in names}
        gen = {b: [] for b in names}
        for step in range(args.warmup + args.steps):
            for b in names:
                t0 = time.perf_counter()
                row = rl_step(runs[b], step)
                dt = time.perf_counter() - t0
                if step >= args.warmup:
                    times[b].append(dt)
                    gen[b].append(float(row.get("time/generate", 0.0)))
                print(f"step {step} {b:8s} {dt:6.2f} s (generate {float(row.get('time/generate', 0.0)):5.2f} s) "
                      f"reward {float(row.get('reward/mean', float('nan'))):.3f}", flush=True)
    for b in names:
        print(f"{b:8s} median {statistics.median(times[b]):.2f} s/step, generation {statistics.median(gen[b]):.2f} s/step")
    if "hf" in names and "builtin" in names:
        print(f"hf/builtin: {statistics.median(times['hf']) / statistics.median(times['builtin']):.2f}x per step, "
              f"{statistics.median(gen['hf']) / statistics.median(gen['builtin']):.2f}x generation")


if __name__ == "__main__":
    main()
