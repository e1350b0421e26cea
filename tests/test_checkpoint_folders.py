"""Every checkpoints/step-N/ is a model folder users load with `from_pretrained` (config, weights, tokenizer;
a PEFT adapter under LoRA; a *ForSequenceClassification folder for a reward model) beside the resume state.
Full fine-tuning stores the weights once: resume reads them from the folder's model.safetensors
(tests/test_resume.py: a killed run resumes to the uninterrupted one)."""

import json

import pytest
import torch

import test_rl_recipe  # noqa: F401  registers the `space_share` reward run_rl uses
from conftest import run_rl, write_jsonl
from posttrain.config import parse_args
from preference_synthetic import rule_pairs

RESUME_FILES = ("optimizer.pt", "scheduler.pt", "rng.pt", "state.json")
IDS = torch.tensor([[1, 622, 202, 75, 76, 289, 75, 280, 72, 2, 202, 1, 573, 441, 202]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def check_causal_lm(out, steps):
    """Each step-N loads with AutoModelForCausalLM + AutoTokenizer; the last equals final/; steps differ."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = logits(AutoModelForCausalLM.from_pretrained(out / "final").eval())
    seen = []
    for n in steps:
        step = out / "checkpoints" / f"step-{n}"
        for name in RESUME_FILES:
            assert (step / name).is_file(), (step, name)
        tok = AutoTokenizer.from_pretrained(step)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        seen.append(logits(AutoModelForCausalLM.from_pretrained(step).eval()))
    torch.testing.assert_close(seen[-1], final, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(seen[0], seen[-1])  # another step's weights, not a copy of the last


def test_sft_checkpoints_are_model_folders_with_the_weights_stored_once(tmp_path):
    from posttrain.recipes import sft

    out = tmp_path / "sft"
    cfg = parse_args(sft.SFTConfig, ["model=tiny-random", "data=arithmetic:24", f"output_dir={out}", "max_steps=4",
                                     "save_every=2", "batch_size=4", "max_length=128", "optim.lr=3e-3", "sample_every=0",
                                     "forgetting_probe=false", "eval_every=0", "progress=false"])
    sft.train(cfg)
    check_causal_lm(out, [2, 4])
    step = out / "checkpoints" / "step-4"
    assert (step / "model.safetensors").is_file() and (step / "config.json").is_file()
    assert not (step / "weights.safetensors").exists()  # resume reads model.safetensors: no second copy


def test_rl_checkpoints_full_and_lora(tmp_path):
    from posttrain.models.builtin import build_tiny
    from posttrain.models.loading import load_tokenizer

    _, out = run_rl(tmp_path, "max_steps=2", "save_every=1", "keep_checkpoints=2", name="full")
    check_causal_lm(out, [1, 2])

    base = tmp_path / "base"  # a base model folder: the adapter's base_model_name_or_path
    build_tiny("tiny-random", seed=0).save_pretrained(base)
    load_tokenizer("tiny-random").save_pretrained(base)
    _, out = run_rl(tmp_path, f"model={base}", "lora.enabled=true", "lora.r=4", "optim.lr=5e-2", "max_steps=2",
                    "save_every=1", name="lora")
    for n in (1, 2):
        step = out / "checkpoints" / f"step-{n}"
        assert (step / "adapter_config.json").is_file() and (step / "adapter_model.safetensors").is_file()
        assert not (step / "model.safetensors").exists()  # the adapter, not a merged copy of the model
        assert json.loads((step / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    check_causal_lm(out, [1, 2])  # transformers loads the base, then the adapter
    from peft import AutoPeftModelForCausalLM

    peft_model = AutoPeftModelForCausalLM.from_pretrained(out / "checkpoints" / "step-2").eval()
    from transformers import AutoModelForCausalLM

    torch.testing.assert_close(logits(peft_model), logits(AutoModelForCausalLM.from_pretrained(out / "final").eval()),
                               atol=1e-5, rtol=1e-5)


def test_rm_checkpoints_are_sequence_classifiers(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from posttrain.recipes import rm

    out = tmp_path / "rm"
    data = write_jsonl(tmp_path / "pairs.jsonl", rule_pairs(24))
    cfg = parse_args(rm.RMConfig, ["model=tiny-random", f"data={data}", f"output_dir={out}", "max_steps=4", "save_every=2",
                                   "batch_size=4", "optim.lr=3e-3", "eval_fraction=0.25", "eval_every=0", "progress=false"])
    rm.train(cfg)
    scores = []
    for where in ("checkpoints/step-2", "checkpoints/step-4", "final"):
        model = AutoModelForSequenceClassification.from_pretrained(out / where).eval()
        assert model.config.num_labels == 1 and model.config.pad_token_id is not None
        with torch.no_grad():
            scores.append(model(input_ids=IDS).logits[0, 0])
    assert scores[1] == pytest.approx(float(scores[2]), abs=1e-5) and scores[0] != pytest.approx(float(scores[2]), abs=1e-5)
