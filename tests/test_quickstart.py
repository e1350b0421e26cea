"""The quickstart pipeline on the tiny model: eval -> GRPO -> eval -> compare -> report, and resume after
an interruption (the real-model run is `make quickstart`; numbers in README.md)."""

import json

import pytest

from posttrain.recipes import quickstart

TINY = ["model=tiny-random", "eval.n=2", "eval.k=1,2", "eval.max_items=4", "eval.sampling.max_new_tokens=4",
        "rl.max_steps=4", "rl.save_every=2", "rl.prompts_per_step=2", "rl.group_size=2", "rl.sampling.max_new_tokens=4",
        "rl.mixed_precision=none", "rl.eval.n=2", "rl.eval.every=2", "rl.eval.max_items=4", "rl.optim.lr=1e-3"]


def timeless(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("tokens_per_s") and not k.endswith("seconds")}
            for r in rows]


def test_quickstart_writes_the_report(tmp_path, capsys):
    out = tmp_path / "qs"
    quickstart.main([*TINY, f"output_dir={out}"])
    printed = capsys.readouterr().out
    assert "[4/4] compare" in printed and "step   4/4" in printed and "plan:" in printed
    cmp = json.loads((out / "compare.json").read_text())
    assert cmp["bootstrap"]["items"] == 4 and "mcnemar" in cmp
    assert cmp["curve"]["ks"] == [1, 2] and cmp["curve"]["verdict"] in ("sharpening", "expanding", "unclear")
    assert [r["budget"] for r in cmp["equal_tokens"]["rows"]] == [10, 20, 40, 80, 160, 320]
    page = (out / "report.html").read_text()
    assert "held-out pass@1" in page and "training.png" in page and "Predicted vs measured" in page
    assert page.count("<svg") == 2 and "at equal generated tokens" in page  # the pass@k overlay, RL vs best-of-N
    assert (out / "training.png").stat().st_size > 10_000
    # `posttrain report` rebuilds the same page from the files alone
    (out / "report.html").unlink()
    from posttrain.cli import main

    assert main(["report", str(out)]) == 0 and (out / "report.html").read_text() == page


def test_interrupted_quickstart_resumes_to_the_same_numbers(tmp_path, monkeypatch):
    quickstart.main([*TINY, f"output_dir={tmp_path / 'straight'}"])

    calls = {"eval": 0}
    real_step, real_eval = quickstart.rl_recipe.rl_step, quickstart.run_eval_stage

    def interrupted(run, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(run, step)

    def counted(*a, **k):
        calls["eval"] += 1
        return real_eval(*a, **k)

    monkeypatch.setattr(quickstart.rl_recipe.step, "rl_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quickstart.main([*TINY, f"output_dir={tmp_path / 'resumed'}"])
    monkeypatch.setattr(quickstart.rl_recipe.step, "rl_step", real_step)
    monkeypatch.setattr(quickstart, "run_eval_stage", counted)
    quickstart.main([*TINY, f"output_dir={tmp_path / 'resumed'}"])
    assert calls["eval"] == 2  # the stage function runs twice, but the base evaluation is read back
    a, b = tmp_path / "straight", tmp_path / "resumed"
    assert timeless(a / "rl" / "metrics.jsonl") == timeless(b / "rl" / "metrics.jsonl")
    ra, rb = (json.loads((d / "eval_after" / "results.json").read_text()) for d in (a, b))
    assert [it["scores"] for it in ra["items"]] == [it["scores"] for it in rb["items"]]
    assert [s["text"] for it in ra["items"] for s in it["samples"]] == [s["text"] for it in rb["items"] for s in it["samples"]]


def test_fresh_true_starts_over(tmp_path):
    out = tmp_path / "qs"
    (out / "eval_before").mkdir(parents=True)  # a quickstart folder (only its own entries): fresh=true deletes it
    (out / "eval_before" / "stale.txt").write_text("x")
    quickstart.main([*TINY, f"output_dir={out}", "fresh=true", "rl.max_steps=1"])
    assert not (out / "eval_before" / "stale.txt").exists() and (out / "report.html").is_file()
