"""The planner reads every decoder family it knows exactly: parameter counts (total and active) equal the
transformers model built on the meta device, LoRA sizes equal PEFT's, layer types equal the config class's."""

import json

import pytest
import torch

from posttrain.models.builtin import TINY_CONFIGS, tiny_config
from posttrain.plan import arch as archmod
from posttrain.plan import predict

# The tiny shape of models.builtin, with token ids inside a 1024 vocabulary (some config classes check them).
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024, pad_token_id=3, bos_token_id=1, eos_token_id=2)

# Families beyond the built-in tiny models, each with its distinctive switches on.
EXTRA = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96,
                      decoder_sparse_step=2, num_hidden_layers=4),  # layers 1 and 3 sparse, 0 and 2 dense
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, mlp_only_layers=[0]),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gemma": dict(head_dim=16),
    "granite": dict(attention_bias=True, mlp_bias=True),
    "olmo": dict(),
    "starcoder2": dict(tie_word_embeddings=False),
    "smollm3": dict(attention_bias=True),
    "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
}


def _config(name: str):
    from transformers import AutoConfig

    if name in TINY_CONFIGS:
        return tiny_config(name, vocab_size=1024)
    return AutoConfig.for_model(name, **{**BASE, **EXTRA[name]})


def _meta_model(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are one Parameter, counted once


ALL = [*TINY_CONFIGS, *EXTRA]


@pytest.mark.parametrize("name", ALL)
def test_params_equal_the_transformers_model(name):
    cfg = _config(name)
    a = archmod.from_config(cfg, name)
    assert a.exact
    assert a.params() == _numel(_meta_model(cfg))
    # the config.json form (a dict, as read from a folder) gives the same numbers as the config object
    assert archmod.from_config(json.loads(cfg.to_json_string()), name).params() == a.params()
    p = predict(cfg)
    assert p["params"] == a.params() and p["notes"] == [] and p["model"]["architecture"]["exact"]


def _expert_numel(model) -> tuple[int, int]:
    """(parameters of all routed experts, of one expert in one layer) in the built model."""
    total = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    layers = {n.split(".experts.")[0] for n, _ in model.named_parameters() if ".experts." in n}
    return total, total // len(layers)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_moe_active_params_run_k_of_e_experts(name):
    cfg = _config(name)
    model = _meta_model(cfg)
    experts_total, per_layer = _expert_numel(model)
    E, K = cfg.num_experts if hasattr(cfg, "num_experts") else cfg.num_local_experts, cfg.num_experts_per_tok
    a = archmod.from_config(cfg, name)
    # one token runs K of the E experts of each MoE layer: the idle (E − K)/E of every layer's experts drop out
    assert a.active_params() == _numel(model) - experts_total * (E - K) // E
    assert a.moe.to_dict()["moe_layers"] == len({n.split(".experts.")[0] for n, _ in model.named_parameters() if ".experts." in n})
    p = predict(cfg, "sft", batch=1, seq_len=8)
    assert p["active_params"] == a.active_params() < p["params"]
    assert p["flops_per_token"] == 6 * a.active_params()  # FLOPs count the active parameters, memory all of them
    assert p["memory_bytes_total"] == 16 * p["params"]


def test_qwen2_moe_dense_and_sparse_layers_follow_the_sparse_step():
    a = archmod.from_config(_config("qwen2_moe"))
    assert a.moe.sparse == (False, True, False, True)  # (layer + 1) % decoder_sparse_step == 0
    assert archmod.from_config(_config("qwen3_moe")).moe.sparse == (False, True)  # mlp_only_layers=[0]


@pytest.mark.parametrize("name", ALL)
def test_layer_types_equal_the_config_class(name):
    from transformers import AutoConfig

    d = json.loads(_config(name).to_json_string())
    d.pop("layer_types", None)  # a config.json written before layer_types existed: the family's rule derives them
    rebuilt = AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    expected = tuple(getattr(rebuilt, "layer_types", None) or ())
    window = getattr(rebuilt, "sliding_window", None)  # mistral, phi3, starcoder2 list no types: all layers slide
    sliding = sum(t == "sliding_attention" for t in expected) if expected else (rebuilt.num_hidden_layers if window else 0)
    a = archmod.from_config(d, name)
    assert a.sliding_layers() == sliding, (a.layer_types, expected)
    assert archmod.from_config(rebuilt, name).sliding_layers() == sliding


def test_sliding_layers_hold_at_most_the_window():
    a = archmod.from_config(_config("tiny-random-gemma3"))  # layer 0 slides over 16 tokens, layer 1 is global
    per_layer_token = 2 * a.kv_heads * a.head_dim * 2
    assert a.kv_bytes_per_sequence(10) == 2 * 10 * per_layer_token  # shorter than the window: every layer holds it all
    assert a.kv_bytes_per_sequence(100) == (100 + 16) * per_layer_token
    p = predict("tiny-random-gemma3", "grpo", batch=2, group=4, seq_len=90, prompt_len=10)
    assert p["kv_bytes_step"] == 8 * (100 + 16) * per_layer_token
    m = predict("tiny-random-mistral", "grpo", batch=1, group=1, seq_len=100)  # mistral: every layer slides
    assert m["kv_bytes_step"] == 2 * 16 * per_layer_token


def _peft_trainable(model, targets) -> int:
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    return sum(p.numel() for p in peft.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("mixtral", "qwen3_moe", "olmoe")])
def test_lora_all_linear_equals_peft(name):
    # Every nn.Linear but lm_head. (mixtral, qwen3_moe, olmoe: PEFT's MoE conversion also adapts the 3-D expert
    # parameters and the router, which are not linear layers; the plan says so in its notes.)
    cfg = _config(name)
    assert predict(cfg, lora_r=8)["lora"]["params"] == _peft_trainable(_meta_model(cfg), "all-linear")


def test_lora_on_fused_projections_uses_phi3_names():
    cfg = _config("tiny-random-phi3")
    p = predict(cfg, lora_r=8, lora_targets="qkv_proj,down_proj")
    assert p["lora"]["params"] == _peft_trainable(_meta_model(cfg), ["qkv_proj", "down_proj"])
    # qkv_proj: 64 → (4 + 2·2)·16 = 128 and down_proj 128 → 64: r·(in + out) each, in both layers
    assert p["lora"]["params"] == 2 * 8 * ((64 + 128) + (128 + 64))
    assert predict(cfg, lora_r=8)["lora"]["target_names"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    from posttrain.errors import UserError

    with pytest.raises(UserError, match="qkv_proj"):  # the unfused names match nothing: the error names the fused ones
        predict(cfg, lora_r=8, lora_targets="q_proj,v_proj")


def test_lora_names_a_target_that_matches_nothing_and_counts_the_rest():
    p = predict("tiny-random", lora_r=8, lora_targets="q_proj,nope")
    assert p["lora"]["params"] == archmod.from_config(_config("tiny-random")).lora_params(8, ("q_proj",))
    assert any("nope" in n for n in p["notes"])


def test_lora_on_moe_counts_linear_layers_and_says_so():
    cfg = _config("qwen2_moe")
    p = predict(cfg, lora_r=8)
    assert "mlp.shared_expert.gate_proj" in {path.split(".", 2)[2] for path, _, _ in archmod.from_config(cfg).linears()}
    assert any("mixture of experts" in n for n in p["notes"])


def test_committed_architectures_include_gemma3_and_qwen3():
    # published totals: Gemma 3 1B 999,885,952 (tied, 262,144 vocabulary); Qwen3-0.6B 596,049,920 (tied)
    g = archmod.load_known("gemma-3-1b")
    assert g.params() == 999_885_952
    assert (g.hidden, g.layers, g.heads, g.kv_heads, g.head_dim, g.intermediate, g.sliding_window) == (1152, 26, 4, 1, 256, 6912, 512)
    assert g.layer_types.count("full_attention") == 4 and g.sliding_layers() == 22  # every 6th layer is global
    q = archmod.load_known("Qwen3-0.6B")
    assert q.params() == 596_049_920
    assert (q.hidden, q.layers, q.heads, q.kv_heads, q.head_dim, q.qk_norm) == (1024, 28, 16, 8, 128, "head")


def test_multimodal_config_plans_the_decoder_and_counts_the_whole_model():
    from transformers import AutoConfig

    text = {k: v for k, v in BASE.items() if "token" not in k}
    cfg = AutoConfig.for_model("gemma3", text_config={**text, "head_dim": 16},
                               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=28, patch_size=14))
    full = _numel(_meta_model(cfg))
    p = predict(cfg)
    decoder = archmod.from_config(cfg.text_config.to_dict())
    assert p["params"] == full > decoder.params()  # in memory: the vision tower too
    assert p["active_params"] == decoder.params()  # per text token: the decoder
    assert p["model"]["architecture"]["model_type"] == "gemma3_text"
    assert any("multimodal" in n for n in p["notes"])
