"""`epochs=` for sft, dpo and rm (training/epochs.py): max_steps from the data and batch sizes, which key wins, rm's
default of one epoch; and an SFT run whose data is too small for an eval split finishes and says no eval ran."""

import json
import math

import pytest

from conftest import conv, write_jsonl
from posttrain.cli import main as cli
from posttrain.config import parse_args
from posttrain.errors import UserError
from posttrain.recipes import dpo, rm, sft
from posttrain.training.epochs import resolve_max_steps, steps_for
from preference_synthetic import rule_pairs

ROWS = [conv(f"{a}+{b}?", f"{a + b}") for a in range(5) for b in range(4)]  # 20 conversations


def test_steps_for_one_and_fractional_epochs():
    assert steps_for(1, 20, 4) == 5 and steps_for(1, 21, 4) == 6 and steps_for(2.5, 20, 4) == 13 and steps_for(0.01, 20, 4) == 1


@pytest.mark.parametrize("args,want", [([], 50), (["max_steps=7"], 7), (["epochs=2"], 10), (["epochs=2", "max_steps=10"], 10)])
def test_which_key_decides(args, want):
    cfg = parse_args(sft.SFTConfig, args)
    resolve_max_steps(cfg, units=20, per_step=4, what="samples")
    assert cfg.max_steps == want


def test_disagreeing_keys_are_refused_with_the_steps_epochs_means():
    cfg = parse_args(sft.SFTConfig, ["epochs=2", "max_steps=30"])
    with pytest.raises(UserError, match=r"max_steps=30 and epochs=2 disagree: 2 epoch\(s\) of 20 samples at batch_size=4 is 10 steps"):
        resolve_max_steps(cfg, units=20, per_step=4, what="samples")


def test_rm_defaults_to_one_epoch_and_an_explicit_max_steps_wins():
    cfg = parse_args(rm.RMConfig, [])
    assert cfg.max_steps is None and cfg.epochs == 1.0
    assert resolve_max_steps(cfg, units=30, per_step=8, what="pairs") == "1 epoch(s) of 30 pairs at batch_size=8: max_steps=4"
    cfg = parse_args(rm.RMConfig, ["max_steps=3"])
    resolve_max_steps(cfg, units=30, per_step=8, what="pairs")
    assert cfg.max_steps == 3
    with pytest.raises(UserError, match="give max_steps=N"):
        resolve_max_steps(parse_args(rm.RMConfig, ["epochs=null"]), units=30, per_step=8, what="pairs")


def _steps(out_dir):
    return [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_epochs_runs_that_many_passes(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "run"
    assert cli(["sft", "model=tiny-random", f"data={data}", f"output_dir={out}", "--epochs", "2", "packing=false",
                "batch_size=4", "micro_batch_size=4", "eval_fraction=0", "max_length=64", "forgetting_probe=false",
                "sample_every=0", "save_every=0", "progress=false"]) == 0
    assert "2 epoch(s) of 20 samples at batch_size=4: max_steps=10" in capsys.readouterr().out
    assert _steps(out) == list(range(1, 11))
    saved = parse_args(sft.SFTConfig, ["--config", str(out / "config.yaml")])  # the run's own config reloads
    assert (saved.epochs, saved.max_steps) == (2.0, 10)


def test_rm_without_max_steps_trains_one_epoch(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", rule_pairs(40))
    cfg = parse_args(rm.RMConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'rm'}", "batch_size=8",
                                   "eval_fraction=0.25", "eval_every=0", "progress=false"])
    summary = rm.train(cfg)
    assert summary["steps"] == math.ceil(summary["train_pairs"] / 8) == len(_steps(tmp_path / "rm")) == 4  # not 100


def test_dpo_epochs(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", rule_pairs(40))
    cfg = parse_args(dpo.DPOConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'dpo'}", "batch_size=8",
                                     "epochs=0.5", "eval_fraction=0.25", "eval_every=0", "length_probe.prompts=0", "progress=false"])
    summary = dpo.train(cfg)
    assert summary["steps"] == math.ceil(0.5 * summary["train_examples"] / 8) == len(_steps(tmp_path / "dpo")) == 2


def test_sft_too_small_for_eval_finishes_and_says_so(tmp_path, capsys):
    """5 rows x eval_fraction 0.05 leave no eval row: final/ is written, exit 0, and the run says no eval was run
    (it used to end with `TypeError: unsupported format string passed to NoneType.__format__`, exit 1)."""
    data = write_jsonl(tmp_path / "d.jsonl", ROWS[:5])
    out = tmp_path / "run"
    assert cli(["sft", "model=tiny-random", f"data={data}", f"output_dir={out}", "max_steps=2", "batch_size=2",
                "micro_batch_size=2", "max_length=64", "sample_every=0", "progress=false"]) == 0
    printed = capsys.readouterr().out
    assert "no eval was run: the data is too small: eval_fraction=0.05 of 5 rows rounds down to none" in printed
    assert "eval: none will run" in printed  # said before training too
    assert (out / "final" / "config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_samples"] == 0 and summary["final_eval_loss"] is None and summary["eval"].startswith("the data is too small")
    assert all("eval/loss" not in json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
