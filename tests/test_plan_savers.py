"""Memory savers in the plan: gradient checkpointing (activations, FLOPs) and LoRA, in plan.json and the report."""

import json

import pytest

from posttrain.models.builtin import tiny_config
from posttrain.plan import arch as archmod
from posttrain.plan import predict
from posttrain.plan.measure import write_plan
from posttrain.plan.report import render


def test_checkpointing_keeps_layer_inputs_and_one_layer():
    # tiny-random (llama): h 64, i 128, L 2, k·d 32, V 1024; fp32, 8 × 128 tokens, the HF loss (3 logit copies)
    h, i, L, kv, V, tokens = 64, 128, 2, 32, 1024, 8 * 128
    layer = 8 * h + 4 * i + 2 * kv  # values one layer keeps per token
    full = predict("tiny-random", "sft", batch=8, seq_len=128, dtype="fp32")
    ckpt = predict("tiny-random", "sft", batch=8, seq_len=128, dtype="fp32", gradient_checkpointing=True)
    assert full["activation_bytes"] == 4 * tokens * (L * layer + 3 * h + 3 * V)
    assert ckpt["activation_bytes"] == 4 * tokens * (L * h + layer + 3 * h + 3 * V)  # inputs kept, one layer recomputed
    assert ckpt["memory_bytes_total"] == full["memory_bytes_total"]  # states do not change


def test_checkpointing_saves_most_on_deep_models():
    a = archmod.load_known("llama-3-8b")
    full = predict("llama-3-8b", "sft", batch=1, seq_len=4096, logit_copies=1)["activation_bytes"]
    ckpt = predict("llama-3-8b", "sft", batch=1, seq_len=4096, logit_copies=1, gradient_checkpointing=True)["activation_bytes"]
    per_layer = 8 * a.hidden + 4 * a.intermediate + 2 * a.kv_heads * a.head_dim
    tail = 3 * a.hidden + a.vocab
    assert full / ckpt == pytest.approx((a.layers * per_layer + tail) / (a.layers * a.hidden + per_layer + tail))
    # 2 B × 4096 tokens × (32 · 92,160 + 140,544) = 25.3 GB → 2 B × 4096 × (32 · 4096 + 92,160 + 140,544) = 2.98 GB
    assert full == pytest.approx(25.3e9, rel=1e-3) and ckpt == pytest.approx(2.98e9, rel=1e-3)


def test_checkpointing_costs_one_more_forward():
    n = archmod.load_known("llama-3-8b").params()
    assert predict("llama-3-8b", "sft", gradient_checkpointing=True)["flops_per_token"] == 8 * n
    assert predict("llama-3-8b", "sft")["flops_per_token"] == 6 * n
    lora = predict("llama-3-8b", "sft", lora_r=16, gradient_checkpointing=True)
    f = lora["lora"]["params"] / (n + lora["lora"]["params"])  # trainable share of the adapted model
    assert lora["flops_per_token"] == pytest.approx((4 + 2 * f + 2) * (n + lora["lora"]["params"]))
    # RL: only the training passes recompute; generation and the reference forward stay at 2
    phases = {p["phase"]: p["flops_per_param"] for p in predict(8e9, "ppo", gradient_checkpointing=True)["phases"]}
    assert phases == {"generate": 2, "reference": 2, "reward": 2, "value": 2, "train": 8, "value_train": 8}


def test_savers_show_in_plan_json_and_the_report(tmp_path):
    p = predict("tiny-random-phi3", "sft", lora_r=8, gradient_checkpointing=True)
    saved = json.loads(write_plan(tmp_path, p).read_text())["predicted"]
    assert saved["gradient_checkpointing"] is True
    assert saved["lora"]["r"] == 8 and saved["lora"]["targets"] == "all-linear"
    assert saved["lora"]["target_names"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    text = render(p)
    assert "LoRA r=8 on all-linear (qkv_proj,o_proj,gate_up_proj,down_proj)" in text
    assert "gradient checkpointing" in text and "8/param/token" not in text  # LoRA: 6 + 2·(trainable share)
    assert "none (full fine-tuning" in render(predict("tiny-random"))


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2", "tiny-random-gemma2", "tiny-random-olmo2",
                                  "llama-3-8b", "gemma-3-1b"])
def test_all_linear_is_every_linear_layer_but_lm_head(name):
    spec_arch = archmod.load_known(name) or archmod.from_config(tiny_config(name, vocab_size=1024))
    p = predict(name, lora_r=4)
    layer = spec_arch.layer_linears(0)
    # r·(in + out) over q, k, v, o, gate, up, down of every layer; nothing for the embeddings or lm_head
    assert p["lora"]["params"] == spec_arch.layers * sum(4 * (i + o) for i, o, _ in layer.values())
    assert p["lora"]["target_names"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
