"""A recipe's plan never stops its run: a family the planner knows is planned exactly, one it does not is
planned from the model's own parameters with notes in plan.json, and the run trains either way."""

import json

import torch

from conftest import conv, write_jsonl
from posttrain.config import parse_args
from posttrain.models.builtin import build_tiny
from posttrain.recipes import sft


def _sft(tmp_path, model: str, *overrides):
    data = write_jsonl(tmp_path / "add.jsonl", [conv(f"{a}+{b}?", f"{a + b}") for a in range(8) for b in range(3)])
    cfg = parse_args(sft.SFTConfig, [
        f"model={model}", f"data={data}", f"output_dir={tmp_path / 'run'}", "max_steps=2", "batch_size=2",
        "micro_batch_size=2", "max_length=64", "eval_every=0", "sample_every=0", "save_every=0",
        "forgetting_probe=false", "progress=false", *overrides,
    ])
    summary = sft.train(cfg)
    return summary, json.loads((tmp_path / "run" / "plan.json").read_text())


def test_sft_on_gemma3_is_planned_exactly(tmp_path):
    # Before the planner read gemma3_text, `posttrain sft` stopped here ("give a parameter count instead").
    summary, plan = _sft(tmp_path, "tiny-random-gemma3")
    pred = plan["predicted"]
    assert pred["params"] == sum(p.numel() for p in build_tiny("tiny-random-gemma3").parameters())
    assert pred["notes"] == [] and pred["model"]["architecture"]["sliding_layers"] == 1
    assert plan["measured"]["steps"] == 2 and summary["last_loss"] > 0


def test_sft_on_a_family_the_planner_does_not_know_goes_on(tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.loading import load_tokenizer

    folder = tmp_path / "tiny-phi"
    cfg = AutoConfig.for_model("phi", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1024, pad_token_id=3, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    load_tokenizer("tiny-random").save_pretrained(folder)
    summary, plan = _sft(tmp_path, str(folder))
    pred = plan["predicted"]
    assert pred["params"] == sum(p.numel() for p in model.parameters())  # counted, not guessed
    assert any("not a family the planner knows" in n for n in pred["notes"])
    assert "posttrain plan: warning:" in capsys.readouterr().err
    assert plan["measured"]["steps"] == 2 and summary["last_loss"] > 0
