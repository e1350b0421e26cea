"""Slow: `posttrain eval` on the real SmolLM2-135M-Instruct (run by hand: `pytest -m slow -s tests/test_slow_eval.py`).

- single-digit addition, 81 problems x 8 samples: pass@1 near 0.2 with its interval;
- two seeds of the same model: `eval compare` finds no significant difference;
- the base model against a GRPO checkpoint trained here (the run of tests/test_slow_rl.py): p < 0.01;
- throughput: `posttrain eval` (generation + verification overlapped) within 10 % of `posttrain generate`
  on the same prompts, same samples (sides alternate in one process, best of 2 each: the machine drifts).
"""

import json
import re

import pytest

from posttrain.models.builtin import real_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (real_model_dir("smollm2-135m-instruct") / "config.json").is_file(),
                       reason="run `posttrain models fetch smollm2-135m-instruct` first"),
]

EVAL = ["data=single_digit_add:all", "n=8", "k=1,2,4,8", "reward=math", "reward_args={math: {mode: last_number}}",
        "max_new_tokens=24", "temperature=1.0"]
ALPHA = 0.05


def evaluate(out, model="smollm2-135m-instruct", *extra):
    from posttrain.config import parse_args
    from posttrain.eval.cli import print_summary, run_eval
    from posttrain.eval.config import EvalConfig

    cfg = parse_args(EvalConfig, [f"model={model}", f"output_dir={out}", *EVAL, *extra])
    doc = run_eval(cfg)
    print_summary(doc, str(out))
    return doc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    return {"dir": tmp, "seed0": evaluate(tmp / "seed0"), "seed1": evaluate(tmp / "seed1", "smollm2-135m-instruct", "seed=1")}


def test_base_pass_at_1_with_interval(runs):
    m = runs["seed0"]["metrics"]["pass@1"]
    print(f"\npass@1 = {m['value']:.3f} [{m['low']:.3f}, {m['high']:.3f}] ({m['interval']})")
    assert 0.08 <= m["value"] <= 0.35  # the "about 0.2" (0.157 measured in the RL issue)
    assert m["low"] < m["value"] < m["high"] and m["high"] - m["low"] < 0.25
    assert runs["seed0"]["counts"]["reward_errors"] == 0 and runs["seed0"]["counts"]["refused"] == 0


def test_two_seeds_are_not_significantly_different(runs, capsys):
    from posttrain.eval.compare import compare, load_results, print_comparison

    r = compare(load_results(runs["dir"] / "seed0"), load_results(runs["dir"] / "seed1"))
    with capsys.disabled():
        print()
        print_comparison(r)
    assert r["a"]["value"] != r["b"]["value"] or r["mcnemar"]["b"] + r["mcnemar"]["c"] > 0  # really different samples
    assert not r["significant"] and r["bootstrap"]["p_value"] >= ALPHA and r["mcnemar"]["p_value"] >= ALPHA
    assert r["bootstrap"]["low"] < 0 < r["bootstrap"]["high"]


def test_grpo_checkpoint_is_significantly_better(runs, capsys):
    from posttrain.config import parse_args
    from posttrain.eval.compare import compare, load_results, print_comparison
    from posttrain.recipes import rl
    from test_slow_rl import ARGS

    run_dir = runs["dir"] / "grpo"
    rl.train(parse_args(rl.RLConfig, [*ARGS, "mixed_precision=bf16", "max_steps=40", f"output_dir={run_dir}"]))
    evaluate(runs["dir"] / "trained", str(run_dir / "final"))
    r = compare(load_results(runs["dir"] / "seed0"), load_results(runs["dir"] / "trained"), allow_protocol_diff=False)
    with capsys.disabled():
        print()
        print_comparison(r)
    assert r["b"]["value"] > r["a"]["value"]
    assert r["bootstrap"]["p_value"] < 0.01 and r["mcnemar"]["p_value"] < 0.01 and r["significant"]


def test_eval_throughput_is_within_10_percent_of_generate(runs, capsys):
    from posttrain.data.tasks import generate
    from posttrain.rollout.cli import main as generate_main

    tmp = runs["dir"]
    with open(tmp / "prompts.jsonl", "w") as f:
        for row in generate("single_digit_add:all"):
            f.write(json.dumps({"prompt": row["prompt"]}) + "\n")
    gen_rates, eval_rates, gen_tokens, eval_tokens = [], [], set(), set()
    for rep in range(2):
        capsys.readouterr()
        generate_main(["model=smollm2-135m-instruct", f"data={tmp / 'prompts.jsonl'}", "n=8", "max_new_tokens=24",
                       "temperature=1.0", f"output={tmp / 'samples.jsonl'}"])
        line = capsys.readouterr().out
        tokens, rate = re.search(r"(\d+) tokens in [\d.]+ s = ([\d.]+) tokens/s", line).groups()
        gen_tokens.add(int(tokens))
        gen_rates.append(float(rate))
        with capsys.disabled():
            doc = evaluate(tmp / f"speed{rep}")
        eval_tokens.add(doc["timing"]["generated_tokens"])
        eval_rates.append(doc["timing"]["tokens_per_s"])
    with capsys.disabled():
        print(f"\ngenerate {gen_rates} tokens/s, eval (generation + verification) {eval_rates} tokens/s; "
              f"best eval / best generate = {max(eval_rates) / max(gen_rates):.3f}")
    assert gen_tokens == eval_tokens and len(gen_tokens) == 1  # the same prompts, seeds and samples on both sides
    assert max(eval_rates) >= 0.9 * max(gen_rates)
