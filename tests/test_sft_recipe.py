import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import conv, write_jsonl
from posttrain.config import parse_args
from posttrain.data.packing import collate
from posttrain.data.templates import render_messages
from posttrain.models.loading import load_model
from posttrain.recipes import sft
from posttrain.training import lifecycle

MULTI_TURN = [
    {"messages": [{"role": "system", "content": "You add numbers."}, *conv(f"{a}+{b}?", f"{a + b}", "and double?", f"{2 * (a + b)}")["messages"]]}
    for a in range(12) for b in range(3)
]


def run(tmp_path, *overrides, name="run"):
    data = write_jsonl(tmp_path / "multi.jsonl", MULTI_TURN)
    cfg = parse_args(sft.SFTConfig, [
        "model=tiny-random", f"data={data}", f"output_dir={tmp_path / name}", "max_steps=12", "batch_size=4",
        "micro_batch_size=2", "max_length=128", "optim.lr=3e-3", "optim.warmup_steps=2", "eval_every=6",
        "sample_every=6", "save_every=4", "progress=false", *overrides,
    ])
    return cfg, sft.train(cfg)


def test_sft_lowers_loss_and_writes_run_dir(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, summary = run(tmp_path)
    out = tmp_path / "run"
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    assert "eval/loss" in rows[5] and summary["final_eval_loss"] < rows[0]["loss"]
    for name in ["config.yaml", "metrics.jsonl", "samples.jsonl", "report.html", "dashboard.png", "summary.json"]:
        assert (out / name).is_file(), name
    assert "<svg" in (out / "report.html").read_text() and ">loss</text>" in (out / "report.html").read_text()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-12", "step-8"]
    assert "probe_loss_delta" in summary and 0 <= summary["padding_fraction"] < 0.5
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    before = load_model("tiny-random")
    changed = [n for (n, p), (_, q) in zip(model.named_parameters(), before.named_parameters()) if not torch.equal(p, q)]
    assert len(changed) == len(list(model.parameters()))
    assert tok.apply_chat_template(MULTI_TURN[0]["messages"], tokenize=False).startswith("<|im_start|>system")


def test_sft_lora_saves_adapter_and_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, summary = run(tmp_path, "lora.enabled=true", "lora.r=4", "optim.lr=1e-2", "max_steps=6", "save_every=0")
    assert 0 < summary["trainable_fraction"] < 0.2
    final = tmp_path / "run" / "final"
    merged = AutoModelForCausalLM.from_pretrained(final)
    adapted = PeftModel.from_pretrained(load_model("tiny-random"), final / "adapter").merge_and_unload()
    for (n, p), (_, q) in zip(merged.named_parameters(), adapted.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)


def test_gradient_accumulation_equals_one_big_batch(tiny_tok):
    samples = [render_messages(tiny_tok, r["messages"]) for r in MULTI_TURN[:6]]
    grads = []
    for micro in (1, 2, 6):
        model = load_model("tiny-random")
        batches = [collate([[s] for s in samples[i:i + micro]], tiny_tok.pad_token_id, packed=False) for i in range(0, 6, micro)]
        sft.accumulate_gradients(model, batches)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[1], grads[2], atol=1e-6, rtol=1e-5)


def test_interrupted_run_resumes_exactly(tmp_path, monkeypatch):
    run(tmp_path, name="straight")

    real_save = lifecycle.save_checkpoint

    def save_then_die(run_dir, step, *a, **kw):
        path = real_save(run_dir, step, *a, **kw)
        if step == 4:
            raise KeyboardInterrupt("simulated kill after checkpoint 4")
        return path

    monkeypatch.setattr(lifecycle, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, name="interrupted")
    monkeypatch.setattr(lifecycle, "save_checkpoint", real_save)
    run(tmp_path, "resume=true", name="interrupted")

    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "interrupted" / "final" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)
    la = [json.loads(l)["loss"] for l in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(l)["loss"] for l in (tmp_path / "interrupted" / "metrics.jsonl").read_text().splitlines()]
    assert la == lb


def test_existing_run_is_not_overwritten(tmp_path):
    from posttrain.errors import UserError

    run(tmp_path, "max_steps=2", "save_every=0", "sample_every=0")
    with pytest.raises(UserError, match="resume=true"):
        run(tmp_path, "max_steps=2")


def test_sft_bf16_mixed_precision_trains_fp32_weights(tmp_path):
    _, summary = run(tmp_path, "mixed_precision=bf16", "max_steps=8", "save_every=0", "eval_every=0", "sample_every=0")
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in final.values())
    with pytest.raises(Exception, match="mixed_precision"):
        parse_args(sft.SFTConfig, ["mixed_precision=fp8"])
