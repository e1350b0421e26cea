"""A model the planner's families do not cover is counted elsewhere (meta build, checkpoint headers, weight
index, the model object); what still cannot be predicted is a note and an `unknown` entry, never an error."""

import json
import struct

import pytest
import torch

from posttrain.errors import UserError
from posttrain.models.builtin import build_tiny
from posttrain.plan import predict
from posttrain.plan.measure import write_plan
from posttrain.plan.report import render
from posttrain.plan.resolve import resolve_model, safetensors_header

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024, pad_token_id=3, bos_token_id=1, eos_token_id=2)


def _meta_numel(cfg) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())


def test_a_family_transformers_knows_is_counted_on_the_meta_device(capsys):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("phi", **TINY)  # phi-2: dense/fc1/fc2, LayerNorm with biases, lm_head bias
    p = predict(cfg, "grpo", lora_r=4)
    assert p["params"] == _meta_numel(cfg)
    assert not p["model"]["architecture"]["exact"] and p["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # generic reading
    assert any("not a family the planner knows" in n for n in p["notes"])
    assert any("meta device" in n for n in p["notes"])
    # LoRA from the built module's nn.Linear layers (phi's dense, fc1, fc2 too): r·(in + out) each
    lin = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (128, 64)]  # q, k, v, dense, fc1, fc2
    assert p["lora"]["params"] == 2 * 4 * sum(i + o for i, o in lin)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("posttrain plan: warning:")  # one line, not a traceback


def _write_safetensors(path, shapes: dict, truncate: bool = False):
    """A safetensors file with these tensor shapes (fp16 zeros); `truncate` leaves the data out: only a
    reader of the header alone can get the shapes from it."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * int(torch.tensor(shape).prod())
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + (b"" if truncate else b"\0" * offset))


def test_an_unknown_type_is_counted_from_the_safetensors_headers_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_decoder", **TINY, "torch_dtype": "float16"}))
    shapes = {"embed_tokens.weight": (1024, 64), "layers.0.attn.wqkv.weight": (128, 64), "layers.0.mlp.w_in.weight": (256, 64),
              "layers.0.mlp.w_out.weight": (64, 128), "layers.0.norm.weight": (64,), "lm_head.weight": (1024, 64)}
    _write_safetensors(tmp_path / "model-00001-of-00002.safetensors", dict(list(shapes.items())[:3]), truncate=True)
    _write_safetensors(tmp_path / "model-00002-of-00002.safetensors", dict(list(shapes.items())[3:]), truncate=True)
    assert set(safetensors_header(tmp_path / "model-00001-of-00002.safetensors")) == set(list(shapes)[:3])
    p = predict(str(tmp_path), "sft", lora_r=2)
    assert p["params"] == sum(int(torch.tensor(s).prod()) for s in shapes.values())
    assert any("safetensors headers" in n for n in p["notes"])
    # LoRA candidates: the 2-D weights but embeddings and lm_head
    assert p["lora"]["params"] == 2 * ((64 + 128) + (64 + 256) + (128 + 64))
    assert p["kv_bytes_per_token"] is not None  # the config's usual keys still give the KV cache (approximate)


def test_an_unknown_type_with_only_a_weight_index_uses_total_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_decoder", **TINY, "torch_dtype": "bfloat16"}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2 * 300_000},
                                                                        "weight_map": {}}))
    p = predict(str(tmp_path))
    assert p["params"] == 300_000  # bytes / 2 for bf16
    assert any("total_size" in n for n in p["notes"])


def test_a_config_without_numbers_is_a_plan_of_unknowns_not_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_state_space_model", "d_state": 16}))
    p = predict(str(tmp_path), "grpo", hardware="h100", steps=10)
    assert p["params"] is None and p["memory_bytes_total"] is None and p["seconds_per_step"] is None
    assert p["tokens_per_step"] == 8 * 8 * 512  # the shape of a step needs no model
    assert {"params", "memory_bytes_total", "flops_per_step", "kv_bytes_per_token"} <= set(p["unknown"])
    assert any("parameters unknown" in n for n in p["notes"])
    assert "not predicted" in render(p) and json.dumps(p)
    path = write_plan(tmp_path / "run", p)
    assert json.loads(path.read_text())["predicted"]["notes"] == p["notes"]


def test_the_model_object_is_counted_exactly():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny("tiny-random-olmo2"), LoraConfig(r=4, target_modules="all-linear"))
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    p = predict(model, "sft", lora_r=4)
    assert p["params"] == base and p["model"]["source"] == "model"
    assert p["lora"]["params"] == sum(x.numel() for x in model.parameters() if x.requires_grad)
    assert p["notes"] == []


def test_a_failing_prediction_becomes_notes(monkeypatch, capsys):
    import importlib

    predict_mod = importlib.import_module("posttrain.plan.predict")

    def broken(*a, **k):
        raise ZeroDivisionError("a bug in the planner")

    monkeypatch.setattr(predict_mod, "_phases", broken)
    p = predict("tiny-random", "sft")
    assert p["flops_per_step"] is None and "ZeroDivisionError" in p["notes"][0] and p["unknown"]
    assert p["tokens_per_step"] == 8 * 512  # the step's shape needs no model and is kept
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(UserError, match="batch"):  # wrong input is still an error
        predict("tiny-random", "sft", batch=0)


def test_a_hub_id_is_read_from_the_hf_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    snap = tmp_path / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text(json.dumps({"model_type": "qwen3", **TINY, "head_dim": 16}))
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    spec = resolve_model("acme/tiny")
    assert spec.source == "Hugging Face cache" and spec.arch.model_type == "qwen3" and spec.params > 0
    with pytest.raises(UserError, match="not in the Hugging Face cache"):
        resolve_model("acme/missing")


def test_an_adapter_folder_is_planned_as_its_base(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "qwen2.5-0.5b", "r": 8}))
    p = predict(str(tmp_path))
    assert p["params"] == 494_032_768 and any("PEFT adapter" in n for n in p["notes"])
