"""Slow: distillation on the real SmolLM2-135M-Instruct (run by hand, alone on the machine:
`pytest -m slow -s tests/test_slow_distill.py`).

Teacher: the base model trained by `posttrain rl` (GRPO, 40 steps, bf16: the run of docs/rl.md and
tests/test_slow_rl.py) on single-digit addition. Student: the base model. On-policy distillation (GKD,
reverse KL) must reach >= 90% of the teacher's pass@1 in at most 10 optimizer steps, a quarter of GRPO's
40; logit-level (top-k cache) and sequence-level distillation run the same 10 steps for the comparison
printed at the end (steps, wall time, pass@1 with 95% intervals over 81 problems x 8 samples).

POSTTRAIN_DISTILL_TEACHER=DIR reuses the teacher in DIR (a `posttrain rl` final/ folder), or trains it
there on first use.
"""

import os
import time
from pathlib import Path

import pytest

from posttrain.models.builtin import real_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (real_model_dir("smollm2-135m-instruct") / "config.json").is_file(),
                       reason="run `posttrain models fetch smollm2-135m-instruct` first"),
]

BASE = "smollm2-135m-instruct"
GRPO_STEPS = 40
# docs/rl.md: single-digit addition, 4 prompts x 8 samples, <= 24 new tokens, lr 5e-6 linear, beta 0, bf16 update
GRPO_ARGS = [f"model={BASE}", "data=single_digit_add:2000", "reward=math", "reward_args={math: {mode: last_number}}",
             "beta=0", "prompts_per_step=4", "group_size=8", "max_new_tokens=24", "optim.lr=5e-6",
             "optim.schedule=linear", f"max_steps={GRPO_STEPS}", "mixed_precision=bf16", "progress=false"]
STEPS = GRPO_STEPS // 4  # the budget of on-policy distillation: a quarter of GRPO's optimizer steps
# every mode: the same student, 10 steps, lr 2e-5 (constant), bf16 backbone
COMMON = [f"model={BASE}", f"max_steps={STEPS}", "mixed_precision=bf16", "optim.lr=2e-5", "optim.schedule=constant",
          "optim.warmup_ratio=0", "max_new_tokens=24", "progress=false"]
MODES = {
    # the student samples 4 prompts x 8, the teacher scores every sampled position (GKD, reverse KL)
    "on_policy": ["mode=on_policy", "data=single_digit_add:2000", "reward=math", "reward_args={math: {mode: last_number}}",
                  "prompts_per_step=4", "group_size=8", "eval.data=single_digit_add:all", "eval.every=2", "eval.n=4",
                  "eval.reward=math", "eval.reward_args={math: {mode: last_number}}"],
    # fixed sequences (question + correct answer), the teacher's top-64 + tail cached once; 32 sequences a step
    "logit": ["mode=logit", "data=single_digit_add:400", "packing=false", "batch_size=32", "micro_batch_size=32"],
    # the teacher writes 4 answers per problem (no filter), the student does SFT on them; 32 rows a step
    "sequence": ["mode=sequence", "data=single_digit_add:all", "n=4", "batch_size=32", "micro_batch_size=32",
                 "max_length=256"],
}


def pass_at_1(model_path: str, tok, n: int = 8, seed: int = 4242) -> tuple[float, float, float]:
    """pass@1 (mean, 95% clustered Wilson low, high) over the 81 problems x n samples, temperature 1, bf16 engine."""
    import torch

    from posttrain.data.tasks import generate
    from posttrain.eval.hook import evaluate
    from posttrain.models.loading import load_model
    from posttrain.rewards.registry import compose
    from posttrain.rollout.engine import Engine, EngineConfig
    from posttrain.rollout.settings import SamplingSettings

    model = load_model(model_path, dtype=torch.bfloat16).eval()
    engine = Engine(model, tok, EngineConfig(max_num_seqs=128, kv_cache_mb=256))
    reward = compose("math", options={"math": {"mode": "last_number"}})
    out = evaluate(engine, tok, generate("single_digit_add:all"), reward, n=n,
                   sampling=SamplingSettings(temperature=1.0, max_new_tokens=24), seed=seed)
    return out["eval/pass@1"], out["eval/pass@1_low"], out["eval/pass@1_high"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> tuple[str, float | None]:
    """(teacher folder, GRPO training seconds or None when reused)."""
    from posttrain.config import parse_args
    from posttrain.recipes import rl

    where = os.environ.get("POSTTRAIN_DISTILL_TEACHER")
    out = Path(where) if where else tmp_path_factory.mktemp("grpo") / "run"
    final = out / "final" if not (out / "config.json").is_file() else out
    if (final / "config.json").is_file():
        return str(final), None
    t0 = time.perf_counter()
    rl.train(parse_args(rl.RLConfig, [*GRPO_ARGS, f"output_dir={out}"]))
    return str(out / "final"), time.perf_counter() - t0


def test_on_policy_distillation_reaches_the_teacher_in_a_quarter_of_grpos_steps(tmp_path, teacher):
    from posttrain.config import parse_args
    from posttrain.models.loading import load_tokenizer
    from posttrain.recipes import distill

    teacher_dir, grpo_seconds = teacher
    tok = load_tokenizer(BASE)
    scores = {"base (student before)": pass_at_1(BASE, tok), f"teacher (GRPO {GRPO_STEPS} steps)": pass_at_1(teacher_dir, tok)}
    results = {}
    for mode, args in MODES.items():
        out = tmp_path / mode
        t0 = time.perf_counter()
        summary = distill.train(parse_args(distill.DistillConfig, [*COMMON, *args, f"teacher={teacher_dir}",
                                                                   f"output_dir={out}"]))
        seconds = time.perf_counter() - t0
        final = summary.get("final_model", str(out / "final"))
        results[mode] = (seconds, summary)
        scores[f"{mode} ({STEPS} steps)"] = pass_at_1(final, tok)
    base_p, teacher_p = scores["base (student before)"][0], scores[f"teacher (GRPO {GRPO_STEPS} steps)"][0]
    print(f"\npass@1 over 81 problems x 8 samples (95% clustered Wilson); GRPO teacher trained in "
          f"{'n/a (reused)' if grpo_seconds is None else f'{grpo_seconds:.0f} s'}")
    for name, (p, lo, hi) in scores.items():
        print(f"  {name:28s} {p:.3f} [{lo:.3f}, {hi:.3f}]  ({p / teacher_p:.0%} of the teacher)")
    for mode, (seconds, summary) in results.items():
        print(f"  {mode:10s} wall {seconds:.0f} s (teacher + training, in-training evals included); summary {summary}")
    curve = [(r["step"], r["eval/pass@1"]) for r in _rows(tmp_path / "on_policy") if "eval/pass@1" in r]
    print(f"  on_policy held-out pass@1 (n=4) by step: {curve}")
    on_policy = scores[f"on_policy ({STEPS} steps)"][0]
    assert on_policy >= 0.9 * teacher_p, (base_p, teacher_p, on_policy)


def _rows(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
