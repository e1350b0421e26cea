"""Planner architecture arithmetic: parameter counts equal the transformers models, KV and LoRA sizes."""

import json

import pytest
import torch

from posttrain.plan import arch as archmod
from posttrain.plan import predict

COMMITTED = sorted(archmod.known_architectures())


def test_the_issue_architectures_are_committed():
    assert {"llama-3-8b", "llama-3-70b", "qwen2.5-0.5b", "qwen2.5-7b", "smollm2-135m"} <= set(COMMITTED)


def _meta_count(cfg_dict: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(cfg_dict)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights are one Parameter, counted once


@pytest.mark.parametrize("name", COMMITTED)
def test_params_equal_transformers_on_meta(name):
    cfg = json.loads(archmod.known_architectures()[name].read_text())
    assert archmod.load_known(name).params() == _meta_count(cfg)


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2"])
def test_builtin_tiny_params_equal_the_built_model(name):
    from posttrain.models.builtin import build_tiny

    model = build_tiny(name)
    assert predict(name)["params"] == sum(p.numel() for p in model.parameters())


def test_published_sizes_and_config_numbers():
    # The published parameter counts of these checkpoints.
    expected = {"llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "qwen2.5-0.5b": 494_032_768,
                "qwen2.5-7b": 7_615_616_512, "smollm2-135m": 134_515_008}
    for name, n in expected.items():
        assert archmod.load_known(name).params() == n, name
    q = archmod.load_known("qwen2.5-0.5b")
    assert (q.hidden, q.layers, q.heads, q.kv_heads, q.intermediate, q.vocab, q.tied, q.qkv_bias, q.o_bias) == \
        (896, 24, 14, 2, 4864, 151936, True, True, False)
    s = archmod.load_known("SmolLM2-135M")
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, s.vocab, s.tied) == (576, 30, 9, 3, 1536, 49152, True)
    ll = archmod.load_known("Meta-Llama-3-8B")
    assert (ll.hidden, ll.layers, ll.heads, ll.kv_heads, ll.intermediate, ll.vocab, ll.tied) == (4096, 32, 32, 8, 14336, 128256, False)


def test_qwen2_qkv_biases_are_counted():
    q = archmod.load_known("qwen2.5-0.5b")
    no_bias = archmod.Arch(**{**q.__dict__, "qkv_bias": False})
    # q bias a·d + k and v biases k·d each, in every layer
    assert q.params() - no_bias.params() == q.layers * (q.heads * q.head_dim + 2 * q.kv_heads * q.head_dim)


def test_qwen3_and_biases_match_transformers():
    cfg = dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, vocab_size=300, tie_word_embeddings=False, attention_bias=True)
    assert archmod.from_config(cfg).params() == _meta_count(cfg)
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=300, attention_bias=True, mlp_bias=True)
    assert archmod.from_config(cfg).params() == _meta_count(cfg)


def test_kv_bytes_per_token_llama3_8b_is_128_kib():
    # 2 (K and V) × 32 layers × 8 KV heads × 128 head dim × 2 bytes
    assert archmod.load_known("llama-3-8b").kv_bytes_per_token(2) == 128 * 1024
    assert predict("llama-3-8b")["kv_bytes_per_token"] == 128 * 1024


def test_lora_params_equal_peft_on_a_tiny_model():
    from peft import LoraConfig, get_peft_model

    from posttrain.models.builtin import build_tiny

    for name in ("tiny-random", "tiny-random-qwen2"):
        model = get_peft_model(build_tiny(name), LoraConfig(r=8, target_modules="all-linear"))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert predict(name, lora_r=8)["lora"]["params"] == trainable


def test_lora_fraction_qwen_0_5b_spec_values():
    # docs/planner.md (LoRA): r=16 all-linear on Qwen2.5-0.5B ≈ 1.78% trainable; r=64 ≈ 7.12% (of the base's parameters).
    assert predict("qwen2.5-0.5b", lora_r=16)["lora"]["fraction_of_base"] == pytest.approx(0.0178, rel=0.01)
    assert predict("qwen2.5-0.5b", lora_r=64)["lora"]["fraction_of_base"] == pytest.approx(0.0712, rel=0.01)


def test_lora_subset_of_targets():
    q = archmod.load_known("qwen2.5-0.5b")
    # q_proj 896→896 and v_proj 896→128: r·(in + out) each, per layer
    assert q.lora_params(8, ("q_proj", "v_proj")) == 24 * 8 * ((896 + 896) + (896 + 128))


def test_parse_count():
    assert archmod.parse_count("8e9") == 8e9
    assert archmod.parse_count("8B") == 8e9
    assert archmod.parse_count("135m") == 135e6
    assert archmod.parse_count("70000000000.0") == 7e10
    assert archmod.parse_count("llama") is None
