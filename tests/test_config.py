import pytest

from posttrain.cli import main as cli
from posttrain.config import ConfigError, parse_args
from posttrain.recipes.sft import SFTConfig


def test_overrides_and_dotted_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_steps: 7\noptim:\n  lr: 0.5\nlora:\n  r: 4\n")
    cfg = parse_args(SFTConfig, ["--config", str(f), "optim.lr=2e-4", "lora.enabled=true", "max_length=64"])
    assert cfg.max_steps == 7 and cfg.optim.lr == 2e-4 and cfg.lora.r == 4 and cfg.lora.enabled and cfg.max_length == 64


@pytest.mark.parametrize("arg,hint", [("max_step=3", "max_steps"), ("optim.lrr=1", "optim.lr")])
def test_unknown_key_suggests_nearest(arg, hint):
    with pytest.raises(ConfigError, match=f"did you mean '{hint}'"):
        parse_args(SFTConfig, [arg])


def _recipe(name):
    from posttrain.recipes import dpo, rl, rm, rs

    return {"sft": SFTConfig, "dpo": dpo.DPOConfig, "rm": rm.RMConfig, "rl": rl.RLConfig, "rs": rs.RSConfig}[name]


# (command, TRL / transformers TrainingArguments name, posttrain's key as the hint names it)
FOREIGN = [
    ("sft", "gradient_accumulation_steps", "batch_size"),  # was "did you mean 'gradient_checkpointing'?"
    ("sft", "per_device_train_batch_size", "micro_batch_size"),
    ("dpo", "per_device_train_batch_size", "micro_batch_tokens"),
    ("sft", "num_train_epochs", "epochs"),
    ("rm", "num_train_epochs", "epochs"),
    ("rl", "num_train_epochs", "max_steps"),
    ("sft", "learning_rate", "optim.lr"),
    ("rs", "learning_rate", "train.optim.lr"),
    ("sft", "lr_scheduler_type", "optim.schedule"),
    ("sft", "max_seq_length", "max_length"),
    ("rl", "max_seq_length", "sampling.max_new_tokens"),
    ("sft", "save_steps", "save_every"),
    ("sft", "save_total_limit", "keep_checkpoints"),
    ("rl", "num_generations", "group_size"),
    ("rl", "kl_coef", "beta"),
    ("sft", "bf16", "mixed_precision"),
    ("sft", "logging_dir", "output_dir"),
    ("dpo", "loss_type", "loss"),
]


@pytest.mark.parametrize("command,name,ours", FOREIGN)
def test_other_trainers_names_are_answered_with_ours(command, name, ours):
    with pytest.raises(ConfigError, match=rf"unknown key '{name}'; posttrain calls this '{ours}' \(.*{name} is the TRL"):
        parse_args(_recipe(command), [f"{name}=1"])


@pytest.mark.parametrize("command,name,says", [("sft", "logging_steps", "logs every step"), ("sft", "beta", "has no beta"),
                                              ("rm", "beta", "has no beta")])
def test_other_trainers_names_without_a_counterpart_say_so(command, name, says):
    with pytest.raises(ConfigError, match=says):
        parse_args(_recipe(command), [f"{name}=1"])


def test_foreign_names_in_yaml_get_the_same_hint(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("gradient_accumulation_steps: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown key 'gradient_accumulation_steps'; posttrain calls this 'batch_size'"):
        parse_args(SFTConfig, ["--config", str(f)])


def test_dashed_forms_beside_key_value(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_steps: 7\n")
    cfg = parse_args(SFTConfig, ["--config", str(f), "--optim.lr", "2e-4", "--max-length=64", "--packing", "false", "--resume",
                                 "--batch_size", "4", "--no-forgetting-probe", "lora.r=4", "--progress"])
    assert (cfg.max_steps, cfg.optim.lr, cfg.max_length, cfg.packing, cfg.resume, cfg.batch_size, cfg.forgetting_probe,
            cfg.lora.r, cfg.progress) == (7, 2e-4, 64, False, True, 4, False, 4, True)
    cfg = parse_args(SFTConfig, [f"--config={f}", "--lr", "1e-3", "--r", "8", "--lora.enabled", "--max_steps", "3"])
    assert (cfg.max_steps, cfg.optim.lr, cfg.lora.r, cfg.lora.enabled) == (3, 1e-3, 8, True)  # a bool flag then a key


def test_dashed_forms_refuse_clearly():
    with pytest.raises(ConfigError, match="--max_steps needs a value"):
        parse_args(SFTConfig, ["--max_steps"])
    with pytest.raises(ConfigError, match="--max_steps needs a value"):
        parse_args(SFTConfig, ["--max_steps", "--resume"])
    with pytest.raises(ConfigError, match="unknown key 'learning_rate'; posttrain calls this 'optim.lr'"):
        parse_args(SFTConfig, ["--learning_rate", "1e-4"])
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        parse_args(SFTConfig, ["stray"])
    with pytest.raises(ConfigError, match="--config needs a file name"):
        parse_args(SFTConfig, ["--config"])


def test_cli_takes_dashed_forms_and_foreign_names(capsys):
    assert cli(["sft", "--gradient_accumulation_steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "posttrain calls this 'batch_size'" in err and "gradient_checkpointing" not in err
    with pytest.raises(SystemExit) as e:
        cli(["sft", "--max_steps", "3", "--help"])
    assert e.value.code == 0 and "--key value" in capsys.readouterr().out


def test_eval_compare_takes_dashed_keys(tmp_path, capsys):
    """`--confidence 0.9` is a key and its value: '0.9' is not taken for a results path."""
    import json

    from test_eval_cli import _fake

    a, b = _fake([0] * 10, [2] * 10)
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert cli(["eval", "compare", str(tmp_path / "a.json"), "--confidence", "0.9", str(tmp_path / "b.json"), "--bootstrap=200"]) == 0
    assert "90% paired bootstrap interval" in capsys.readouterr().out


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
