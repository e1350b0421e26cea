"""Slow tests on the real SmolLM2-135M-Instruct (run by hand: `make test-slow` or `pytest -m slow`)."""

import json

import pytest

from posttrain.models.builtin import real_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (real_model_dir("smollm2-135m-instruct") / "config.json").is_file(),
                       reason="run `posttrain models fetch smollm2-135m-instruct` first"),
]


def test_sft_on_smollm2_lowers_loss_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.config import parse_args
    from posttrain.recipes import sft

    cfg = parse_args(sft.SFTConfig, [
        "model=smollm2-135m-instruct", "data=arithmetic:120", f"output_dir={tmp_path / 'run'}", "max_steps=4",
        "batch_size=2", "micro_batch_size=2", "max_length=256", "optim.lr=3e-5", "optim.warmup_steps=0",
        "eval_every=0", "eval_max_rows=8", "sample_every=4", "save_every=0", "progress=false",
    ])
    summary = sft.train(cfg)
    assert summary["last_loss"] < summary["first_loss"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["measured"]["tokens"] == plan["predicted"]["data_plan"]["tokens"]
    # the planner's peak-memory estimate on a real-size model (RSS growth on CPU; see docs/planner.md)
    ratio = plan["comparison"]["peak_rss_growth_over_predicted"]
    assert 0.75 <= ratio <= 1.25, ratio
