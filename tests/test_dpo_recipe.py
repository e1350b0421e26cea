"""`posttrain dpo`: every loss learns a rule, the reference runs once per sequence (counter), LoRA loads one
model, chosen and rejected share one forward, KTO's reference point, metrics, alarms, resume."""

import gc
import json

import pytest
import torch

from conftest import write_jsonl
from posttrain.algos import preference_losses
from posttrain.config import ConfigError, parse_args
from posttrain.recipes import dpo
from preference_synthetic import rule_pairs

BASE = ["model=tiny-random", "batch_size=8", "optim.lr=1e-3", "optim.warmup_steps=1", "eval_every=0",
        "length_probe.prompts=0", "progress=false", "eval_fraction=0.25"]


def config(tmp_path, *overrides, n=64, name="run"):
    data = write_jsonl(tmp_path / "pairs.jsonl", rule_pairs(n))
    return parse_args(dpo.DPOConfig, [*BASE, f"data={data}", f"output_dir={tmp_path / name}", *overrides])


def train_steps(cfg):
    run = dpo.setup(cfg)
    rows = [dpo.dpo_step(run, s) for s in range(run.life.start, cfg.max_steps)]
    return run, rows


@pytest.mark.parametrize("loss", preference_losses.names())
def test_every_loss_raises_held_out_preference_accuracy(tmp_path, loss):
    cfg = config(tmp_path, f"loss={loss}", "max_steps=12")
    run, rows = train_steps(cfg)
    before, after = run.initial_eval["eval/accuracy"], rows[-1]["eval/accuracy"]
    # 16 held-out pairs; chance is 0.5 (reference losses start at 0: every implicit reward is 0, ties)
    assert after >= 0.9, (loss, before, after)
    assert rows[-1]["eval/loss"] < run.initial_eval["eval/loss"], loss
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert key in rows[-1], (loss, key)
    meta = preference_losses.meta(loss)
    if meta["reference"]:
        assert "kl" in rows[-1] and "logratio/chosen" in rows[-1] and "alarm/likelihood_displacement" in rows[-1]
        assert run.ref.stats()["reference/max_per_sequence"] == 1
    else:  # orpo, simpo: no reference log-probs at all
        assert run.ref is None and not (tmp_path / "run" / "reference.json").exists()


def test_reference_runs_once_per_sequence_over_epochs_and_resume(tmp_path):
    cfg = config(tmp_path, "max_steps=6", n=24)  # 18 training pairs, 48 pairs drawn: ~2.7 epochs
    summary = dpo.train(cfg)
    n_seq = 2 * 24
    assert summary["reference/sequences"] == n_seq and summary["reference/computations"] == n_seq
    assert summary["reference/max_per_sequence"] == 1 and summary["models_loaded"] == 1
    saved = json.loads((tmp_path / "run" / "reference.json").read_text())
    assert len(saved["entries"]) == n_seq and all(count == 1 for _, _, count in saved["entries"])
    # resume past the end: the cache is reused, nothing is scored again (full fine-tuning could not)
    cfg2 = config(tmp_path, "max_steps=9", "resume=true", n=24)
    summary2 = dpo.train(cfg2)
    assert summary2["reference/computations"] == n_seq and summary2["reference/max_per_sequence"] == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 10))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert (tmp_path / "run" / "report.html").is_file() and (tmp_path / "run" / "plan.json").is_file()


def _causal_lms() -> set[int]:
    """Live transformers causal LMs (PEFT's wrapper is not one: it holds the single model it adapts)."""
    from transformers import PreTrainedModel

    return {id(o) for o in gc.get_objects() if isinstance(o, PreTrainedModel) and type(o).__name__.endswith("ForCausalLM")}


def test_lora_reference_is_the_base_with_the_adapter_disabled_and_one_model_is_loaded(tmp_path, monkeypatch):
    from posttrain.data.prefix_batch import build
    from posttrain.models.loading import load_model
    from posttrain.recipes.reference_cache import sequence_logps

    calls = []
    monkeypatch.setattr(dpo, "load_model", lambda *a, **k: calls.append(a) or load_model(*a, **k))
    gc.collect()
    before = _causal_lms()
    cfg = config(tmp_path, "lora.enabled=true", "lora.r=4", "optim.lr=1e-2", "max_steps=4")
    run, rows = train_steps(cfg)
    gc.collect()
    assert len(calls) == 1 and len(_causal_lms() - before) == 1 and run.models_loaded == 1
    assert run.ref.stats()["reference/max_per_sequence"] == 1
    ex = run.train[0]
    batch = build([(ex.prompt_ids, ex.continuations)], run.tok.pad_token_id)
    with torch.no_grad():
        with run.model.disable_adapter():
            base = sequence_logps(run.model, batch)
        policy = sequence_logps(run.model, batch)
        fresh = sequence_logps(load_model("tiny-random"), batch)
    cached = run.ref.get([("train", 0, 0), ("train", 0, 1)])
    n_tok = max(len(c) for c in ex.continuations)
    assert torch.allclose(cached, base, atol=n_tok * 7e-6) and torch.allclose(cached, fresh, atol=n_tok * 7e-6)
    assert (policy - base).abs().max() > 1e-2  # the adapter trained


def test_chosen_and_rejected_run_in_one_forward(tmp_path):
    import copy

    from posttrain.models.forward import unwrap

    cfg = config(tmp_path, "max_steps=2", "micro_batch_tokens=65536")
    run = dpo.setup(cfg)
    ids = copy.deepcopy(run.sampler).take(cfg.batch_size)
    shapes = []
    def record(m, a, kw, out):  # token ids, or their rows where the tied embedding's lookup ran first (ops/tied.py)
        shapes.append(kw["input_ids"].shape if kw.get("input_ids") is not None else kw["inputs_embeds"].shape[:2])

    handle = unwrap(run.model).model.register_forward_hook(record, with_kwargs=True)
    dpo.dpo_step(run, 0)
    handle.remove()
    # one policy forward for the whole step: 8 prompts once, then their 16 completions
    assert len(shapes) == 1
    assert shapes[0][1] == 64 * -(-sum(len(run.train[i]) for i in ids) // 64)


def test_kto_reference_point_from_mismatched_pairs(tmp_path):
    from posttrain.data.prefix_batch import build
    from posttrain.recipes.reference_cache import sequence_logps

    cfg = config(tmp_path, "loss=kto", "max_steps=3")
    run, rows = train_steps(cfg)
    assert {e.label for e in run.train} == {True, False} and len(run.train) == 2 * 48  # paired data unpaired
    assert run.evals[0].label is None  # held-out pairs stay pairs: accuracy measured as for every loss
    assert all(r["kto/z0"] >= 0 for r in rows)
    ids = [0, 5, 50, 7]
    assert dpo.kl_pairs(ids) == [(0, 7), (5, 0), (50, 5), (7, 50)]
    z0 = dpo.kto_reference_point(run, ids)
    with torch.no_grad():
        diffs = []
        for i, j in dpo.kl_pairs(ids):
            b = build([(run.train[i].prompt_ids, [run.train[j].continuations[0]])], run.tok.pad_token_id)
            diffs.append(float(sequence_logps(run.model, b)[0]) - run.ref.values[("kl", i, j)])
    assert z0 == pytest.approx(max(0.0, sum(diffs) / len(diffs)), abs=1e-4)
    assert run.ref.stats()["reference/max_per_sequence"] == 1


def test_length_probe_and_alarm_metrics(tmp_path):
    cfg = config(tmp_path, "max_steps=2", "eval_every=1", "length_probe.prompts=2", "length_probe.max_new_tokens=8")
    run, rows = train_steps(cfg)
    assert run.reference_length == 8.0  # the tiny random model never stops early
    for r in rows:
        assert r["length/reference"] == 8.0 and r["length/ratio"] == pytest.approx(r["length/policy"] / 8.0)
        assert r["alarm/length_growth"] == 0 and "alarm/likelihood_displacement" in r


@pytest.mark.parametrize("args,message", [
    (["loss=dpx"], "unknown preference loss 'dpx'"),
    (["loss=orpo", "beta=0.5"], "has no beta"),
    (["loss_args={gama: 1}", "loss=simpo"], "not arguments of preference loss 'simpo'"),
    (["loss=kto", "batch_size=1"], "batch_size >= 2"),
])
def test_config_errors(args, message):
    with pytest.raises(ConfigError) as e:
        parse_args(dpo.DPOConfig, ["data=x.jsonl", *args])
    assert message in str(e.value)


def test_kto_on_unpaired_data_reports_label_accuracy(tmp_path):
    rows = [{"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}
            for r in rule_pairs(24) for key in ("chosen", "rejected")]
    data = write_jsonl(tmp_path / "unpaired.jsonl", rows)
    cfg = parse_args(dpo.DPOConfig, [*BASE, f"data={data}", f"output_dir={tmp_path / 'run'}", "loss=kto", "max_steps=6"])
    run, out = train_steps(cfg)
    assert run.evals and all(e.label is not None for e in run.evals)
    assert out[-1]["eval/label_accuracy"] >= 0.8 and "eval/accuracy" not in out[-1]
    from posttrain.errors import DataError

    with pytest.raises(DataError, match="no usable format"):  # a paired loss cannot read unpaired data
        dpo.setup(parse_args(dpo.DPOConfig, [*BASE, f"data={data}", f"output_dir={tmp_path / 'dpo'}", "loss=dpo"]))
