"""`posttrain plan` through the CLI router, the Python API's inputs, and the errors for impossible inputs."""

import json

import pytest

from posttrain.cli import main as cli_main
from posttrain.errors import UserError
from posttrain.plan import predict
from posttrain.plan.config import PlanConfig

REQUIRED = {"params", "models", "memory_bytes_total", "kv_bytes_per_token", "tokens_per_step", "flops_per_token",
            "flops_per_step", "seconds_per_step"}


def run_json(capsys, *args):
    assert cli_main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_has_the_contract_keys(capsys):
    p = run_json(capsys, "model=8e9", "method=ppo", "hardware=h100")
    assert REQUIRED <= set(p)
    assert p["memory_bytes_total"] == pytest.approx(288e9)
    assert p["seconds_per_step"] > 0
    for m in p["models"]:
        assert {"role", "params", "bytes", "trainable"} <= set(m)
    assert json.dumps(p)  # plain JSON types only


def test_cli_json_equals_predict(capsys):
    p = run_json(capsys, "model=llama-3-8b", "method=grpo", "batch=256", "group=16", "seq_len=2000", "peak_flops=989e12")
    assert p == json.loads(json.dumps(predict("llama-3-8b", "grpo", batch=256, group=16, seq_len=2000, peak_flops=989e12)))
    assert p["seconds_per_step"] == pytest.approx(p["flops_per_step"] / (989e12 * 0.4))


def test_cli_table_is_readable(capsys):
    assert cli_main(["plan", "model=llama-3-8b", "method=agent", "turns=10", "seq_len=400", "return_len=3000"]) == 0
    out = capsys.readouterr().out
    assert "models in memory" in out and "31,000 tokens per trajectory" in out and "7.75×" in out
    assert "128.00 KiB" in out  # KV per token


def test_cli_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--help"])
    out = capsys.readouterr().out
    for key, field in PlanConfig.model_fields.items():
        assert key in out and field.description, key


def test_parameter_count_spellings(capsys):
    for spelling in ("8e9", "8B", "8000000000", "8.0e9"):
        assert run_json(capsys, f"model={spelling}")["params"] == 8_000_000_000
    assert predict(8e9)["params"] == predict(8_000_000_000)["params"] == predict("8b")["params"]


def test_model_as_config_dict_object_and_folder(tmp_path):
    from transformers import AutoConfig

    from posttrain.plan.arch import known_architectures

    d = json.loads(known_architectures()["qwen2.5-0.5b"].read_text())
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    n = 494_032_768
    assert predict(cfg)["params"] == n
    assert predict(cfg.to_dict())["params"] == n
    assert predict(str(tmp_path))["params"] == n
    assert predict("qwen2.5-0.5b", "ppo", reward_model=cfg)["models"][-1]["params"] == n


def test_builtin_names():
    assert predict("tiny-random")["model"]["source"] == "built-in"
    # the fetched folder when present, else the committed SmolLM2-135M architecture: same numbers
    assert predict("smollm2-135m-instruct")["params"] == 134_515_008


@pytest.mark.parametrize("keys,named", [
    ({"batch": -1}, "batch"),
    ({"seq_len": 0}, "seq_len"),
    ({"method": "grpo", "group": 0}, "group"),
    ({"method": "foo"}, "method"),
    ({"mfu": 0}, "mfu"),
    ({"mfu": 1.5}, "mfu"),
    ({"model": "-8e9"}, "model"),
    ({"model": "no-such-model"}, "model"),
    ({"model": 8e9, "lora_r": 16}, "lora_r"),
    ({"lora_r": 8, "lora_targets": "nope,neither"}, "lora_targets"),  # one that matches is enough, as in PEFT
    ({"method": "grpo", "reward": "oracle"}, "reward"),
    ({"method": "sft", "reward": "verifier"}, "reward"),
    ({"method": "sft", "group": 4}, "group"),
    ({"method": "sft", "teacher": "8e9"}, "teacher"),
    ({"method": "grpo", "beta": -0.1}, "beta"),
    ({"method": "ppo", "value_model": False}, "value_model"),
    ({"method": "sft", "turns": 3}, "turns"),
    ({"hardware": "tpu9"}, "hardware"),
    ({"dtype": "fp13"}, "dtype"),
    ({"tokens": 1e9, "steps": 10}, "tokens"),
    ({"eval_n": -1}, "eval_n"),
    ({"nonsense_key": 1}, "nonsense_key"),
])
def test_impossible_inputs_raise_user_error_naming_the_key(keys, named):
    keys = dict(keys)
    model = keys.pop("model", "tiny-random")
    with pytest.raises(UserError, match=named):
        predict(model, **keys)


def test_folder_without_config_json(tmp_path):
    with pytest.raises(UserError, match="model.*no config.json"):
        predict(str(tmp_path))


def test_cli_errors_exit_2_with_the_key(capsys, tmp_path):
    assert cli_main(["plan", "method=grpo", "group=0"]) == 2
    assert "group" in capsys.readouterr().err
    assert cli_main(["plan", f"model={tmp_path}"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert cli_main(["plan", "mfu=2"]) == 2
    assert "mfu" in capsys.readouterr().err
    assert cli_main(["plan", "methd=sft"]) == 2
    assert "did you mean 'method'" in capsys.readouterr().err
