import pytest

from posttrain.cli import main as cli
from posttrain.config import ConfigError, parse_args
from posttrain.recipes.sft import SFTConfig


def test_overrides_and_dotted_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_steps: 7\noptim:\n  lr: 0.5\nlora:\n  r: 4\n")
    cfg = parse_args(SFTConfig, ["--config", str(f), "optim.lr=2e-4", "lora.enabled=true", "max_length=64"])
    assert cfg.max_steps == 7 and cfg.optim.lr == 2e-4 and cfg.lora.r == 4 and cfg.lora.enabled and cfg.max_length == 64


@pytest.mark.parametrize("arg,hint", [("max_step=3", "max_steps"), ("optim.lrr=1", "optim.lr"), ("learning_rate=1e-4", "optim.lr")])
def test_unknown_key_suggests_nearest(arg, hint):
    with pytest.raises(ConfigError, match=f"did you mean '{hint}'"):
        parse_args(SFTConfig, [arg])


def test_unknown_key_in_yaml_names_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown key 'optim.learning_rate'"):
        parse_args(SFTConfig, ["--config", str(f)])


def test_bad_value_is_readable():
    with pytest.raises(ConfigError, match=r"max_steps: .*got 'many'"):
        parse_args(SFTConfig, ["max_steps=many"])


def test_help_lists_every_key_with_default(capsys):
    with pytest.raises(SystemExit):
        parse_args(SFTConfig, ["--help"])
    text = capsys.readouterr().out
    for key in ["model", "data", "output_dir", "max_steps", "seed", "resume", "optim.lr", "lora.r", "packing"]:
        assert f"  {key} (" in text
    assert "= 1e-05" in text


def test_cli_errors_exit_2(capsys):
    assert cli(["sft", "max_stepz=1"]) == 2
    assert "did you mean 'max_steps'" in capsys.readouterr().err
    assert cli(["sfft"]) == 2
    assert cli(["--help"]) == 0


def test_methods_prints_table_and_registries(capsys):
    assert cli(["methods"]) == 0
    out = capsys.readouterr().out
    assert "grpo" in out and "models in memory" in out
    assert "policy losses" in out and "cispo" in out and "math" in out


def test_last_component_of_one_nested_key_is_accepted():
    cfg = parse_args(SFTConfig, ["lr=1e-4", "r=8"])
    assert cfg.optim.lr == 1e-4 and cfg.lora.r == 8
    from posttrain.recipes.rl import RLConfig

    cfg = parse_args(RLConfig, ["max_new_tokens=24", "temperature=0.7", "seed=3"])
    assert cfg.sampling.max_new_tokens == 24 and cfg.sampling.temperature == 0.7
    assert cfg.seed == 3 and cfg.engine.seed == 0  # an exact top-level key wins over a nested one
